"""Structure checks of a converted checkpoint: headers and config only, no source needed.

- the index and the shards agree: every tensor where the index says, ``total_size`` exact, no
  missing or unlisted shard, no tensor stored twice;
- config.json parses with compressed-tensors' own ``QuantizationConfig`` and matches the
  tensors (4 bits, symmetric, pack-quantized, the group size read off the scale shapes);
- the ignore list (compressed-tensors' ``match_name``) covers every non-expert linear and no
  routed expert;
- every expected routed expert is present with the right names, shapes and dtypes, and nothing
  FP8 is left over.

The checks that need the expert bytes (scales, ``weight_shape`` values, codes) run while
:mod:`chordq.verify_fidelity` streams each layer.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

from .errors import InputError
from .models import (
    FP8_SCALE_SUFFIX,
    INT4_SUFFIXES,
    PROJECTIONS,
    ExpertName,
    TextArch,
    is_nested,
    parse_expert,
    text_arch,
)
from .shards import INDEX_NAME, Checkpoint, TensorInfo, load_config, read_header
from .verify_findings import _Findings, _label, _where
from .verify_thresholds import CHORD_GROUP_SIZE

# Non-expert 2-D ``.weight`` tensors that are not Linear modules in DeepSeek-V3 / Kimi K2.x:
# the router (``mlp.gate``), embeddings and norms (format.md §1.3).
_NOT_LINEAR_RE = re.compile(r"(^|\.)(gate|embed_tokens|wte|wpe|[^.]*emb[^.]*|[^.]*norm[^.]*)$")


# ---------------------------------------------------------------------------------------------
# files, index, headers


def _open_output(out: Path, f: _Findings) -> tuple[Checkpoint, dict[str, Any]]:
    """A :class:`Checkpoint` of what is really on disk, recording (not raising) every way the
    index and the shards disagree. Raises InputError only when there is nothing to verify."""
    if not out.is_dir():
        raise InputError(f"{out}: no such directory")
    config = load_config(out)
    on_disk = sorted(p.name for p in out.glob("*.safetensors"))
    stats: dict[str, Any] = {"index": (out / INDEX_NAME).is_file(), "shards_on_disk": len(on_disk)}
    weight_map: dict[str, str] | None = None
    total_size = None
    if stats["index"]:
        try:
            index = json.loads((out / INDEX_NAME).read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
            total_size = (index.get("metadata") or {}).get("total_size")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
            f.fail(
                "structure.index",
                f"{INDEX_NAME}: not a valid index (needs a weight_map object)",
                tensor=INDEX_NAME,
            )
            weight_map = None
    if weight_map is None and not on_disk:
        raise InputError(
            f"{out}: no *.safetensors files; is this a converted checkpoint directory?"
        )
    missing_files: set[str] = set()
    if weight_map is not None:
        listed = sorted({str(v) for v in weight_map.values()})
        for file in listed:
            if Path(file).is_absolute() or ".." in Path(file).parts:
                f.fail(
                    "structure.index",
                    f"{INDEX_NAME}: shard path {file!r} escapes the checkpoint directory",
                    shard=file,
                )
                missing_files.add(file)
            elif not (out / file).is_file():
                n = sum(1 for v in weight_map.values() if v == file)
                f.fail(
                    "structure.files",
                    f"shard {file} is listed in {INDEX_NAME} ({n} tensors) but missing",
                    shard=file,
                )
                missing_files.add(file)
        for file in on_disk:
            if file not in listed:
                f.fail(
                    "structure.files",
                    f"shard {file} is not listed in {INDEX_NAME}; loaders ignore it (stale file?)",
                    shard=file,
                )
        files = [x for x in listed if x not in missing_files]
    else:
        files = on_disk
        if len(files) > 1:
            f.fail(
                "structure.index",
                f"{len(files)} shards but no {INDEX_NAME}; loaders need the index for a sharded "
                "checkpoint",
            )
    headers, tensors = {}, {}
    for file in files:
        try:
            header = read_header(out, file)
        except InputError as e:
            f.fail("structure.files", str(e), shard=file)
            continue
        headers[file] = header
        for name, info in header.tensors.items():
            if name in tensors:
                f.fail(
                    "structure.index",
                    f"tensor {name} is stored twice, in {tensors[name].shard} and {file}",
                    tensor=name,
                    shard=file,
                )
                continue
            tensors[name] = info
    if weight_map is not None:
        for name, file in sorted(weight_map.items()):
            info = tensors.get(name)
            if file in missing_files:
                continue  # reported once per shard above
            if info is None:
                f.fail(
                    "structure.index",
                    f"{INDEX_NAME} lists tensor {name} in {file}, but no shard holds it",
                    tensor=name,
                    shard=file,
                )
            elif info.shard != file:
                f.fail(
                    "structure.index",
                    f"{INDEX_NAME} says tensor {name} is in {file}, but it is stored in "
                    f"{info.shard}; loaders following the index will not find it",
                    tensor=name,
                    shard=file,
                )
        for name, info in sorted(tensors.items()):
            if name not in weight_map:
                f.fail(
                    "structure.index",
                    f"tensor {name} in {info.shard} is not listed in {INDEX_NAME}",
                    tensor=name,
                    shard=info.shard,
                )
        actual = sum(i.nbytes for i in tensors.values())
        stats["total_size"] = total_size
        stats["tensor_bytes"] = actual
        if not isinstance(total_size, int) or total_size != actual:
            f.fail(
                "structure.index",
                f"{INDEX_NAME}: metadata.total_size is {total_size!r}, but the listed shards hold "
                f"{actual} tensor bytes",
                tensor=INDEX_NAME,
            )
    stats["shards"] = len(files)
    stats["tensors"] = len(tensors)
    return Checkpoint(out, config, files, headers, tensors, weight_map is not None), stats


def _arch(ckpt: Checkpoint) -> TextArch:
    try:
        arch = text_arch(ckpt.config)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(
            f"{ckpt.root / 'config.json'}: missing or invalid {e.args[0]!r}; not a Kimi K2.x / "
            "DeepSeek-V3 MoE config"
        ) from None
    if not arch.moe_layers:
        raise InputError(
            f"{ckpt.root / 'config.json'}: the config has no MoE layers; nothing to verify"
        )
    return arch


# ---------------------------------------------------------------------------------------------
# config.json against compressed-tensors and the tensors


def _quant_configs(config: dict[str, Any]) -> list[tuple[str, Any]]:
    found = []
    if is_nested(config) and "quantization_config" in config["text_config"]:
        found.append(
            ("text_config.quantization_config", config["text_config"]["quantization_config"])
        )
    if "quantization_config" in config:
        found.append(("quantization_config", config["quantization_config"]))
    return found


def _is_nonexpert_linear(info: TensorInfo) -> bool:
    name = info.name
    if not name.endswith(".weight") or len(info.shape) != 2 or parse_expert(name) is not None:
        return False
    return _NOT_LINEAR_RE.search(name[: -len(".weight")]) is None


def _vllm_name(module: str, nested: bool) -> str:
    """The module name vLLM matches the ignore list against. K2.5/K2.6 (KimiK25) rename
    ``language_model.model.`` -> ``language_model.`` and ``language_model.lm_head`` -> ``lm_head``
    (format.md §1.2); K2 / K2-Thinking keep the checkpoint names."""
    if nested and module.startswith("language_model.model."):
        return "language_model." + module[len("language_model.model.") :]
    if nested and module.startswith("language_model.lm_head"):
        return module[len("language_model.") :]
    return module


def _pattern_of(module: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def _check_config(
    ckpt: Checkpoint, arch: TextArch, groups_found: collections.Counter, f: _Findings
) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    cfg_path = "config.json"
    qcs = _quant_configs(ckpt.config)
    info: dict[str, Any] = {"quantization_config_at": [w for w, _ in qcs]}
    if not qcs:
        f.fail(
            "config.quantization",
            f"{cfg_path}: no quantization_config; vLLM would not know the experts are INT4",
        )
        return info
    nested = is_nested(ckpt.config)
    expert_module = ExpertName(arch.prefix, arch.moe_layers[0], 0, "gate_proj").module
    inferred = sorted(groups_found)
    info["group_sizes_from_scales"] = inferred
    raw_blocks = [json.dumps(qc, sort_keys=True) for _, qc in qcs]
    if len(set(raw_blocks)) > 1:
        f.fail(
            "config.quantization",
            f"{cfg_path}: text_config.quantization_config and quantization_config differ; vLLM "
            "uses the top-level one",
        )
    for where, qc in qcs:
        try:
            parsed = QuantizationConfig.model_validate(qc)
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError or a TypeError
            first = e.errors()[0] if hasattr(e, "errors") else e
            f.fail(
                "config.schema",
                f"{cfg_path}: {where} is not a valid compressed-tensors QuantizationConfig: "
                f"{first}",
            )
            continue
        if parsed.quant_method != "compressed-tensors":
            f.fail(
                "config.quantization",
                f"{cfg_path}: {where}.quant_method is {parsed.quant_method!r}, expected "
                "'compressed-tensors'",
            )
        schemes = {
            name: s
            for name, s in parsed.config_groups.items()
            if not isinstance(s, list)
            and any(t == "Linear" or match_name(expert_module, t) for t in s.targets)
        }
        if not schemes:
            f.fail(
                "config.quantization",
                f"{cfg_path}: no config group in {where} targets Linear or the routed experts "
                f"({expert_module})",
            )
        for gname, scheme in schemes.items():
            fmt = scheme.format or parsed.format
            label = f"{where}.config_groups.{gname}"
            if fmt != "pack-quantized":
                f.fail(
                    "config.quantization",
                    f"{cfg_path}: {label} format is {fmt!r}; the experts are stored pack-quantized "
                    "(int32 weight_packed)",
                )
            w = scheme.weights
            if w is None:
                f.fail(
                    "config.quantization",
                    f"{cfg_path}: {label} has no weights scheme; the experts are INT4",
                )
                continue
            expected = {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "dynamic": False,
                "actorder": None,
            }
            for key, want in expected.items():
                got = getattr(w, key)
                got = getattr(got, "value", got)
                if got != want:
                    f.fail(
                        "config.quantization",
                        f"{cfg_path}: {label}.weights.{key} is {got!r}; the tensors are "
                        f"{key}={want!r} (int32 words of 8 nibbles, no zero point)",
                    )
            for g in inferred:
                if w.group_size != g:
                    f.fail(
                        "config.quantization",
                        f"{cfg_path}: {label}.weights.group_size is {w.group_size}, but the "
                        f"scales are [N, K/{g}] (group {g}); vLLM would misread every scale",
                    )
            if scheme.input_activations is not None:
                f.fail(
                    "config.quantization",
                    f"{cfg_path}: {label} quantizes input activations; Chord runs W4A16 (BF16 "
                    "activations) only",
                )
        _check_ignore(ckpt, arch, parsed.ignore or [], where, nested, match_name, f)
    for g in inferred:
        if g != CHORD_GROUP_SIZE:
            f.fail(
                "config.quantization",
                f"expert scales give group size {g}; Chord and Humming run group "
                f"{CHORD_GROUP_SIZE} only",
            )
    return info


def _check_ignore(ckpt, arch, ignore, where, nested, match_name, f: _Findings) -> None:
    """Every non-expert linear ignored, no routed expert ignored (grouped per module pattern).

    A linear must be ignored under the name vLLM gives it (else: failure); when only its
    checkpoint name escapes the list (K2.5 ``language_model.lm_head`` vs ``lm_head``), loaders
    that keep checkpoint names (transformers with remote code) would quantize it: a warning.
    """

    def matched(name: str) -> bool:
        return any(match_name(name, pat) for pat in ignore)

    missed: dict[str, list[str]] = collections.defaultdict(list)
    missed_ckpt_name: dict[str, list[str]] = collections.defaultdict(list)
    for info in ckpt.tensors.values():
        if _is_nonexpert_linear(info):
            module = info.name[: -len(".weight")]
            if not matched(_vllm_name(module, nested)):
                missed[_pattern_of(module)].append(module)
            elif not matched(module):
                missed_ckpt_name[_pattern_of(module)].append(module)
    for pattern, modules in sorted(missed.items()):
        f.fail(
            "config.ignore",
            f"config.json: {where}.ignore does not cover {pattern} ({len(modules)} BF16 linear(s), "
            f"e.g. {min(modules)}); vLLM would expect INT4 words for it and fail to load",
            tensor=min(modules) + ".weight",
        )
    for modules in (missed_ckpt_name[k] for k in sorted(missed_ckpt_name)):
        f.warn(
            "config.ignore",
            f"config.json: {where}.ignore covers {_vllm_name(modules[0], nested)} (vLLM's name) "
            f"but not the checkpoint name {modules[0]}; loaders that keep checkpoint names "
            f"would quantize it (add 're:.*{modules[0].rsplit('.', 1)[-1]}.*')",
            tensor=modules[0] + ".weight",
        )
    wrongly: dict[str, list[str]] = collections.defaultdict(list)
    for layer in arch.moe_layers:
        fused = f"{arch.prefix}layers.{layer}.mlp.experts"
        modules = [fused] + [
            ExpertName(arch.prefix, layer, e, p).module
            for e in range(arch.n_routed_experts)
            for p in PROJECTIONS
        ]
        for m in modules:
            if matched(m) or matched(_vllm_name(m, nested)):
                wrongly[_pattern_of(m)].append(m)
    for pattern, modules in sorted(wrongly.items()):
        f.fail(
            "config.ignore",
            f"config.json: {where}.ignore matches routed experts {pattern} ({len(modules)} "
            f"modules, e.g. {modules[0]}); vLLM would load their INT4 words as BF16 weights",
        )


def _check_expert_headers(ckpt: Checkpoint, arch: TextArch, f: _Findings) -> collections.Counter:
    """Every expected expert present with the right dtypes and shapes; returns the group sizes
    read off the scale shapes (``K / scale.shape[1]``)."""
    groups: collections.Counter[int] = collections.Counter()
    expected = set()
    for ex in arch.expected_experts():
        expected.add(ex)
        n, k = arch.expert_shape(ex.proj)
        infos = {s: ckpt.tensors.get(ex.tensor(s)) for s in INT4_SUFFIXES}
        missing = [s for s, i in infos.items() if i is None]
        if missing:
            f.fail(
                "structure.experts",
                f"{_label(ex)}: {', '.join(missing)} missing ({ex.module}.*); the checkpoint is "
                "incomplete",
                **_where(ex, None, missing[0]),
            )
        packed, scale, shape = infos["weight_packed"], infos["weight_scale"], infos["weight_shape"]
        if packed is not None and (packed.dtype != "I32" or packed.shape != (n, k // 8)):
            f.fail(
                "structure.experts",
                f"{_label(ex)}: weight_packed is {packed.dtype}{list(packed.shape)}, expected "
                f"I32[{n}, {k // 8}] (8 codes per int32 along K={k})",
                **_where(ex, packed),
            )
        if scale is not None:
            if (
                scale.dtype != "BF16"
                or len(scale.shape) != 2
                or scale.shape[0] != n
                or not scale.shape[1]
                or k % scale.shape[1]
            ):
                f.fail(
                    "structure.experts",
                    f"{_label(ex)}: weight_scale is {scale.dtype}{list(scale.shape)}, expected "
                    f"BF16[{n}, {k // CHORD_GROUP_SIZE}]",
                    **_where(ex, scale),
                )
            else:
                groups[k // scale.shape[1]] += 1
        if shape is not None and (shape.dtype != "I64" or shape.shape != (2,)):
            f.fail(
                "structure.experts",
                f"{_label(ex)}: weight_shape is {shape.dtype}{list(shape.shape)}, expected I64[2]",
                **_where(ex, shape),
            )
        for suffix in ("weight", "weight_scale_inv", "weight_zero_point", "weight_g_idx"):
            if ex.tensor(suffix) in ckpt.tensors:
                info = ckpt.tensors[ex.tensor(suffix)]
                f.fail(
                    "structure.experts",
                    f"{_label(ex)}: unexpected {suffix} next to the INT4 tensors (symmetric "
                    "pack-quantized has none)",
                    **_where(ex, info),
                )
    for name, info in ckpt.tensors.items():
        parsed = parse_expert(name)
        if parsed is not None and parsed[0] not in expected:
            ex = parsed[0]
            f.fail(
                "structure.experts",
                f"tensor {name} is a routed expert the config does not have (layers "
                f"{arch.moe_layers[0]}..{arch.moe_layers[-1]}, experts "
                f"0..{arch.n_routed_experts - 1}, prefix {arch.prefix!r})",
                tensor=name,
                shard=info.shard,
            )
        elif parsed is None and (info.dtype.startswith("F8") or name.endswith(FP8_SCALE_SUFFIX)):
            f.fail(
                "structure.tensors",
                f"tensor {name} is FP8 ({info.dtype}) but the quantization_config only describes "
                "INT4 experts; vLLM would load it as garbage",
                tensor=name,
                shard=info.shard,
            )
    return groups
