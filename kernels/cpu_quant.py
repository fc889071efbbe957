"""Fused CPU quantizer (numba): source weight -> packed int32 words + BF16 scales in one pass.

The CPU twin of ``chordq.quant`` (the oracle): it reads each source element once (BF16, FP16,
FP32, or FP8 e4m3 with its 128x128 block scale multiplied in), finds the group scale (rtn or the
mse grid search), and writes the compressed-tensors words directly, with no float32 copy of the
tensor. Results are bit-identical to ``chordq.quant.quantize`` followed by
``chordq.layout.pack_int4`` (same IEEE float32 division, round-half-even, BF16 round-to-nearest-
even scales, and the float64 in-order group error that makes candidate choice reproducible).

It also returns the per-row sums needed for the SQNR and the number of non-finite inputs, so no
extra pass over the tensor is needed for statistics or validation.
"""

from __future__ import annotations

import math

import numpy as np
import torch

try:
    import numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency; the torch path is the fallback
    HAVE_NUMBA = False

from chordq.quant import CANDIDATES, GROUP_SIZE, ZERO_GROUP_SCALE, Method, sqnr_from_sums

__all__ = ["HAVE_NUMBA", "quantize_packed_cpu"]

# (1 / float32(divisor / ratio)) is NOT used: the scale is absmax / float32(divisor / ratio),
# divided, exactly as the oracle does.
_DIVS = np.array([np.float32(d / r) for d, r, _, _ in CANDIDATES], dtype=np.float32)
_QMIN = np.array([lo for _, _, lo, _ in CANDIDATES], dtype=np.float32)
_QMAX = np.array([hi for _, _, _, hi in CANDIDATES], dtype=np.float32)
_FP8_LUT = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()

# Source kinds understood by the kernel.
_F32, _BF16, _FP8 = 0, 1, 3

