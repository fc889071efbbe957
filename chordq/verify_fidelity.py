"""Fidelity checks: the output streamed layer by layer and compared with its source.

Every routed expert tensor of a layer is read once, in file order, and checked: scales finite
and non-zero, ``weight_shape`` right, codes not two's complement (their histogram feeds the
code-0 warning). With a source, each is compared with its source tensor: SQNR no worse than
plain RTN of the same source tensor (``RTN_TOLERANCE_DB``) and above ``SQNR_FLOOR_DB``; native
INT4 sources bit for bit. Then every non-expert tensor must be identical (FP8 non-expert
linears: the exact BF16 dequantization) and every other source file copied byte for byte.
The sampled experts of the layer are kept for :mod:`chordq.verify_compute`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .models import (
    FP8_SCALE_SUFFIX,
    INT4_SUFFIXES,
    PICKLE_SUFFIXES,
    PROJECTIONS,
    ExpertName,
    TextArch,
    parse_expert,
)
from .quant import GROUP_SIZE
from .shards import INDEX_NAME, Checkpoint, TensorInfo
from .sources import SourceFormat, dequant_fp8_block, fp8_block_size, fp8_scale_name
from .verify_findings import _Findings, _label, _where
from .verify_math import (
    _CENTRE_CODES,
    _EDGE_CODES,
    _code_histogram,
    _dequant,
    _diagnose,
    _first_mismatch,
    _fmt_value,
    _looks_signed,
    _rtn_sqnr,
    _sqnr,
    _sum_sq,
)
from .verify_thresholds import RTN_TOLERANCE_DB, SQNR_FLOOR_DB
from .writer import TMP_SUFFIX

# Source files convert does not carry over byte for byte (the shards are compared tensor by tensor).
_NOT_COPIED = {"config.json", INDEX_NAME}


# ---------------------------------------------------------------------------------------------
# sources: a Checkpoint and its reader (chordq.verify._open_source builds one)


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


def _stream_layer(
    layer: int,
    ckpt: Checkpoint,
    arch: TextArch,
    src: _Source | None,
    sampled: set[int],
    device: torch.device,
    read: Callable[[TensorInfo], torch.Tensor],
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
    read: Callable[[TensorInfo], torch.Tensor],
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
