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

The checks live in their own modules: :mod:`chordq.verify_structure` (structure),
:mod:`chordq.verify_fidelity` (the layer stream: fidelity, and the structure and code checks
that need the expert bytes), :mod:`chordq.verify_compute` (compute); their per-tensor math is in
:mod:`chordq.verify_math`, the named thresholds in :mod:`chordq.verify_thresholds` (re-exported
here) and what they record in :mod:`chordq.verify_findings`. This module opens the output and
the source, runs the checks layer by layer and assembles the report.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .errors import CheckFailed, InputError
from .models import PROJECTIONS, TextArch, text_arch
from .shards import Checkpoint, TensorInfo, open_checkpoint, read_tensor
from .sources import SourceFormat, detect_format
from .verify_compute import _compute_layer, _ensure_interpreter, _sample
from .verify_fidelity import (
    _compare_files,
    _compare_non_experts,
    _LayerStats,
    _planned_bytes,
    _Source,
    _stream_layer,
)
from .verify_findings import Finding, _Findings
from .verify_structure import _arch, _check_config, _check_expert_headers, _open_output
from .verify_thresholds import (  # noqa: F401 - every named constant stays chordq.verify.X
    CHORD_GROUP_SIZE,
    COMPUTE_TOKENS,
    DEFAULT_EXPERTS_PER_LAYER,
    DIAGNOSE_MARGIN_DB,
    INT4_MAX_COS_DIFF,
    INTERPRETED_KERNEL_MAX_WEIGHTS,
    KERNEL_MAX_COS_DIFF,
    LAYOUT_SPOT_CODES,
    MAX_FAILURES_PER_CHECK,
    ROUTING_POOL_TOKENS,
    RTN_TOLERANCE_DB,
    SEED,
    SIGNED_CODES_EDGE_RATIO,
    SMALL_MODEL_EXPERTS,
    SQNR_FLOOR_DB,
)

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

VERIFY_JSON = "chordq_verify.json"
VERIFY_PNG = "chordq_verify.png"


# ---------------------------------------------------------------------------------------------
# report objects


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


# ---------------------------------------------------------------------------------------------
# reading: every local tensor read goes through this module's read_tensor (the output through
# _Reader, a directory source through _open_source); a source is anything that gives a
# Checkpoint (local directory, Checkpoint, or e.g. a HubSource with its own read_tensor)


class _Reader:
    """Output tensor reads with a byte count."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bytes = 0

    def __call__(self, info: TensorInfo) -> torch.Tensor:
        self.bytes += info.nbytes
        return read_tensor(self.root, info)


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


# ---------------------------------------------------------------------------------------------
# layers


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


# ---------------------------------------------------------------------------------------------
# report sections, assembled from what the checks returned


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
