"""Verify a converted checkpoint: structure, fidelity to its source, MoE compute, code statistics.

==========  ===================================================================================
check       what it proves (every failure names the tensor, shard, layer, expert and what was
            expected)
==========  ===================================================================================
structure   headers only (no source needed): the index and the shards agree (every tensor where
            the index says, ``total_size`` exact, no missing or unlisted shard); config.json
            parses with compressed-tensors' own ``QuantizationConfig`` and matches the tensors
            (4 bits, symmetric, pack-quantized, the group size read off the scale shapes);
            the ignore list (compressed-tensors' ``match_name``) covers every non-expert linear
            and no routed expert; every expected routed expert is present with the right names,
            shapes and dtypes; nothing FP8 is left over. Then, reading each expert once: scales
            finite and non-zero, ``weight_shape`` right, codes not two's complement.
fidelity    with a source: every routed expert against its source tensor, SQNR no worse than
            plain RTN of the same source tensor (``RTN_TOLERANCE_DB``) and above
            ``SQNR_FLOOR_DB``; native INT4 sources bit for bit; every non-expert tensor
            identical (FP8 non-expert linears: the exact BF16 dequantization).
compute     per MoE layer, a seeded sample of experts run as a MoE on RMS-normed activations
            routed by the layer's own router (Kimi ``noaux_tc``): a float32 MoE on the source
            weights, the PyTorch INT4 reference and the Triton kernel on the output words
            (on CPU interpreted, on the most-routed sampled experts within a weight budget);
            plus the words through Chord's indexed layout and back, and Chord's reading of
            sampled codes (format.md §4.2 closed form) against the codes chordq wrote.
codes       per layer the 16-bin code histogram; a warning when code 0 (q = -8) never appears
            (Humming then switches to its slower float4e0m3 format, kernels.md §1).
==========  ===================================================================================

Every output tensor is read once and every source tensor once, layer by layer in file order;
the compute check keeps only the sampled experts of the current layer in memory.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import __version__
from .errors import CheckFailed, InputError
from .layout import (
    chord_indexed_scale,
    chord_indexed_scale_inverse,
    chord_indexed_weight,
    chord_indexed_weight_inverse,
    unpack_codes,
)
from .models import (
    FP8_SCALE_SUFFIX,
    INT4_SUFFIXES,
    PICKLE_SUFFIXES,
    PROJECTIONS,
    ExpertName,
    TextArch,
    is_nested,
    parse_expert,
    text_arch,
    text_config,
)
from .quant import GROUP_SIZE, rtn_scales
from .shards import (
    INDEX_NAME,
    Checkpoint,
    TensorInfo,
    load_config,
    open_checkpoint,
    read_header,
    read_tensor,
)
from .sources import SourceFormat, detect_format, dequant_fp8_block, fp8_block_size, fp8_scale_name
from .writer import TMP_SUFFIX

__all__ = [
    "RTN_TOLERANCE_DB",
    "SQNR_FLOOR_DB",
    "KERNEL_MAX_COS_DIFF",
    "INT4_MAX_COS_DIFF",
    "SIGNED_CODES_EDGE_RATIO",
    "CHORD_GROUP_SIZE",
    "Finding",
    "VerifyReport",
    "verify_checkpoint",
    "parse_layers",
    "VERIFY_JSON",
    "VERIFY_PNG",
]

# ---------------------------------------------------------------------------------------------
# Named thresholds (style.md §8): every pass/fail decision below uses one of these.

# Fidelity: a quantized expert tensor may be at most this much worse (dB) than plain RTN of the
# same source tensor. chordq's mse search is never worse than rtn group by group and rtn *is*
# rtn, so only float summation order separates them.
RTN_TOLERANCE_DB = 0.01
# Fidelity: absolute floor for any expert tensor. INT4 group-32 lands at 17-21 dB on real
# weight distributions (README table); 12 dB is a 25% relative RMS error, a broken tensor.
SQNR_FLOOR_DB = 12.0
# Compute: Triton kernel vs the PyTorch INT4 reference on the same words. Chord's grouped-path
# limit (format.md §4.1); the interpreter lands near 1e-11, an H200 near 1e-6.
KERNEL_MAX_COS_DIFF = 1e-3
# Compute: the INT4 MoE vs the float MoE on the source weights. cos_diff ~ relative error^2 / 2;
# three INT4 GEMMs at 18.5 dB measure 0.02 (relative error 0.2) on the tiny models. 0.1
# (relative error ~0.45) is a gross-error bound: the per-tensor SQNR is the fine check, and a
# broken layer (flipped nibbles, another expert's scales) lands near 1.
INT4_MAX_COS_DIFF = 0.1
# Fidelity diagnosis: a failing tensor is blamed on a packing bug (flipped nibbles, signed codes)
# when reading its words that way fits the source by at least this much better.
DIAGNOSE_MARGIN_DB = 6.0
# Codes: two's-complement nibbles put the small weights at codes 0, 1, 14, 15 and leave 7, 8, 9
# nearly empty. Offset binary is the reverse; a uniform code distribution gives a ratio of 1.
# A tensor whose per-bin mass at {0, 1, 14, 15} exceeds this multiple of that at {7, 8, 9}
# holds signed codes.
SIGNED_CODES_EDGE_RATIO = 4.0
# Chord and Humming run group 32 only (format.md §3.5).
CHORD_GROUP_SIZE = 32

# Sampling for the compute check (deterministic: seeded by layer).
SMALL_MODEL_EXPERTS = 64  # layers with at most this many routed experts are computed in full
DEFAULT_EXPERTS_PER_LAYER = 8
COMPUTE_TOKENS = 32  # tokens per layer run through the MoE
ROUTING_POOL_TOKENS = 4096  # candidates routed to find tokens that reach the sampled experts
SEED = 0
# On CPU the Triton kernel runs in Triton's interpreter (~15 s per Kimi-size expert): per layer
# it runs on the first sampled experts holding at most this many INT4 weights (at least one).
INTERPRETED_KERNEL_MAX_WEIGHTS = 1 << 24
LAYOUT_SPOT_CODES = 4096  # codes per expert and layout decoded through the closed form of §4.2
# Failures kept per check in the report (the counts are always complete).
MAX_FAILURES_PER_CHECK = 50

VERIFY_JSON = "chordq_verify.json"
VERIFY_PNG = "chordq_verify.png"

# Non-expert 2-D ``.weight`` tensors that are not Linear modules in DeepSeek-V3 / Kimi K2.x:
# the router (``mlp.gate``), embeddings and norms (format.md §1.3).
_NOT_LINEAR_RE = re.compile(r"(^|\.)(gate|embed_tokens|wte|wpe|[^.]*emb[^.]*|[^.]*norm[^.]*)$")
# Source files convert does not carry over byte for byte (the shards are compared tensor by tensor).
_NOT_COPIED = {"config.json", INDEX_NAME}
_EDGE_CODES = (0, 1, 14, 15)  # q = -8, -7, 6, 7; two's complement: q = 0, 1, -2, -1
_CENTRE_CODES = (7, 8, 9)  # q = -1, 0, 1; two's complement: q = 7, -8, -7


# ---------------------------------------------------------------------------------------------
# report objects


@dataclasses.dataclass
class Finding:
    """One failed check or warning; ``message`` is a full sentence naming what was expected."""

    check: str  # e.g. "structure.index", "fidelity.sqnr", "compute.kernel"
    message: str
    tensor: str | None = None
    shard: str | None = None
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` found. ``passed`` is True when no check failed."""

    output: Path
    source: str | None
    source_format: str | None
    failures: list[Finding]
    warnings: list[Finding]
    failure_counts: dict[str, int]
    layers: list[dict[str, Any]]
    structure: dict[str, Any]
    fidelity: dict[str, Any]
    compute: dict[str, Any]
    codes: dict[str, Any]
    timing: dict[str, Any]
    json_path: Path | None = None
    plot_path: Path | None = None

    @property
    def passed(self) -> bool:
        return not self.failure_counts

    @property
    def num_failures(self) -> int:
        return sum(self.failure_counts.values())

    def to_json(self) -> dict[str, Any]:
        return _jsonable(
            {
                "chordq_version": __version__,
                "output": str(self.output),
                "source": self.source,
                "source_format": self.source_format,
                "passed": self.passed,
                "num_failures": self.num_failures,
                "failure_counts": self.failure_counts,
                "thresholds": thresholds(),
                "layers": self.layers,
                "failures": [f.to_json() for f in self.failures],
                "warnings": [w.to_json() for w in self.warnings],
                "structure": self.structure,
                "fidelity": self.fidelity,
                "compute": self.compute,
                "codes": self.codes,
                "timing": self.timing,
                "plot": str(self.plot_path) if self.plot_path else None,
            }
        )

    def raise_if_failed(self) -> None:
        """Raise :class:`CheckFailed` (exit status 1) naming the first failure."""
        if self.passed:
            return
        first = self.failures[0].message if self.failures else "see the report"
        msg = f"{self.output}: verification failed: {first}"
        if self.num_failures > 1:
            msg += f" (and {self.num_failures - 1} more)"
        if self.json_path:
            msg += f"; details in {self.json_path}"
        raise CheckFailed(msg)


