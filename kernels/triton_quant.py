"""Fused GPU quantizer (Triton): source weight -> packed int32 words + BF16 scales in one pass.

The GPU twin of ``chordq.quant`` (the oracle) and of ``cpu_quant`` (numba), bit-identical to
both: IEEE float32 division (``tl.div_rn``: Triton's plain ``/`` is an approximate divide on GPUs), round-half-even through the
1.5 * 2^23 trick, BF16 round-to-nearest-even scales, and the group error summed in float64 in
order k = 0..31 (each column is pulled out of the tile exactly with a masked sum), so every
implementation picks the same candidate. Conversion is I/O-bound, so clarity wins over speed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from chordq.quant import CANDIDATES, GROUP_SIZE, ZERO_GROUP_SCALE, Method, sqnr_from_sums

__all__ = ["quantize_packed_triton"]

_MAGIC = 12582912.0  # 1.5 * 2^23: (x + M) - M rounds |x| < 2^22 to nearest even


@triton.jit
def _bf16_round(x):
    # float32 -> nearest-even BF16 value, kept in float32. Done on the bits: the interpreter's
    # float32 -> bfloat16 cast truncates, the GPU's rounds; this is the same everywhere.
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    src_ptr,  # [N, K] float32 / bfloat16 / float16 / float8e4nv, contiguous
    sinv_ptr,  # [ceil(N/BN), ceil(K/BK)] float32 FP8 block scales (unused unless IS_FP8)
    divs_ptr,  # [NCAND] float32: the scale is absmax / divs[c]
    qmin_ptr,  # [NCAND] float32
    qmax_ptr,  # [NCAND] float32
    words_ptr,  # [N, K/8] int32 out
    scale_ptr,  # [N, K/32] bfloat16 out
    sig_ptr,  # [N*K/32] float64 out: sum of squares per group
    noise_ptr,  # [N*K/32] float64 out: squared error per group
    bad_ptr,  # [N*K/32] int32 out: non-finite inputs per group
    total_groups,  # N * K / 32
    groups_per_row,  # K / 32
    sinv_cols,  # ceil(K / BK)
    BN: tl.constexpr,  # FP8 block rows
    BK: tl.constexpr,  # FP8 block cols
    NCAND: tl.constexpr,  # candidates searched (1 = rtn)
    ZERO_SCALE: tl.constexpr,  # scale of an all-zero group
    IS_FP8: tl.constexpr,
    BLOCK_G: tl.constexpr,  # groups per program
):
    pid = tl.program_id(0)
    gi = pid * BLOCK_G + tl.arange(0, BLOCK_G)  # flat group index
    gmask = gi < total_groups
    col = tl.arange(0, 32)
    offs = gi[:, None].to(tl.int64) * 32 + col[None, :]
    m2 = gmask[:, None]
    w = tl.load(src_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    if IS_FP8:
        n = gi // groups_per_row
        k = (gi % groups_per_row) * 32
        s_blk = tl.load(sinv_ptr + (n // BN) * sinv_cols + k // BK, mask=gmask, other=1.0)
        w = w * s_blk[:, None]
    finite = (w == w) & (tl.abs(w) < float("inf"))
    tl.store(bad_ptr + gi, tl.sum((~finite).to(tl.int32), axis=1), mask=gmask)
    w = tl.where(finite, w, 0.0)
    amax = tl.max(tl.abs(w), axis=1)
    w64 = w.to(tl.float64)
    tl.store(sig_ptr + gi, tl.sum(w64 * w64, axis=1), mask=gmask)

    best_err = tl.full([BLOCK_G], float("inf"), tl.float64)
    best_s = tl.full([BLOCK_G], 1.0, tl.float32)
    best_lo = tl.full([BLOCK_G], -8.0, tl.float32)
    best_hi = tl.full([BLOCK_G], 7.0, tl.float32)
    for c in range(NCAND):
        div = tl.load(divs_ptr + c)
        lo = tl.load(qmin_ptr + c)
        hi = tl.load(qmax_ptr + c)
        s = _bf16_round(tl.div_rn(amax, tl.zeros_like(amax) + div))
        s = tl.where(s == 0.0, ZERO_SCALE, s)
        x = tl.div_rn(w, s[:, None] + tl.zeros_like(w))
        q = (x + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, lo), hi)
        d = w64 - (q * s[:, None]).to(tl.float64)
        d2 = d * d
        err = tl.zeros([BLOCK_G], tl.float64)
        for j in tl.static_range(32):
            err += tl.sum(tl.where(col[None, :] == j, d2, 0.0), axis=1)  # exact: one term
        better = err < best_err  # strict: ties keep the earlier (rtn-first) candidate
        best_err = tl.where(better, err, best_err)
        best_s = tl.where(better, s, best_s)
        best_lo = tl.where(better, lo, best_lo)
        best_hi = tl.where(better, hi, best_hi)

    tl.store(noise_ptr + gi, best_err, mask=gmask)
    tl.store(scale_ptr + gi, best_s.to(tl.bfloat16), mask=gmask)
    x = tl.div_rn(w, best_s[:, None] + tl.zeros_like(w))
    q = (x + 12582912.0) - 12582912.0
    q = tl.minimum(tl.maximum(q, best_lo[:, None]), best_hi[:, None])
    codes = (q.to(tl.int32) + 8).to(tl.uint32)
    codes = tl.reshape(codes, [BLOCK_G, 4, 8])
    shifts = (tl.arange(0, 8) * 4).to(tl.uint32)
    words = tl.sum(codes << shifts[None, None, :], axis=2)  # disjoint nibbles: sum == or
    woffs = gi[:, None].to(tl.int64) * 4 + tl.arange(0, 4)[None, :]
    tl.store(words_ptr + woffs, words.to(tl.int32, bitcast=True), mask=m2)


def quantize_packed_triton(
    w: torch.Tensor,
    method: Method | str = Method.MSE,
    *,
    scale_inv: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    block_g: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Quantize and pack one 2-D weight on the GPU (or the Triton interpreter).

    :param w: ``[N, K]`` float32 / bfloat16 / float16, or float8_e4m3fn with ``scale_inv``
    :returns: (words int32 ``[N, K/8]``, scale BF16 ``[N, K/32]``, SQNR dB, non-finite count)
    """
    method = Method(method)
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not divisible by the group size {GROUP_SIZE}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise TypeError(f"unsupported source dtype {w.dtype}")
    is_fp8 = w.dtype == torch.float8_e4m3fn
    bn, bk = block
    if is_fp8:
        if scale_inv is None or tuple(scale_inv.shape) != (math.ceil(n / bn), math.ceil(k / bk)):
            raise ValueError(f"FP8 weight {n}x{k} needs scale_inv of shape [{math.ceil(n / bn)}, {math.ceil(k / bk)}]")
        sinv = scale_inv.float().contiguous()
    else:
        sinv = torch.ones(1, dtype=torch.float32, device=w.device)
    dev = w.device
    cands = CANDIDATES[:1] if method is Method.RTN else CANDIDATES
    divs = torch.tensor([d / r for d, r, _, _ in cands], dtype=torch.float32, device=dev)
    qmin = torch.tensor([lo for _, _, lo, _ in cands], dtype=torch.float32, device=dev)
    qmax = torch.tensor([hi for _, _, _, hi in cands], dtype=torch.float32, device=dev)
    groups = n * k // GROUP_SIZE
    words = torch.empty(n, k // 8, dtype=torch.int32, device=dev)
    scale = torch.empty(n, k // GROUP_SIZE, dtype=torch.bfloat16, device=dev)
    sig = torch.empty(groups, dtype=torch.float64, device=dev)
    noise = torch.empty(groups, dtype=torch.float64, device=dev)
    bad = torch.empty(groups, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(groups, block_g),)
    _quantize_kernel[grid](
        w.contiguous(), sinv, divs, qmin, qmax, words, scale, sig, noise, bad,
        groups, k // GROUP_SIZE, sinv.shape[-1] if is_fp8 else 1,
        BN=bn, BK=bk, NCAND=len(cands), ZERO_SCALE=ZERO_GROUP_SCALE, IS_FP8=is_fp8, BLOCK_G=block_g,
    )
    sqnr = sqnr_from_sums(float(sig.sum()), float(noise.sum()))
    return words, scale, sqnr, int(bad.sum())
