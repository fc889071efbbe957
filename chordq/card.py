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

import yaml
from huggingface_hub import ModelCardData, metadata_load, try_to_load_from_cache

from .models import is_nested, text_config

__all__ = ["CARD_TAGS", "render_card"]

CARD_TAGS = ["compressed-tensors", "int4", "w4a16", "kimi", "chord", "chordq"]
CHORD_URL = "https://github.com/novitalabs/chord"
_MANIFEST = "chordq_manifest.json"
_VERIFY = "chordq_verify.json"
_VERIFY_PLOT = "chordq_verify.png"
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
_HF_CACHE_SNAPSHOT = re.compile(
    r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/[0-9a-f]{40}/?$"
)


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
    candidates = [Path(source) / "README.md"] if source and Path(source).is_dir() else []
    if hub_id is not None:
        cached = try_to_load_from_cache(hub_id, "README.md")
        if isinstance(cached, str):
            candidates.append(Path(cached))
    candidates.append(out / "README.md")
    for path in candidates:
        try:
            meta = metadata_load(path) if path.is_file() else None
        except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError):
            meta = None
        if meta and meta.get("license"):
            return {
                k: str(meta[k]) for k in ("license", "license_name", "license_link") if meta.get(k)
            }
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


def _sqnr(row: dict[str, Any], key: str) -> str:
    # The report writes an infinite SQNR (bit-exact, e.g. copied native INT4) as null.
    return "exact" if row.get(key) is None and row.get("bit_exact") else _fmt(row.get(key), ".2f")


def _verify_section(out: Path, report: dict[str, Any] | None) -> list[str]:
    if report is None:
        return [f"**Not verified**: pushed with `--skip-verify`, without a `{_VERIFY}`."]
    passed = report.get("passed") is True
    lines = [f"`chordq verify`: **{'passed' if passed else 'FAILED'}** (full report: `{_VERIFY}`)."]
    layers = [row for row in report.get("layers") or [] if isinstance(row, dict)]
    if layers:
        lines += [
            "",
            "| layer | experts checked | SQNR min (dB) | SQNR mean (dB) | cos diff | status |",
            "|---:|---:|---:|---:|---:|---|",
        ]
        lines += [
            f"| {_fmt(row.get('layer'), 'd')} | {_fmt(row.get('experts_checked'), 'd')} "
            f"| {_sqnr(row, 'sqnr_min_db')} | {_sqnr(row, 'sqnr_mean_db')} "
            f"| {_fmt(row.get('cos_diff'), '.2e')} | {_fmt(row.get('status'), '')} |"
            for row in layers
        ]
    if (out / _VERIFY_PLOT).is_file():
        lines += ["", f"![per-layer verification]({_VERIFY_PLOT})"]
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
        lines.append(
            f"- conversion time: {seconds / 60:.1f} min"
            + (f", finished {finished}" if finished else "")
        )
    elif finished:
        lines.append(f"- finished: {finished}")
    lines += [
        "",
        "```bash",
        f"chordq convert {source_display} -o ./{out.name} --method {method}",
        "```",
    ]
    return lines


def _quant_section(config: dict[str, Any]) -> list[str]:
    tc, qc = text_config(config), _quant_config(config)
    w = _weights_scheme(qc)
    n_layers, dense = tc.get("num_hidden_layers", 1), tc.get("first_k_dense_replace", 0)
    dense_text = "layer 0" if dense == 1 else f"layers 0-{dense - 1}"
    symmetric = "symmetric" if w.get("symmetric", True) else "asymmetric"
    return [
        (
            f"- format: compressed-tensors `{qc.get('format', 'pack-quantized')}` "
            "(int32 words, 8 codes per word along K)"
        ),
        (
            f"- quantized: the routed experts (`mlp.experts.*.{{gate,up,down}}_proj`), "
            f"{tc.get('n_routed_experts', '?')} per MoE layer, layers {dense}-{n_layers - 1}"
        ),
        (
            f"- scheme: {symmetric} INT{w.get('num_bits', 4)}, group size {w.get('group_size', 32)} "
            "along K, BF16 scales, no zero point; activations stay BF16 (weight-only)"
        ),
        "- kept in BF16 (the config's `ignore` list):",
        *[
            f"  - `{p}`: {_IGNORE_MEANING.get(p, 'kept in BF16').format(dense=dense_text)}"
            for p in qc.get("ignore") or []
        ],
        "- everything else (embeddings, norms, the MoE router) is carried over unchanged",
    ]


def _serve_section(serve_repo: str) -> list[str]:
    return [
        "```bash",
        f"vllm serve {serve_repo} --moe-backend humming --tensor-parallel-size 8 --trust-remote-code",
        "```",
        "",
        (
            "`--moe-backend humming` must be asked for: vLLM does not pick Humming on its own. "
            f"Install [Chord]({CHORD_URL}) (see its README): it provides the `humming` package that "
            "vLLM's Humming backend loads. Do not also install `humming-kernels`: both provide a "
            "top-level `humming` package."
        ),
    ]


def render_card(
    out: str | Path, *, repo_id: str | None = None, base_model: str | None = None
) -> str:
    """Render ``OUT/README.md``: YAML front matter plus a Markdown body.

    :param out: a complete chordq output directory (manifest + config.json)
    :param repo_id: where the card will live; used in the ``vllm serve`` command
    :param base_model: Hub id of the source, overriding the one read from the manifest
        (needed when the source was a local directory outside the huggingface_hub cache)
    :returns: the card text; its front matter has ``base_model`` and ``base_model_relation:
        quantized`` (when a Hub id is known), the source's license fields, ``library_name``,
        ``pipeline_tag`` and ``tags``
    """
    out = Path(out)
    manifest = _read_json(out / _MANIFEST) or {}
    config = _read_json(out / "config.json") or {}
    source = str(manifest.get("source", ""))
    hub_id = base_model or _source_hub_id(source)
    source_display = hub_id or (f"./{Path(source).name}" if source else "SRC")
    data = ModelCardData(
        base_model=hub_id,
        library_name="transformers",
        pipeline_tag="image-text-to-text" if is_nested(config) else "text-generation",
        tags=list(CARD_TAGS),
        **({"base_model_relation": "quantized"} if hub_id else {}),
        **_license(out, source, hub_id),
    )
    order = ["base_model", "base_model_relation", "license", "license_name", "license_link"]
    group_size = _weights_scheme(_quant_config(config)).get("group_size", 32)
    origin = f"[{hub_id}](https://huggingface.co/{hub_id})" if hub_id else f"`{source_display}`"
    body = [
        f"# {repo_id.split('/')[-1] if repo_id else out.name}",
        "",
        (
            f"{origin} with its routed experts in INT4 (W4A16, group size {group_size}) for vLLM's "
            f"Humming MoE backend with [Chord]({CHORD_URL}), made with chordq."
        ),
        "",
        "## Quantization",
        "",
        *_quant_section(config),
        "",
        "## How it was made",
        "",
        *_made_section(manifest, source_display, out),
        "",
        "## Verification",
        "",
        *_verify_section(out, _read_json(out / _VERIFY)),
        "",
        "## Serving",
        "",
        *_serve_section(repo_id or f"./{out.name}"),
        "",
    ]
    return f"---\n{data.to_yaml(original_order=order)}\n---\n\n" + "\n".join(body)