def thresholds() -> dict[str, float]:
    return {
        "rtn_tolerance_db": RTN_TOLERANCE_DB,
        "sqnr_floor_db": SQNR_FLOOR_DB,
        "kernel_max_cos_diff": KERNEL_MAX_COS_DIFF,
        "int4_max_cos_diff": INT4_MAX_COS_DIFF,
        "signed_codes_edge_ratio": SIGNED_CODES_EDGE_RATIO,
        "chord_group_size": CHORD_GROUP_SIZE,
    }


def _jsonable(obj: Any) -> Any:
    """Strict JSON: +-inf and NaN become None (an infinite SQNR means bit-exact)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


class _Findings:
    def __init__(self) -> None:
        self.failures: list[Finding] = []
        self.warnings: list[Finding] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.failed_layers: set[int] = set()

    def fail(self, check: str, message: str, **where: Any) -> None:
        self.counts[check] += 1
        if where.get("layer") is not None:
            self.failed_layers.add(where["layer"])
        if self.counts[check] <= MAX_FAILURES_PER_CHECK:
            self.failures.append(Finding(check, message, **where))

    def warn(self, check: str, message: str, **where: Any) -> None:
        self.warnings.append(Finding(check, message, **where))


def _where(
    ex: ExpertName, info: TensorInfo | None = None, suffix: str | None = None
) -> dict[str, Any]:
    return {
        "tensor": ex.tensor(suffix) if suffix else (info.name if info else ex.module),
        "shard": info.shard if info else None,
        "layer": ex.layer,
        "expert": ex.expert,
        "proj": ex.proj,
    }


def _label(ex: ExpertName) -> str:
    return f"layer {ex.layer} expert {ex.expert} {ex.proj}"


# ---------------------------------------------------------------------------------------------
# sources: anything that gives a Checkpoint (local directory, Checkpoint, or e.g. a HubSource)


class _Source:
    """A source checkpoint and how to read its tensors, counting the bytes read."""

    def __init__(
        self,
        ckpt: Checkpoint,
        fmt: SourceFormat,
        read: Callable[[TensorInfo], torch.Tensor],
        label: str,
    ):
        self.ckpt, self.fmt, self.label = ckpt, fmt, label
        self._read = read
        self.bytes = 0

    def read(self, info: TensorInfo) -> torch.Tensor:
        self.bytes += info.nbytes
        return self._read(info)


def _open_source(source: Any) -> _Source | None:
    """A local directory, a :class:`Checkpoint`, or any object with a ``checkpoint`` attribute or
    method giving one (and optionally ``read_tensor(info)`` to fetch bytes, e.g. from the Hub)."""
    if source is None:
        return None
    reader = getattr(source, "read_tensor", None)
    if isinstance(source, Checkpoint):
        ckpt = source
    elif isinstance(source, (str, os.PathLike)):
        ckpt = open_checkpoint(source)
    elif hasattr(source, "checkpoint"):
        ckpt = source.checkpoint() if callable(source.checkpoint) else source.checkpoint
        if not isinstance(ckpt, Checkpoint):
            raise InputError(f"{source!r}: its checkpoint is not a chordq.shards.Checkpoint")
    else:
        raise InputError(f"{source!r}: not a checkpoint directory or source object")
    read = reader if callable(reader) else (lambda info, _root=ckpt.root: read_tensor(_root, info))
    return _Source(
        ckpt, detect_format(ckpt), read, str(getattr(source, "label", None) or ckpt.root)
    )


def _read_float(src: _Source, name: str) -> torch.Tensor:
    """A source linear weight as float32 (FP8 dequantized with its block scales)."""
    info = src.ckpt.tensors[name]
    w = src.read(info)
    if info.dtype != "F8_E4M3":
        return w.float()
    scale_name = fp8_scale_name(name)
    if scale_name not in src.ckpt.tensors:
        raise InputError(
            f"{info.shard}: FP8 tensor {name} has no {FP8_SCALE_SUFFIX.lstrip('.')} in any shard"
        )
    scale = src.read(src.ckpt.tensors[scale_name])
    bn, bk = fp8_block_size(src.ckpt.config)
    n, k = w.shape
    if n % bn == 0 and k % bk == 0 and tuple(scale.shape) == (n // bn, k // bk):
        # dequant_fp8_block's product, without materialising the [N, K] scale (bitwise equal)
        return (
            w.float().view(n // bn, bn, k // bk, bk) * scale.float().view(n // bn, 1, k // bk, 1)
        ).view(n, k)
    try:
        return dequant_fp8_block(w, scale, (bn, bk))
    except ValueError as e:
        raise InputError(f"{src.ckpt.tensors[scale_name].shard}: {scale_name}: {e}") from None


# ---------------------------------------------------------------------------------------------
# structure: files, index, headers


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


def parse_layers(spec: str | Iterable[int] | None) -> list[int] | None:
    """``"1,5,10-20"`` -> ``[1, 5, 10, ..., 20]`` (None -> None)."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        return sorted({int(x) for x in spec})
    layers: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise InputError(f"--layers {spec!r}: expected numbers and ranges like 1,5,10-20")
        lo, hi = int(m[1]), int(m[2] or m[1])
        layers.update(range(lo, hi + 1))
    return sorted(layers)


