"""Weighted top-k reduction of the down projection's per-route rows, in Triton.

``out[m, :] = sum_j topk_weights[m, j] * y[m * top_k + j, :]`` over the routes whose
``topk_ids[m, j] >= 0``; the rows of routes with id -1 (experts on another rank) are never
read, since the GEMMs leave them unwritten. FP32 accumulation, BF16 output.
Twin: ``reference.moe_sum_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .triton_w4a16 import _round_to_bf16

__all__ = ["moe_sum_triton"]


@triton.jit
def _moe_sum_kernel(
    y_ptr,  # bf16 [M * TOP_K, H] per-route rows
    weights_ptr,  # float32 [M, TOP_K]
    ids_ptr,  # int32 [M, TOP_K]; -1 = skip
    out_ptr,  # bf16 [M, H]
    H,
    stride_ym,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    COMPUTE_F32: tl.constexpr,  # interpreter: round to BF16 with integer ops
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + m * TOP_K + j)
        weight = tl.load(weights_ptr + m * TOP_K + j)
        # An unrouted slot reads nothing: its row limit is 0 (one compare, no scalar & vector).
        limit = tl.where(expert >= 0, H, 0)
        y = tl.load(y_ptr + (m * TOP_K + j) * stride_ym + offs, mask=offs < limit, other=0.0)
        acc += weight * y.to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, _round_to_bf16(acc, COMPUTE_F32), mask=h_mask)


# Compiled or interpreted: fixed by TRITON_INTERPRET when this module was imported.
_INTERPRETED = isinstance(_moe_sum_kernel, InterpretedFunction)


def moe_sum_triton(
    y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, block_h: int = 1024
) -> torch.Tensor:
    """BF16 ``[M, H]`` weighted sum of ``y`` BF16 ``[M * top_k, H]`` over each token's routes.

    :param topk_weights: ``[M, top_k]`` (cast to float32)
    :param topk_ids: int32 ``[M, top_k]``; -1 routes are skipped
    """
    m, top_k = topk_ids.shape
    if y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[0] != m * top_k or y.stride(-1) != 1:
        raise ValueError(f"y must be BF16 [{m * top_k}, H] with unit last stride, got {y.dtype} "
                         f"{tuple(y.shape)}")
    if y.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError("moe_sum_triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    weights = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    h = y.shape[1]
    out = torch.empty(m, h, dtype=torch.bfloat16, device=y.device)
    block_h = min(block_h, triton.next_power_of_2(h))
    if m == 0:
        return out
    grid = (m, triton.cdiv(h, block_h))
    _moe_sum_kernel[grid](y, weights, ids, out, h, y.stride(0), out.stride(0),
                          TOP_K=top_k, BLOCK_H=block_h,
                          COMPUTE_F32=_INTERPRETED, num_warps=4)
    return out
