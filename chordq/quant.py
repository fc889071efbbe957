"""Symmetric INT4 group-32 quantization: pure tensor math, no I/O, no packing.

Semantics (what every consumer of the checkpoint computes, format.md §2.3)::

    w'[n, k] = q[n, k] * scale[n, k // 32]      q in [-8, 7] (int8), scale BF16

The scale is rounded to BF16 *before* the codes are computed, so the stored scale is the one
the codes were chosen for.

Methods
-------
``rtn``  scale = absmax / 7.5, q = clamp(round(w / scale), -8, 7). This is compressed-tensors'
         minmax observer (``bit_range / 2``), bit for bit.
``mse``  per group, try ``CLIP_RATIOS`` x absmax on both grids (/7.5 with q in [-8, 7] and /7 with
         q in [-7, 7]) and keep the scale with the least squared error. Ratio 1.0 on the /7.5 grid
         *is* rtn, and ties keep the earlier candidate, so mse is never worse than rtn on any
         group (hence on any tensor).

All functions take ``w`` as a float tensor ``[..., K]`` with K % 32 == 0 and work on any device.
"""

from __future__ import annotations

import enum
import math

import torch

__all__ = [
    "GROUP_SIZE",
    "CLIP_RATIOS",
    "Method",
    "rtn_scales",
    "quantize_with_scales",
    "quantize",
    "dequantize",
    "sqnr_db",
    "sqnr_from_sums",
]

GROUP_SIZE = 32
# (divisor, qmin, qmax): the two symmetric grids the mse search walks.
GRIDS = ((7.5, -8, 7), (7.0, -7, 7))
# Clip ratios tried on each grid (1.0 first: on the /7.5 grid that candidate is rtn).
CLIP_RATIOS = tuple(round(1.0 - 0.025 * i, 4) for i in range(13))  # 1.0 .. 0.7
# Every candidate in search order: (divisor, ratio, qmin, qmax); the first one is rtn.
CANDIDATES = tuple((d, r, lo, hi) for d, lo, hi in GRIDS for r in CLIP_RATIOS)
# Scale used for an all-zero group (compressed-tensors uses the scale dtype's eps too):
# keeps every scale finite and non-zero; the codes are all 0 (code 8) either way.
ZERO_GROUP_SCALE = torch.finfo(torch.bfloat16).eps


class Method(str, enum.Enum):
    RTN = "rtn"
    MSE = "mse"


def _groups(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"K={w.shape[-1]} is not divisible by the group size {GROUP_SIZE}")
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // GROUP_SIZE, GROUP_SIZE)


def _to_scale(x: torch.Tensor) -> torch.Tensor:
    """Round candidate scales to BF16 and replace zeros (all-zero groups)."""
    s = x.to(torch.bfloat16)
    return torch.where(s == 0, torch.full_like(s, ZERO_GROUP_SCALE), s)


def rtn_scales(w: torch.Tensor) -> torch.Tensor:
    """absmax / 7.5 per group of 32 along the last dim -> BF16 ``[..., K/32]``."""
    return _to_scale(_groups(w).abs().amax(dim=-1) / _f32(7.5))


def _codes(g: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    # g float32 [..., G, 32], s float32 [..., G]; round half to even like torch.round.
    return torch.clamp(torch.round(g / s.unsqueeze(-1)), qmin, qmax)


def quantize_with_scales(
    w: torch.Tensor, scale: torch.Tensor, qmin: int = -8, qmax: int = 7
) -> torch.Tensor:
    """int8 q = clamp(round(w / scale), qmin, qmax) for given BF16 group scales."""
    g = _groups(w)
    q = _codes(g, scale.float(), qmin, qmax)
    return q.to(torch.int8).reshape(w.shape)


def _group_sq_error(g: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Squared error per group, identical on every implementation (CPU, numba, Triton).

    ``g - q*s`` is exact in float64 (both terms are float32, q*s is exact), so is its square
    (at most 52 significant bits); summing the 32 squares in order k = 0..31 then rounds the
    same way everywhere, so every implementation picks the same candidate.
    """
    d = g.double() - (q * s.unsqueeze(-1)).double()
    d = d * d
    err = d[..., 0]
    for j in range(1, GROUP_SIZE):
        err = err + d[..., j]
    return err


def _mse_one(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid search for one chunk of groups ``[..., G, 32]`` (float32)."""
    absmax = g.abs().amax(dim=-1)
    best_err = best_s = best_q = None
    for divisor, ratio, qmin, qmax in CANDIDATES:
        s = _to_scale(absmax / _f32(divisor / ratio)).float()  # ratio 1.0: exactly rtn
        q = _codes(g, s, qmin, qmax)
        err = _group_sq_error(g, q, s)
        if best_err is None:
            best_err, best_s, best_q = err, s, q
            continue
        better = err < best_err  # strict: ties keep the earlier (rtn-first) candidate
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_q = torch.where(better.unsqueeze(-1), q, best_q)
    return best_q, best_s


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# Rows per chunk: bounds the float32 working set of the search to a few MB.
_MSE_CHUNK_ELEMS = 1 << 20


def quantize(w: torch.Tensor, method: Method | str = Method.MSE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., K]`` -> (q int8 ``[..., K]``, scale BF16 ``[..., K/32]``)."""
    method = Method(method)
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf")
    if method is Method.RTN:
        scale = rtn_scales(w)
        return quantize_with_scales(w, scale), scale
    g = _groups(w)
    lead = g.shape[:-2]
    g = g.reshape(-1, g.shape[-2], GROUP_SIZE)
    rows = max(1, _MSE_CHUNK_ELEMS // (g.shape[1] * GROUP_SIZE))
    qs, ss = [], []
    for start in range(0, g.shape[0], rows):
        q, s = _mse_one(g[start : start + rows])
        qs.append(q.to(torch.int8))
        ss.append(s.to(torch.bfloat16))
    q = torch.cat(qs).reshape(w.shape)
    s = torch.cat(ss).reshape(*lead, g.shape[1])
    return q, s


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w' = q * scale, computed exactly in float32 (q has 4 bits, scale 8: the product is exact)."""
    g = q.float().reshape(*q.shape[:-1], q.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    return (g * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao ``compute_error``), float64 sums."""
    ref = reference.double()
    return sqnr_from_sums(ref.square().sum().item(), (ref - approx.double()).square().sum().item())


def sqnr_from_sums(signal: float, noise: float) -> float:
    """10 log10(signal / noise); +inf for an exact copy, -inf for an all-zero reference."""
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