def _select_layers(arch: TextArch, layers: Iterable[int] | str | None) -> list[int]:
    wanted = parse_layers(layers)
    if wanted is None:
        return arch.moe_layers
    bad = [x for x in wanted if x not in arch.moe_layers]
    if bad:
        lo, hi = arch.moe_layers[0], arch.moe_layers[-1]
        raise InputError(
            f"--layers: {bad[0]} is not a MoE layer of this model (MoE layers are {lo}..{hi})"
        )
    return wanted


# ---------------------------------------------------------------------------------------------
# structure: config.json against compressed-tensors and the tensors


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


# ---------------------------------------------------------------------------------------------
# per-tensor math


def _first_mismatch(
    a: torch.Tensor, b: torch.Tensor
) -> tuple[tuple[int, ...], Any, Any, int] | None:
    """Bitwise comparison: (coordinate, a value, b value, number of differing elements) or None."""
    if a.dtype.is_floating_point:
        ia = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[a.element_size()]
        a_bits, b_bits = a.view(ia), b.view(ia)
    else:
        a_bits, b_bits = a, b
    ne = a_bits != b_bits
    count = int(ne.sum())
    if not count:
        return None
    flat = int(ne.reshape(-1).nonzero()[0])
    coord = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    return coord, a[coord].item(), b[coord].item(), count


def _fmt_value(v: Any, dtype: torch.dtype) -> str:
    if dtype == torch.int32:
        return f"0x{v & 0xFFFFFFFF:08x}"
    return repr(v)


def _dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``(code - 8) * scale`` ``[N, K]`` with the group size read off the shapes.

    Works on the little-endian bytes of the words: byte ``b`` of word ``w`` holds k = 8w + 2b
    in its low nibble and k = 8w + 2b + 1 in its high nibble (layout.py).
    """
    n = packed.shape[0]
    b = packed.contiguous().view(torch.uint8).view(n, -1)
    q = torch.empty(n, b.shape[1], 2, dtype=torch.float32, device=packed.device)
    q[..., 0] = b & 15
    q[..., 1] = b >> 4
    q = q.view(n, -1).sub_(8)
    return q.view(n, scale.shape[-1], -1).mul_(scale.float().unsqueeze(-1)).view(n, -1)


def _sum_sq(x: torch.Tensor) -> float:
    """Sum of squares: float32 per row, float64 across rows (matches float64 to ~1e-9)."""
    x = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
    return float((x * x).sum(dim=1).double().sum())


def _sqnr(reference: torch.Tensor, approx: torch.Tensor, signal: float | None = None) -> float:
    """quant.sqnr_db without float64 copies of the tensors (3-4x faster on CPU)."""
    noise = _sum_sq(reference - approx)
    signal = _sum_sq(reference) if signal is None else signal
    if noise == 0:
        return math.inf
    if signal == 0 or math.isnan(noise):
        return -math.inf if signal == 0 else math.nan
    return 10.0 * math.log10(signal / noise)


def _rtn_sqnr(w: torch.Tensor, signal: float | None = None) -> float:
    """SQNR of plain RTN of ``w`` (``quant.quantize(w, "rtn")`` then ``quant.dequantize``, fused:
    the same BF16 scales, ``clamp(round(w / s), -8, 7) * s``)."""
    g = w.reshape(w.shape[0], -1, GROUP_SIZE)
    s = rtn_scales(w).float().reshape(g.shape[0], g.shape[1], 1)
    q = torch.round(g / s).clamp_(-8, 7)
    return _sqnr(g, q.mul_(s), signal)


def _code_histogram(packed: torch.Tensor) -> torch.Tensor:
    """int64 [16]: how often each code 0..15 occurs (both nibbles of every byte)."""
    b = packed.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    h = torch.bincount(b, minlength=256).view(16, 16)  # [high nibble, low nibble]
    return (h.sum(dim=0) + h.sum(dim=1)).cpu()


def _looks_signed(hist: torch.Tensor) -> bool:
    edge = float(hist[list(_EDGE_CODES)].sum()) / len(_EDGE_CODES)
    centre = float(hist[list(_CENTRE_CODES)].sum()) / len(_CENTRE_CODES)
    return edge > SIGNED_CODES_EDGE_RATIO * centre


def _diagnose(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, sqnr: float) -> str:
    """Name the packing bug when another reading of the words fits the source far better."""
    flipped = "nibble order flipped within each int32 word (the highest nibble must hold k = 8w)"
    signed = "two's-complement (signed) nibbles instead of offset binary code = q + 8"
    alternatives = {flipped: _reverse_nibbles(packed), signed: packed ^ _all_nibbles(8, packed)}
    for what, words in alternatives.items():
        alt = _sqnr(w, _dequant(words, scale))
        if math.isfinite(alt) and alt > max(sqnr, -1e9) + DIAGNOSE_MARGIN_DB:
            return f"; the words fit the source at {alt:.2f} dB when read with {what}"
    return ""


def _all_nibbles(code: int, like: torch.Tensor) -> torch.Tensor:
    word = 0
    for j in range(8):
        word |= code << (4 * j)
    return torch.tensor(
        word - (1 << 32) if word >= 1 << 31 else word, dtype=torch.int32, device=like.device
    )


def _reverse_nibbles(packed: torch.Tensor) -> torch.Tensor:
    from .layout import pack_codes

    codes = unpack_codes(packed)
    return pack_codes(codes.reshape(*codes.shape[:-1], -1, 8).flip(-1).reshape(codes.shape))


# ---------------------------------------------------------------------------------------------
# the layer stream: every expert tensor of a layer read once, checked, compared, histogrammed


@dataclasses.dataclass
class _LayerStats:
    layer: int
    experts_present: set[int] = dataclasses.field(default_factory=set)
    sqnr: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {p: [] for p in PROJECTIONS}
    )
    rtn: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {p: [] for p in PROJECTIONS}
    )
    exact: int = 0
    compared: int = 0
    hist: dict[str, torch.Tensor] = dataclasses.field(
        default_factory=lambda: {p: torch.zeros(16, dtype=torch.int64) for p in PROJECTIONS}
    )
    worst: list[tuple[float, str]] = dataclasses.field(default_factory=list)


class _Reader:
    """Output tensor reads with a byte count."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bytes = 0

    def __call__(self, info: TensorInfo) -> torch.Tensor:
        self.bytes += info.nbytes
        return read_tensor(self.root, info)