if HAVE_NUMBA:
    _jit = numba.njit(cache=True, nogil=True, fastmath=False)

    @_jit
    def _bf16_round(x):
        # float32 -> nearest-even BF16 value (as float32), for finite x >= 0, without bit views:
        # keep 8 significant bits of the mantissa (or the fixed BF16 subnormal grid, 2^-133).
        x64 = np.float64(x)
        if x64 < 1.1754943508222875e-38:
            return np.float32(np.rint(x64 * 2.0**133) / 2.0**133)
        m, e = math.frexp(x64)
        return np.float32(math.ldexp(np.rint(m * 256.0) / 256.0, e))

    @_jit
    def _load(src, kind, n, row, lut, sinv, bn, bk):
        # src is the raw bytes [N, K * itemsize] of any source dtype; row <- float32 values
        if kind == 0:
            row[:] = src[n].view(np.float32)
        elif kind == 1:
            row[:] = (src[n].view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            k_total = row.shape[0]
            srow = sinv[n // bn]
            for kb in range(0, k_total, bk):
                scale = srow[kb // bk]
                for k in range(kb, min(kb + bk, k_total)):
                    row[k] = lut[src[n, k]] * scale

    @_jit
    def _round_clamp(x, qmin, qmax):
        # round half to even, then clamp. |x| <= ~11 here (x = w / s with s >= absmax / 10.7),
        # so adding and subtracting 1.5 * 2^23 rounds exactly like rint, and vectorizes.
        r = (x + np.float32(12582912.0)) - np.float32(12582912.0)
        r = qmin if r < qmin else r
        return qmax if r > qmax else r

    @numba.njit(cache=True, nogil=True, parallel=True, fastmath=False)
    def _quantize_kernel(src, kind, lut, sinv, bn, bk, ncand, divs, qmins, qmaxs, zero_scale,
                         words, scales, row_signal, row_noise, row_bad):
        n_rows, k_total = src.shape[0], words.shape[1] * 8
        n_groups = k_total // 32
        for n in numba.prange(n_rows):
            row = np.empty(k_total, dtype=np.float32)
            _load(src, kind, n, row, lut, sinv, bn, bk)
            amax = np.zeros(n_groups, dtype=np.float32)
            sig = 0.0
            bad = 0
            for g in range(n_groups):
                for j in range(32):
                    x = row[g * 32 + j]
                    if not np.isfinite(x):  # counted and reported by the caller as an error
                        bad += 1
                        row[g * 32 + j] = 0.0
                        x = np.float32(0.0)
                    amax[g] = max(amax[g], abs(x))
                    sig += np.float64(x) * np.float64(x)
            # mse: a [32, G] copy so the inner loops run over groups; each group's error is
            # still summed in order k = 0..31 while the CPU vectorizes across groups.
            rowt = np.ascontiguousarray(row.reshape(n_groups, 32).T) if ncand > 1 else row.reshape(1, k_total)
            best_err = np.full(n_groups, np.inf)
            best_s = np.ones(n_groups, dtype=np.float32)
            best_c = np.zeros(n_groups, dtype=np.int64)
            s_c = np.empty(n_groups, dtype=np.float32)
            err = np.empty(n_groups, dtype=np.float64)
            for c in range(ncand):
                qmin, qmax = qmins[c], qmaxs[c]
                for g in range(n_groups):
                    sc = _bf16_round(amax[g] / divs[c])
                    s_c[g] = zero_scale if sc == 0.0 else sc
                    err[g] = 0.0
                if ncand > 1:
                    for j in range(32):
                        for g in range(n_groups):
                            v = _round_clamp(rowt[j, g] / s_c[g], qmin, qmax)
                            d = np.float64(rowt[j, g]) - np.float64(v * s_c[g])
                            err[g] += d * d
                for g in range(n_groups):
                    if err[g] < best_err[g]:  # strict: ties keep the earlier candidate
                        best_err[g] = err[g]
                        best_s[g] = s_c[g]
                        best_c[g] = c
            noise = 0.0
            for g in range(n_groups):
                s = best_s[g]
                qmin, qmax = qmins[best_c[g]], qmaxs[best_c[g]]
                scales[n, g] = s
                for w in range(4):
                    word = np.uint32(0)
                    for j in range(8):
                        x = row[g * 32 + w * 8 + j]
                        v = _round_clamp(x / s, qmin, qmax)
                        d = np.float64(x) - np.float64(v * s)
                        noise += d * d
                        word |= np.uint32(np.int32(v) + 8) << np.uint32(4 * j)
                    words[n, g * 4 + w] = word
            row_signal[n] = sig
            row_noise[n] = noise
            row_bad[n] = bad


def _source_array(w: torch.Tensor) -> tuple[np.ndarray, int]:
    w = w.detach().contiguous().cpu()
    if w.dtype == torch.float16:  # numba has no float16: FP16 sources (rare) go through float32
        w = w.float()
    kinds = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float8_e4m3fn: _FP8}
    if w.dtype not in kinds:
        raise TypeError(f"unsupported source dtype {w.dtype}")
    return w.view(torch.uint8).reshape(w.shape[0], -1).numpy(), kinds[w.dtype]


def quantize_packed_cpu(
    w: torch.Tensor,
    method: Method | str = Method.MSE,
    *,
    scale_inv: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Quantize and pack one 2-D weight on the CPU.

    :param w: ``[N, K]`` float32 / bfloat16 / float16, or float8_e4m3fn with ``scale_inv``
    :param method: ``rtn`` or ``mse``
    :param scale_inv: float32 ``[ceil(N/bn), ceil(K/bk)]`` block scales of an FP8 ``w``
    :returns: (words int32 ``[N, K/8]``, scale BF16 ``[N, K/32]``, SQNR in dB, non-finite count)
    """
    if not HAVE_NUMBA:  # pragma: no cover
        raise RuntimeError("numba is not installed")
    method = Method(method)
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not divisible by the group size {GROUP_SIZE}")
    src, kind = _source_array(w)
    if kind == _FP8:
        if scale_inv is None:
            raise ValueError("an FP8 weight needs its scale_inv")
        sinv = scale_inv.detach().float().contiguous().cpu().numpy()
        bn, bk = block
        if sinv.shape != (math.ceil(n / bn), math.ceil(k / bk)):
            raise ValueError(f"scale_inv shape {sinv.shape} does not match weight {n}x{k} with block {bn}x{bk}")
    else:
        sinv, bn, bk = np.ones((1, 1), dtype=np.float32), 1 << 30, 1 << 30
    ncand = 1 if method is Method.RTN else len(_DIVS)
    words = np.empty((n, k // 8), dtype=np.uint32)
    scales = np.empty((n, k // GROUP_SIZE), dtype=np.float32)
    sig = np.empty(n, dtype=np.float64)
    noise = np.empty(n, dtype=np.float64)
    bad = np.empty(n, dtype=np.int64)
    _quantize_kernel(src, kind, _FP8_LUT, sinv, bn, bk, ncand, _DIVS, _QMIN, _QMAX,
                     np.float32(ZERO_GROUP_SCALE), words, scales, sig, noise, bad)
    sqnr = sqnr_from_sums(float(sig.sum()), float(noise.sum()))
    return (
        torch.from_numpy(words.view(np.int32)),
        torch.from_numpy(scales).to(torch.bfloat16),  # exact: every value is a BF16 number
        sqnr,
        int(bad.sum()),
    )
