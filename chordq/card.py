"""The model card (``OUT/README.md``) for a converted checkpoint, rebuilt on every push.

Everything in it is read from the output directory: the manifest (source, method, chordq
version), ``config.json`` (the compressed-tensors scheme and ignore list) and the verify report.
The front matter is a :class:`huggingface_hub.ModelCardData`, so it is the YAML the Hub expects.

``library_name`` is ``transformers``: the Hub has no ``vllm`` library key, a compressed-tensors
checkpoint is a transformers-format checkpoint (config.json + safetensors + quantization_config),
and the Hub shows its vLLM "Use this model" snippet for text-generation models tagged
``transformers``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData, metadata_load, try_to_load_from_cache

from .models import is_nested, text_config

__all__ = ["render_card", "CARD_TAGS"]

CARD_TAGS = ["compressed-tensors", "int4", "w4a16", "kimi", "chord", "chordq"]
CHORD_URL = "https://github.com/novitalabs/chord"
_MANIFEST = "chordq_manifest.json"
_VERIFY = "chordq_verify.json"
# What each entry of Kimi's ignore list keeps in BF16 ({dense} = number of dense MLP layers).
_IGNORE_MEANING = {
    "lm_head": "the output head",
    "re:.*lm_head.*": "the output head",
    "re:.*self_attn.*": "attention (all MLA projections)",
    "re:.*shared_experts.*": "the shared experts",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*": "the dense MLP ({dense})",
    "re:.*vision_tower.*": "the vision tower",
    "re:.*mm_projector.*": "the multimodal projector",
}
_SOURCE_FORMAT = {
    "bf16": "BF16 routed experts, quantized with `--method {method}`",
    "fp8-block": "FP8 (128x128 block) routed experts, dequantized in float32 and quantized with "
    "`--method {method}`; the other FP8 linears were dequantized to BF16",
    "int4-ct": "native INT4 compressed-tensors routed experts, copied bit for bit (not requantized)",
}
_HF_CACHE_SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/[0-9a-f]{40}/?$")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _source_hub_id(source: str) -> str | None:
    """The Hub id behind a manifest source: the id itself, or a huggingface_hub cache snapshot path."""
    from .hub import is_hub_id

    if is_hub_id(source):
        return source
    m = _HF_CACHE_SNAPSHOT.search(Path(source).as_posix())
    return f"{m['owner']}/{m['name']}" if m else None


def _license(out: Path, source: str, hub_id: str | None) -> dict[str, str]:
    """license / license_name / license_link from the source's README front matter, when known.

    Tries the source directory, then the source's README in the huggingface_hub cache, then the
    README already in ``out`` (convert copies the source's; a previous push wrote a card that
    carries the same fields).
    """
    candidates = [Path(source) / "README.md"]
    if hub_id is not None:
        cached = try_to_load_from_cache(hub_id, "README.md")
        if isinstance(cached, str):
            candidates.append(Path(cached))
    candidates.append(out / "README.md")
    for path in candidates:
        try:
            meta = metadata_load(path) if path.is_file() else None
        except (OSError, ValueError, UnicodeDecodeError):
            meta = None
        if meta and meta.get("license"):
            return {k: str(meta[k]) for k in ("license", "license_name", "license_link") if meta.get(k)}
    return {}


def _quant_config(config: dict[str, Any]) -> dict[str, Any]:
    qc = text_config(config).get("quantization_config") if is_nested(config) else None
    return qc or config.get("quantization_config") or {}


def _weights_scheme(qc: dict[str, Any]) -> dict[str, Any]:
    for group in (qc.get("config_groups") or {}).values():
        if "Linear" in (group.get("targets") or []) and group.get("weights"):
            return group["weights"]
    return {}


def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, bool) or value is None:
        return "–" if value is None else str(value).lower()
    if isinstance(value, (int, float)):
        return "inf" if isinstance(value, float) and math.isinf(value) else format(value, spec)
    return str(value).replace("|", "\\|")


def _verify_section(report: dict[str, Any] | None) -> list[str]:
    if report is None:
        return ["**Not verified**: this checkpoint was pushed with `--skip-verify` and no `chordq_verify.json`."]
    passed = report.get("passed") is True
    lines = [f"`chordq verify`: **{'passed' if passed else 'FAILED'}** (report: `{_VERIFY}`)."]
    layers = [row for row in report.get("layers") or [] if isinstance(row, dict)]
    if layers:
        lines += [
            "",
            "| layer | experts checked | SQNR min (dB) | SQNR mean (dB) | cos diff | status |",
            "|---:|---:|---:|---:|---:|---|",
        ]
        for row in layers:
            lines.append(
                f"| {_fmt(row.get('layer'), 'd')} | {_fmt(row.get('experts_checked'), 'd')} "
                f"| {_fmt(row.get('sqnr_min_db'), '.2f')} | {_fmt(row.get('sqnr_mean_db'), '.2f')} "
                f"| {_fmt(row.get('cos_diff'), '.2e')} | {_fmt(row.get('status'), '')} |"
            )
    return lines


def _made_section(manifest: dict[str, Any], source_display: str, out: Path) -> list[str]:
    method = (manifest.get("options") or {}).get("method", "mse")
    fmt = manifest.get("source_format", "")
    lines = [
        f"- chordq {manifest.get('chordq_version', '?')}, `--method {method}`",
        f"- source: {_SOURCE_FORMAT.get(fmt, f'`{fmt}`').format(method=method)}",
    ]
    seconds, finished = manifest.get("seconds"), manifest.get("finished_at")
    if isinstance(seconds, (int, float)):
        lines.append(f"- conversion time: {seconds / 60:.1f} min" + (f", finished {finished}" if finished else ""))
    elif finished:
        lines.append(f"- finished: {finished}")
    lines += ["", "```bash", f"chordq convert {source_display} -o ./{out.name} --method {method}", "```"]
    return lines


def render_card(out: str | Path, *, repo_id: str | None = None, base_model: str | None = None) -> str:
    """Render ``OUT/README.md``: YAML front matter plus a Markdown body.

    :param out: a complete chordq output directory (manifest + config.json)
    :param repo_id: where the card will live; used in the ``vllm serve`` command
    :param base_model: Hub id of the source, overriding the one read from the manifest
        (needed when the source was a local directory outside the huggingface_hub cache)
    :returns: the card text; its front matter has ``base_model`` (when a Hub id is known),
        ``base_model_relation: quantized``, the source's license fields, ``library_name``,
        ``pipeline_tag`` and ``tags``
    """
    out = Path(out)
    manifest = _read_json(out / _MANIFEST) or {}
    config = _read_json(out / "config.json") or {}
    report = _read_json(out / _VERIFY)
    source = str(manifest.get("source", ""))
    hub_id = base_model or _source_hub_id(source)
    source_display = hub_id or (f"./{Path(source).name}" if source else "SRC")
    tc = text_config(config)

    data = ModelCardData(
        base_model=hub_id,
        library_name="transformers",
        pipeline_tag="image-text-to-text" if is_nested(config) else "text-generation",
        tags=list(CARD_TAGS),
        **({"base_model_relation": "quantized"} if hub_id else {}),
        **_license(out, source, hub_id),
    )
    order = ["base_model", "base_model_relation", "license", "license_name", "license_link", "library_name"]
    front = data.to_yaml(original_order=order)

    qc = _quant_config(config)
    w = _weights_scheme(qc)
    n_layers, dense = tc.get("num_hidden_layers"), tc.get("first_k_dense_replace", 0)
    dense_text = "layer 0" if dense == 1 else f"layers 0-{dense - 1}"
    kept = [
        f"- `{p}`: {_IGNORE_MEANING.get(p, 'kept in BF16').format(dense=dense_text)}" for p in qc.get("ignore") or []
    ]
    title = repo_id.split("/")[-1] if repo_id else out.name
    serve_repo = repo_id or f"./{out.name}"
    body = [
        f"# {title}",
        "",
        f"{f'[{hub_id}](https://huggingface.co/{hub_id})' if hub_id else f'`{source_display}` (a local Kimi K2.x checkpoint)'} with its routed experts in INT4 (W4A16, group size "
        f"{w.get('group_size', 32)}), for vLLM's Humming MoE backend with [Chord]({CHORD_URL}). "
        "Made with chordq.",
        "",
        "## Quantization",
        "",
        f"- format: compressed-tensors `{qc.get('format', 'pack-quantized')}` (int32 words, 8 codes per word along K)",
        f"- quantized: the routed experts (`mlp.experts.*.{{gate,up,down}}_proj`), "
        f"{tc.get('n_routed_experts', '?')} per MoE layer, layers {dense}-{(n_layers or 1) - 1}",
        f"- scheme: {'symmetric' if w.get('symmetric', True) else 'asymmetric'} "
        f"INT{w.get('num_bits', 4)}, group size {w.get('group_size', 32)} along K, BF16 scales, no zero point",
        "- activations: BF16 (weight-only quantization)",
        "- kept in BF16 (the config's `ignore` list):",
        *[f"  {line}" for line in kept],
        "- everything else (embeddings, norms, the MoE router) is carried over unchanged",
        "",
        "## How it was made",
        "",
        *_made_section(manifest, source_display, out),
        "",
        "## Verification",
        "",
        *_verify_section(report),
        "",
        "## Serving",
        "",
        "```bash",
        f"vllm serve {serve_repo} --moe-backend humming --tensor-parallel-size 8 --trust-remote-code",
        "```",
        "",
        f"`--moe-backend humming` must be asked for: vLLM does not pick Humming on its own. Install "
        f"[Chord]({CHORD_URL}) (see its README): it provides the `humming` package that vLLM's Humming "
        "backend loads. Do not also install `humming-kernels`: both provide a top-level `humming` package.",
        "",
    ]
    return f"---\n{front}\n---\n\n" + "\n".join(body)