def _stream_layer(
    layer: int,
    ckpt: Checkpoint,
    arch: TextArch,
    src: _Source | None,
    sampled: set[int],
    device: torch.device,
    read: _Reader,
    tick: Callable[[], None],
    f: _Findings,
) -> tuple[_LayerStats, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    stats = _LayerStats(layer)
    cache: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    todo = []
    for e in range(arch.n_routed_experts):
        for p in PROJECTIONS:
            ex = ExpertName(arch.prefix, layer, e, p)
            infos = {s: ckpt.tensors.get(ex.tensor(s)) for s in INT4_SUFFIXES}
            if all(infos.values()):
                todo.append((ex, infos))
    todo.sort(key=lambda t: (t[1]["weight_packed"].shard, t[1]["weight_packed"].start))
    n_expected = {p: arch.expert_shape(p) for p in PROJECTIONS}
    for ex, infos in todo:
        n, k = n_expected[ex.proj]
        if infos["weight_packed"].shape != (n, k // 8) or infos["weight_packed"].dtype != "I32":
            continue  # reported by the header checks
        stats.experts_present.add(ex.expert)
        packed = read(infos["weight_packed"]).to(device)
        scale = read(infos["weight_scale"]).to(device)
        shape = read(infos["weight_shape"])
        scale_ok = (
            infos["weight_scale"].dtype == "BF16"
            and scale.shape[0] == n
            and scale.shape[-1]
            and k % scale.shape[-1] == 0
        )
        if infos["weight_shape"].dtype == "I64" and shape.tolist() != [n, k]:
            f.fail(
                "structure.experts",
                f"{_label(ex)}: weight_shape holds {shape.tolist()}, expected [{n}, {k}]",
                **_where(ex, infos["weight_shape"]),
            )
        if scale_ok:
            bad = ~torch.isfinite(scale.float()) | (scale == 0)
            if bool(bad.any()):
                coord = tuple(int(i) for i in bad.nonzero()[0])
                f.fail(
                    "structure.scales",
                    f"{_label(ex)}: weight_scale{list(coord)} = {scale[coord].item()} "
                    f"({int(bad.sum())} of {scale.numel()} "
                    "scales not finite or zero); every scale must be finite and non-zero",
                    **_where(ex, infos["weight_scale"]),
                )
        hist = _code_histogram(packed)
        stats.hist[ex.proj] += hist
        if _looks_signed(hist):
            f.fail(
                "codes.signed",
                f"{_label(ex)}: codes look two's complement: codes 0/1/14/15 are "
                f"{hist[list(_EDGE_CODES)].sum() / max(hist[list(_CENTRE_CODES)].sum(), 1):.1f}x "
                "as frequent as 7/8/9; "
                "pack-quantized stores offset binary code = q + 8",
                **_where(ex, infos["weight_packed"]),
            )
        src_w = None
        if src is not None and scale_ok:
            src_w = _compare_expert(ex, infos, packed, scale, shape, src, device, stats, f)
        if ex.expert in sampled:
            cache[(ex.expert, ex.proj)] = {
                "packed": packed.cpu(),
                "scale": scale.cpu(),
                "source": None if src_w is None else src_w.cpu(),
            }
        tick()
    return stats, cache


def _compare_expert(
    ex, infos, packed, scale, shape, src: _Source, device, stats: _LayerStats, f: _Findings
):
    """Fidelity of one expert tensor against the source; returns the source weight (float32)."""
    if src.fmt is SourceFormat.INT4_CT:
        src_infos = {s: src.ckpt.tensors.get(ex.tensor(s)) for s in INT4_SUFFIXES}
        if not all(src_infos.values()):
            f.fail(
                "fidelity.source",
                f"{_label(ex)}: the native INT4 source lacks "
                f"{ex.module}.{{weight_packed, weight_scale, weight_shape}}",
                **_where(ex, infos["weight_packed"]),
            )
            return None
        s_packed, s_scale, s_shape = (src.read(src_infos[s]).to(device) for s in INT4_SUFFIXES)
        stats.compared += 1
        exact = True
        for suffix, mine, theirs in (
            ("weight_packed", packed, s_packed),
            ("weight_scale", scale, s_scale),
            ("weight_shape", shape.to(device), s_shape),
        ):
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                f.fail(
                    "fidelity.bitexact",
                    f"{_label(ex)}: {suffix} is {mine.dtype}{list(mine.shape)}, the native INT4 "
                    f"source has {theirs.dtype}{list(theirs.shape)}",
                    **_where(ex, infos[suffix]),
                )
                exact = False
                continue
            mm = _first_mismatch(mine, theirs)
            if mm is not None:
                coord, a, b, count = mm
                f.fail(
                    "fidelity.bitexact",
                    f"{_label(ex)}: {suffix} is not bit-exact with the native INT4 source: "
                    f"first difference at {list(coord)}: {_fmt_value(a, mine.dtype)}, source "
                    f"{_fmt_value(b, mine.dtype)} ({count} of {mine.numel()} differ)",
                    **_where(ex, infos[suffix]),
                )
                exact = False
        w = (
            _dequant(s_packed, s_scale)
            if s_scale.shape[-1] and s_packed.shape[-1] * 8 % s_scale.shape[-1] == 0
            else None
        )
        if exact:
            stats.exact += 1
            stats.sqnr[ex.proj].append(math.inf)
            return w
        if w is not None and packed.shape == s_packed.shape:
            sq = _sqnr(w, _dequant(packed, scale))
            stats.sqnr[ex.proj].append(sq)
            stats.worst.append((sq, ex.tensor("weight_packed")))
        return w
    name = ex.tensor("weight")
    if name not in src.ckpt.tensors:
        f.fail(
            "fidelity.source",
            f"{_label(ex)}: the source has no {name} to compare with",
            **_where(ex, infos["weight_packed"]),
        )
        return None
    w = _read_float(src, name).to(device)
    stats.compared += 1
    signal = _sum_sq(w)  # finite iff w is (cheaper than torch.isfinite)
    if not math.isfinite(signal):
        f.fail(
            "fidelity.source",
            f"{_label(ex)}: the source tensor {name} contains NaN or Inf",
            **_where(ex, src.ckpt.tensors[name]),
        )
        return None
    sq = _sqnr(w, _dequant(packed, scale), signal)
    rtn = _rtn_sqnr(w, signal) if w.shape[-1] % GROUP_SIZE == 0 else -math.inf
    stats.sqnr[ex.proj].append(sq)
    stats.rtn[ex.proj].append(rtn)
    stats.worst.append((sq, ex.tensor("weight_packed")))
    if math.isnan(sq) or sq < rtn - RTN_TOLERANCE_DB or sq < SQNR_FLOOR_DB:
        why = (
            f"below plain RTN of the same source tensor ({rtn:.2f} dB, tolerance "
            f"{RTN_TOLERANCE_DB} dB)"
            if not math.isnan(sq) and sq < rtn - RTN_TOLERANCE_DB
            else f"below the floor of {SQNR_FLOOR_DB} dB"
        )
        f.fail(
            "fidelity.sqnr",
            f"{_label(ex)}: SQNR {sq:.2f} dB against the source is {why}"
            + _diagnose(w, packed, scale, sq),
            **_where(ex, infos["weight_packed"]),
        )
    return w


# ---------------------------------------------------------------------------------------------
# non-expert tensors: identical, or the exact BF16 dequantization of an FP8 source linear


def _in_scope(name: str, layers: list[int], all_layers: bool) -> bool:
    """A non-expert tensor belongs to the checked layers (tensors outside ``layers.N`` always "
    "do)."""
    if all_layers:
        return True
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return m is None or int(m[1]) in layers


def _planned_bytes(
    ckpt: Checkpoint, arch: TextArch, layers: list[int], src: _Source | None, all_layers: bool
) -> int:
    """Bytes the stream will read (for progress): expert tensors of ``layers``, and with a source
    its expert tensors and every non-expert tensor in scope on both sides."""
    total = 0
    for layer in layers:
        for e in range(arch.n_routed_experts):
            for p in PROJECTIONS:
                ex = ExpertName(arch.prefix, layer, e, p)
                names = [ex.tensor(s) for s in INT4_SUFFIXES]
                total += sum(ckpt.tensors[n].nbytes for n in names if n in ckpt.tensors)
                if src is not None:
                    theirs = (
                        names
                        if src.fmt is SourceFormat.INT4_CT
                        else [ex.tensor("weight"), ex.tensor("weight_scale_inv")]
                    )
                    total += sum(
                        src.ckpt.tensors[n].nbytes for n in theirs if n in src.ckpt.tensors
                    )
    if src is not None:
        for c in (ckpt, src.ckpt):
            total += sum(
                i.nbytes
                for n, i in c.tensors.items()
                if parse_expert(n) is None and _in_scope(n, layers, all_layers)
            )
    return total


def _compare_non_experts(
    ckpt: Checkpoint,
    src: _Source,
    layers: list[int],
    all_layers: bool,
    read: _Reader,
    tick: Callable[[], None],
    f: _Findings,
) -> dict[str, Any]:
    consumed = {
        fp8_scale_name(n)
        for n, i in src.ckpt.tensors.items()
        if i.dtype == "F8_E4M3" and n.endswith(".weight")
    }

    def in_scope(name: str) -> bool:
        return _in_scope(name, layers, all_layers)

    out_names = [i for n, i in ckpt.tensors.items() if parse_expert(n) is None and in_scope(n)]
    out_names.sort(key=lambda i: (i.shard, i.start))
    identical = dequantized = 0
    for info in out_names:
        name = info.name
        s_info = src.ckpt.tensors.get(name)
        if s_info is None or name in consumed:
            f.fail(
                "fidelity.tensors",
                f"tensor {name} in {info.shard} has no counterpart in the source",
                tensor=name,
                shard=info.shard,
            )
            continue
        mine = read(info)
        if s_info.dtype == "F8_E4M3":
            if info.dtype != "BF16" or info.shape != s_info.shape:
                f.fail(
                    "fidelity.tensors",
                    f"tensor {name} is {info.dtype}{list(info.shape)}, expected "
                    f"BF16{list(s_info.shape)} (dequantized FP8)",
                    tensor=name,
                    shard=info.shard,
                )
                continue
            theirs = _read_float(src, name).to(torch.bfloat16)
            what = "the BF16 dequantization of the FP8 source"
            dequantized += 1
        else:
            if info.dtype != s_info.dtype or info.shape != s_info.shape:
                f.fail(
                    "fidelity.tensors",
                    f"tensor {name} is {info.dtype}{list(info.shape)}, the source has "
                    f"{s_info.dtype}{list(s_info.shape)}",
                    tensor=name,
                    shard=info.shard,
                )
                continue
            theirs = src.read(s_info)
            what = "the source"
            identical += 1
        tick()
        mm = _first_mismatch(mine, theirs)
        if mm is not None:
            coord, a, b, count = mm
            f.fail(
                "fidelity.tensors",
                f"tensor {name} differs from {what}: first at {list(coord)}: {a!r} vs {b!r} "
                f"({count} of {mine.numel()} elements)",
                tensor=name,
                shard=info.shard,
            )
    present = set(ckpt.tensors)
    for name, s_info in sorted(src.ckpt.tensors.items()):
        if (
            parse_expert(name) is None
            and name not in consumed
            and name not in present
            and in_scope(name)
        ):
            f.fail(
                "fidelity.tensors",
                f"source tensor {name} ({s_info.shard}) is missing from the output",
                tensor=name,
            )
    return {"checked": len(out_names), "identical": identical, "fp8_dequantized": dequantized}


def _compare_files(out: Path, src: _Source, f: _Findings) -> dict[str, Any]:
    """Tokenizer, generation config, remote-code files...: copied byte for byte (convert copies
    every file but the shards, config.json and the index)."""
    import filecmp

    root = Path(src.ckpt.root)
    if not root.is_dir():
        return {"checked": 0}
    checked = 0
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if (
            not p.is_file()
            or any(part.startswith(".") for part in rel.parts)
            or p.suffix in (".safetensors", *PICKLE_SUFFIXES)
        ):
            continue
        if (
            rel.as_posix() in _NOT_COPIED
            or p.name.startswith("chordq_")
            or p.name.endswith(TMP_SUFFIX)
        ):
            continue
        checked += 1
        if not (out / rel).is_file():
            f.fail(
                "fidelity.files",
                f"{rel} is in the source but missing from the output; copy it (tokenizer and "
                "remote-code files are needed to serve)",
                tensor=str(rel),
            )
        elif not filecmp.cmp(p, out / rel, shallow=False):
            f.fail("fidelity.files", f"{rel} differs from the source's copy", tensor=str(rel))
    return {"checked": checked}


# ---------------------------------------------------------------------------------------------
# compute: the MoE of the sampled experts, three ways


def _sample(n_experts: int, k: int | None, layer: int) -> list[int]:
    if k is None:
        k = n_experts if n_experts <= SMALL_MODEL_EXPERTS else DEFAULT_EXPERTS_PER_LAYER
    k = max(0, min(k, n_experts))
    if k == n_experts:
        return list(range(n_experts))
    g = torch.Generator().manual_seed(SEED * 100003 + layer)
    return sorted(torch.randperm(n_experts, generator=g)[:k].tolist())


def _ensure_interpreter(device: torch.device) -> str | None:
    """Triton on CPU runs interpreted, and TRITON_INTERPRET=1 must be set before *triton itself*
    is first imported (compressed-tensors imports it too): triton's own ``@jit`` library
    functions are built at that import. Returns why the Triton kernel cannot run here, or None.
    """
    if device.type != "cpu":
        return None
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        return None
    import triton.language.standard as tl_standard

    if type(tl_standard.sigmoid).__name__ == "InterpretedFunction":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels module may still be imported
        return None
    return (
        "triton was imported in this process before TRITON_INTERPRET=1 was set, so its CPU "
        "interpreter is off; run with TRITON_INTERPRET=1 in the environment"
    )


def _activations(
    ckpt: Checkpoint, arch: TextArch, layer: int, tokens: int, read: Callable
) -> torch.Tensor:
    """BF16 [tokens, H]: seeded hidden states, RMS-normed and scaled by the layer's own
    ``post_attention_layernorm`` (what the router and the experts see in the model)."""
    g = torch.Generator().manual_seed(SEED * 7919 + layer)
    h = torch.randn(tokens, arch.hidden_size, generator=g)
    # a few massive-activation channels, as in real LLM residual streams
    hot = torch.randperm(arch.hidden_size, generator=g)[: max(1, arch.hidden_size // 256)]
    h[:, hot] *= 8.0
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    norm = ckpt.tensors.get(f"{arch.prefix}layers.{layer}.post_attention_layernorm.weight")
    if norm is not None and norm.shape == (arch.hidden_size,):
        x = x * read(norm).float()
    return x.to(torch.bfloat16)


def _moe_float(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Plain float32 MoE on float weights ``[S, I, H]``, ``[S, I, H]``, ``[S, H, I]``."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        a = torch.nn.functional.silu(xf[tok] @ gate[e].T) * (xf[tok] @ up[e].T)
        out.index_add_(0, tok, (a @ down[e].T) * weights[tok, slot].float().unsqueeze(-1))
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den else (0.0 if float(a.norm()) == 0 else math.inf)


def _chord_code(
    packed: torch.Tensor, n: torch.Tensor, k: torch.Tensor, layout: str
) -> torch.Tensor:
    """The code Chord's kernel reads for checkpoint ``(n, k)`` out of its indexed words
    ``[..., K/16, 2N]``: format.md §4.2 solved for (row, column, nibble), independently of
    layout.py."""
    nb, t, i4 = n // 64, (n % 64) // 16, (n % 16) // 8
    r, i5, kk = k // 16, (k % 16) // 8, k % 2
    lane = (n % 8) * 4 + (k % 8) // 2
    c = nb * 128 + lane * 4 + t
    a, b = (i4, i5) if layout == "mma" else (i5, i4)
    s = 4 * a + 2 * b + kk
    p = s // 2 + 4 * (s % 2)
    return (packed[..., r, c] >> (4 * p)) & 0xF


def _check_chord_layout(
    layer: int,
    experts: list[int],
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]],
    f: _Findings,
) -> dict[str, Any]:
    """Checkpoint words -> Chord's indexed layout -> back, bit for bit; and every code Chord
    reads (closed form) equals the code chordq wrote."""
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(SEED + layer)
    for name, (words, scale) in stacks.items():
        n, k = words.shape[1], words.shape[2] * 8
        if n % 128 or k % 64:
            out[name] = (
                f"skipped (N={n}, K={k}: Chord's indexed layout needs N % 128 == 0, K % 64 == 0)"
            )
            continue
        codes = unpack_codes(words)
        for layout in ("mma", "wgmma"):
            packed = chord_indexed_weight(words, layout)
            back = chord_indexed_weight_inverse(packed, layout)
            mm = _first_mismatch(back, words)
            if mm is not None:
                coord, a, b, count = mm
                e = experts[coord[0]]
                f.fail(
                    "compute.layout",
                    f"layer {layer} expert {e} {name}: Chord {layout} layout round trip differs at "
                    f"word {list(coord[1:])}: 0x{a & 0xFFFFFFFF:08x} vs 0x{b & 0xFFFFFFFF:08x} "
                    f"({count} words)",
                    layer=layer,
                    expert=e,
                )
            nn = torch.randint(0, n, (LAYOUT_SPOT_CODES,), generator=g)
            kk = torch.randint(0, k, (LAYOUT_SPOT_CODES,), generator=g)
            got = _chord_code(packed, nn, kk, layout).to(torch.uint8)  # [E, spots]
            bad = (got != codes[:, nn, kk]).nonzero()
            if len(bad):
                i, j = (int(v) for v in bad[0])
                f.fail(
                    "compute.layout",
                    f"layer {layer} expert {experts[i]} {name}: Chord's {layout} kernel would read "
                    f"code {int(got[i, j])} "
                    f"at [n={int(nn[j])}, k={int(kk[j])}], chordq wrote "
                    f"{int(codes[i, nn[j], kk[j]])}",
                    layer=layer,
                    expert=experts[i],
                )
        s_back = chord_indexed_scale_inverse(chord_indexed_scale(scale))
        if _first_mismatch(s_back, scale) is not None:
            f.fail(
                "compute.layout",
                f"layer {layer} {name}: Chord indexed scale round trip is not exact",
                layer=layer,
            )
        out[name] = "ok"
    return out


def _compute_layer(
    layer: int,
    ckpt: Checkpoint,
    arch: TextArch,
    experts: list[int],
    cache: dict,
    has_source: bool,
    device: torch.device,
    kernel_issue: str | None,
    read: Callable,
    f: _Findings,
) -> dict[str, Any]:
    from .kernels import cos_diff, fused_moe, route

    tc = text_config(ckpt.config)
    experts = [e for e in experts if all((e, p) in cache for p in PROJECTIONS)]
    result: dict[str, Any] = {"layer": layer, "experts": experts}
    if not experts:
        result["skipped"] = "no sampled expert is complete"
        return result
    gate_name = f"{arch.prefix}layers.{layer}.mlp.gate.weight"
    bias_name = f"{arch.prefix}layers.{layer}.mlp.gate.e_score_correction_bias"
    if gate_name not in ckpt.tensors:
        f.fail(
            "compute.router",
            f"layer {layer}: router weight {gate_name} is missing",
            layer=layer,
            tensor=gate_name,
        )
        return result
    router = read(ckpt.tensors[gate_name]).float()
    bias = (
        read(ckpt.tensors[bias_name]).float()
        if bias_name in ckpt.tensors
        else torch.zeros(router.shape[0])
    )
    top_k = int(tc.get("num_experts_per_tok") or arch.num_experts_per_tok)
    scaling = float(tc.get("routed_scaling_factor") or 1.0)
    n_group, topk_group = int(tc.get("n_group") or 1), int(tc.get("topk_group") or 1)
    renorm = bool(tc.get("norm_topk_prob", True))
    full = len(experts) == arch.n_routed_experts
    pool = _activations(ckpt, arch, layer, COMPUTE_TOKENS if full else ROUTING_POOL_TOKENS, read)
    weights, ids = route(pool.float() @ router.T, bias, top_k, scaling, n_group, topk_group, renorm)
    local = torch.full((arch.n_routed_experts,), -1, dtype=torch.int32)
    local[torch.tensor(experts)] = torch.arange(len(experts), dtype=torch.int32)
    lids = local[ids.long()]
    if not full:  # keep the tokens that reach a sampled expert
        keep = (lids >= 0).any(dim=1).nonzero().squeeze(1)[:COMPUTE_TOKENS]
        pool, weights, lids = pool[keep], weights[keep], lids[keep]
    routes = collections.Counter(int(e) for e in lids[lids >= 0].tolist())
    result.update(
        {
            "tokens": int(pool.shape[0]),
            "top_k": top_k,
            "routes": int(sum(routes.values())),
            "experts_hit": len(routes),
        }
    )
    if not routes:
        f.warn(
            "compute.routing",
            f"layer {layer}: no token of {ROUTING_POOL_TOKENS} reached the sampled experts; "
            "compute not checked",
            layer=layer,
        )
        return result

    def stack(proj: str, part: str) -> torch.Tensor:
        return torch.stack([cache[(e, proj)][part] for e in experts])

    w13 = torch.cat([stack("gate_proj", "packed"), stack("up_proj", "packed")], dim=1).contiguous()
    s13 = torch.cat([stack("gate_proj", "scale"), stack("up_proj", "scale")], dim=1).contiguous()
    w2, s2 = stack("down_proj", "packed").contiguous(), stack("down_proj", "scale").contiguous()
    # The kernel's own check: every sampled expert on a GPU; interpreted on CPU, the most routed
    # of them within INTERPRETED_KERNEL_MAX_WEIGHTS (at least one), checked against the reference
    # on the same routes. The Chord layout check (CPU work of the same order) takes that subset.
    n_kernel = len(experts)
    if device.type == "cpu":
        per_expert = 3 * arch.hidden_size * arch.moe_intermediate_size
        n_kernel = max(1, min(len(experts), INTERPRETED_KERNEL_MAX_WEIGHTS // per_expert))
    chosen = sorted(i for i, _ in routes.most_common(n_kernel)) if n_kernel < len(experts) else None
    sub = chosen if chosen is not None else list(range(len(experts)))
    result["kernel_experts"] = [experts[i] for i in sub]
    result["chord_layout"] = _check_chord_layout(
        layer,
        result["kernel_experts"],
        {"w13 (gate+up)": (w13[sub], s13[sub]), "w2 (down)": (w2[sub], s2[sub])},
        f,
    )
    x = pool.to(device)
    weights_d, lids_d = weights.to(device), lids.to(device)
    stacks = [t.to(device) for t in (w13, s13, w2, s2)]
    ref = fused_moe(x, *stacks, weights_d, lids_d, impl="reference").float().cpu()
    outputs = {"int4_reference": ref}
    kids = lids_d
    if chosen is not None:
        kids = torch.where(torch.isin(lids_d, torch.tensor(chosen, device=device)), lids_d, -1)
    if kernel_issue is None:
        try:
            outputs["triton"] = fused_moe(x, *stacks, weights_d, kids, impl="triton").float().cpu()
            outputs["kernel_reference"] = (
                ref
                if kids is lids_d
                else fused_moe(x, *stacks, weights_d, kids, impl="reference").float().cpu()
            )
        except Exception as e:  # noqa: BLE001 - a kernel crash on these words is a failed check
            f.fail(
                "compute.kernel",
                f"layer {layer}: the Triton kernel raised {type(e).__name__}: {e}",
                layer=layer,
            )
    else:
        f.warn(
            "compute.kernel", f"layer {layer}: Triton kernel not run: {kernel_issue}", layer=layer
        )
    if has_source and all(
        cache[(e, p)]["source"] is not None for e in experts for p in PROJECTIONS
    ):
        srcw = {p: torch.stack([cache[(e, p)]["source"] for e in experts]) for p in PROJECTIONS}
        outputs["source"] = _moe_float(
            pool, srcw["gate_proj"], srcw["up_proj"], srcw["down_proj"], weights, lids
        )
    pairs = {}
    comparisons = [
        ("triton", "kernel_reference", "triton_vs_int4_reference"),
        ("int4_reference", "source", "int4_reference_vs_source"),
    ]
    if chosen is None:
        comparisons.append(("triton", "source", "triton_vs_source"))
    for a, b, key in comparisons:
        if a in outputs and b in outputs:
            pairs[key] = {
                "cos_diff": cos_diff(outputs[a], outputs[b]),
                "rel_err": _rel_err(outputs[a], outputs[b]),
            }
    result["pairs"] = pairs
    kern = pairs.get("triton_vs_int4_reference")
    if kern is not None and not kern["cos_diff"] <= KERNEL_MAX_COS_DIFF:
        f.fail(
            "compute.kernel",
            f"layer {layer}: Triton kernel vs INT4 reference cos_diff {kern['cos_diff']:.3e} > "
            f"{KERNEL_MAX_COS_DIFF:g} on experts {result['kernel_experts'][:8]}",
            layer=layer,
        )
    fid = pairs.get("int4_reference_vs_source")
    if fid is not None and not fid["cos_diff"] <= INT4_MAX_COS_DIFF:
        f.fail(
            "compute.fidelity",
            f"layer {layer}: INT4 MoE output vs the source-weight MoE cos_diff "
            f"{fid['cos_diff']:.3e} > {INT4_MAX_COS_DIFF:g} "
            f"(relative error {fid['rel_err']:.3f}) on {len(routes)} experts",
            layer=layer,
        )
    return result


# ---------------------------------------------------------------------------------------------
# the whole checkpoint


def verify_checkpoint(
    out: str | os.PathLike[str],
    source: Any = None,
    layers: Iterable[int] | str | None = None,
    experts_per_layer: int | None = None,
    device: str = "cpu",
    json_path: str | os.PathLike[str] | None = None,
    *,
    plot: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check a converted checkpoint; write ``chordq_verify.json`` and ``chordq_verify.png``.

    :param out: the converted checkpoint directory
    :param source: its source (a local directory, a :class:`chordq.shards.Checkpoint`, or an
        object with a ``checkpoint`` giving one, e.g. a Hub source); None checks structure only
    :param layers: MoE layers to read and compute (``[1, 2]`` or ``"1,5,10-20"``); header
        checks always cover the whole checkpoint
    :param experts_per_layer: experts per layer run through the MoE compute check; None: all on
        layers of at most ``SMALL_MODEL_EXPERTS`` experts, else ``DEFAULT_EXPERTS_PER_LAYER``;
        0 skips the compute check
    :param device: device for the math and the kernels (``cpu``: Triton interpreted)
    :param json_path: where the JSON report goes (default ``OUT/chordq_verify.json``); the PNG
        goes next to it
    :param plot: write the PNG
    :param progress: called as ``progress(bytes_read, bytes_planned)`` after every tensor read
    :returns: a :class:`VerifyReport`; ``report.raise_if_failed()`` raises :class:`CheckFailed`
    :raises InputError: when the output or the source cannot be read as a checkpoint
    """
    t0, cpu0 = time.monotonic(), time.process_time()
    out = Path(out)
    dev = torch.device(device)
    kernel_issue = (
        _ensure_interpreter(dev) if experts_per_layer != 0 else None
    )  # before triton loads
    f = _Findings()
    report_path = Path(json_path) if json_path else out / VERIFY_JSON
    if report_path.is_file():  # a stale "passed" must not outlive a run that stops early
        report_path.unlink()
    ckpt, structure = _open_output(out, f)
    arch = _arch(ckpt)
    selected = _select_layers(arch, layers)
    src = _open_source(source)
    if src is not None:
        try:
            src_arch = text_arch(src.ckpt.config)
        except KeyError as e:
            raise InputError(
                f"{src.label}: config.json lacks {e.args[0]!r}; not a Kimi K2.x source"
            ) from None
        if src_arch != arch:
            f.fail(
                "fidelity.config",
                f"the source's architecture ({src_arch}) differs from the output's ({arch}); is "
                f"{src.label} the source of {out}?",
            )
    groups = _check_expert_headers(ckpt, arch, f)
    structure["quantization"] = _check_config(ckpt, arch, groups, f)
    structure["moe_layers"] = len(arch.moe_layers)
    structure["experts_expected"] = arch.expected_expert_modules
    t_struct, cpu_struct = time.monotonic(), time.process_time()

    read = _Reader(out)
    planned = _planned_bytes(ckpt, arch, selected, src, layers is None)

    def tick() -> None:
        if progress is not None:
            progress(read.bytes + (src.bytes if src else 0), planned)

    layer_stats: list[_LayerStats] = []
    compute_rows: list[dict[str, Any]] = []
    t_compute = cpu_compute = 0.0
    for layer in selected:
        sampled = _sample(arch.n_routed_experts, experts_per_layer, layer)
        stats, cache = _stream_layer(layer, ckpt, arch, src, set(sampled), dev, read, tick, f)
        layer_stats.append(stats)
        if sampled:
            tc0, ctc0 = time.monotonic(), time.process_time()
            compute_rows.append(
                _compute_layer(
                    layer, ckpt, arch, sampled, cache, src is not None, dev, kernel_issue, read, f
                )
            )
            t_compute += time.monotonic() - tc0
            cpu_compute += time.process_time() - ctc0
    non_expert = (
        _compare_non_experts(ckpt, src, selected, layers is None, read, tick, f)
        if src is not None
        else None
    )
    if non_expert is not None:
        non_expert["files"] = _compare_files(out, src, f)
    t_end, cpu_end = time.monotonic(), time.process_time()
    src_bytes = src.bytes if src is not None else 0

    codes = _codes_section(layer_stats, src, f)
    fidelity = _fidelity_section(layer_stats, src, non_expert)
    layer_rows = _layer_rows(layer_stats, compute_rows, arch, f)
    stream_s = (t_end - t_struct) - t_compute
    timing = {
        "seconds": t_end - t0,
        "cpu_seconds": time.process_time() - cpu0,
        "structure_s": t_struct - t0,
        "stream_s": stream_s,
        "stream_cpu_s": (cpu_end - cpu_struct) - cpu_compute,
        "compute_s": t_compute,
        "output_bytes_read": read.bytes,
        "source_bytes_read": src_bytes,
        "stream_mb_per_s": (read.bytes + src_bytes) / max(stream_s, 1e-9) / 1e6,
        "device": str(dev),
    }
    report = VerifyReport(
        output=out,
        source=src.label if src else None,
        source_format=src.fmt.value if src else None,
        failures=f.failures,
        warnings=f.warnings,
        failure_counts=dict(f.counts),
        layers=layer_rows,
        structure=structure,
        fidelity=fidelity,
        compute={
            "experts_per_layer": experts_per_layer,
            "tokens": COMPUTE_TOKENS,
            "triton": "interpreted (CPU)" if dev.type == "cpu" else f"compiled ({dev})",
            "layers": compute_rows,
        },
        codes=codes,
        timing=timing,
    )
    from .report import write_report

    write_report(report, report_path, plot=plot)
    return report


def _codes_section(
    layer_stats: list[_LayerStats], src: _Source | None, f: _Findings
) -> dict[str, Any]:
    rows, unused = [], []
    for st in layer_stats:
        total = sum(st.hist.values())
        used0 = bool(total[0] > 0)
        if not used0 and total.sum() > 0:
            unused.append(st.layer)
        rows.append(
            {
                "layer": st.layer,
                "histogram": total.tolist(),
                "per_projection": {p: h.tolist() for p, h in st.hist.items()},
                "code0_used": used0,
            }
        )
    if unused:
        native = (
            " (a bit-exact copy of native INT4 whose QAT codes span -7..7; nothing to fix in the "
            "conversion)"
            if src is not None and src.fmt is SourceFormat.INT4_CT
            else ""
        )
        f.warn(
            "codes.code0",
            f"code 0 (q = -8) is never used in {len(unused)} of {len(layer_stats)} MoE layers "
            f"({_ranges(unused)}): Humming then switches those layers to its float4e0m3 "
            f"format, 22-29% slower (kernels.md §1){native}",
        )
    return {"layers": rows, "code0_unused_layers": unused}


def _ranges(xs: list[int]) -> str:
    parts, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def _stats(xs: list[float]) -> dict[str, float | None]:
    """min / mean / max; +inf (bit-exact) propagates, so does NaN."""
    if not xs:
        return {"min": None, "mean": None, "max": None}
    return {"min": min(xs), "mean": sum(xs) / len(xs), "max": max(xs)}


def _fidelity_section(
    layer_stats: list[_LayerStats], src: _Source | None, non_expert: dict | None
) -> dict[str, Any]:
    if src is None:
        return {"checked": False}
    worst = sorted((x for st in layer_stats for x in st.worst), key=lambda t: t[0])[:10]
    return {
        "checked": True,
        "source_format": src.fmt.value,
        "experts_compared": sum(st.compared for st in layer_stats),
        "bit_exact": sum(st.exact for st in layer_stats),
        "layers": [
            {
                "layer": st.layer,
                "sqnr_db": {p: _stats(st.sqnr[p]) for p in PROJECTIONS},
                "rtn_sqnr_db": {p: _stats(st.rtn[p]) for p in PROJECTIONS},
                "sqnr_all_db": {p: st.sqnr[p] for p in PROJECTIONS},
            }
            for st in layer_stats
        ],
        "worst": [{"sqnr_db": s, "tensor": t} for s, t in worst],
        "non_expert": non_expert,
    }


def _layer_rows(
    layer_stats: list[_LayerStats], compute_rows: list[dict], arch: TextArch, f: _Findings
) -> list[dict[str, Any]]:
    by_layer = {r["layer"]: r for r in compute_rows}
    warned = {w.layer for w in f.warnings if w.layer is not None}
    code0 = next((w for w in f.warnings if w.check == "codes.code0"), None)
    rows = []
    for st in layer_stats:
        all_sqnr = [x for p in PROJECTIONS for x in st.sqnr[p]]
        s = _stats(all_sqnr)
        comp = by_layer.get(st.layer, {})
        pairs = comp.get("pairs", {})
        fid = pairs.get("int4_reference_vs_source")
        kern = pairs.get("triton_vs_int4_reference")
        no_code0 = code0 is not None and not bool(sum(st.hist.values())[0] > 0)
        status = (
            "fail"
            if st.layer in f.failed_layers
            else ("warn" if st.layer in warned or no_code0 else "pass")
        )
        rows.append(
            {
                "layer": st.layer,
                "experts_checked": len(st.experts_present),
                "experts_expected": arch.n_routed_experts,
                "experts_computed": len(comp.get("experts", [])),
                "sqnr_min_db": s["min"],
                "sqnr_mean_db": s["mean"],
                "bit_exact": st.exact,
                "cos_diff": (fid or kern or {}).get("cos_diff"),
                "cos_diff_source": fid["cos_diff"] if fid else None,
                "cos_diff_kernel": kern["cos_diff"] if kern else None,
                "code0_used": not no_code0 if code0 is not None else True,
                "status": status,
            }
        )
    return rows
