"""``fused_moe``: the routed-expert MoE forward, dispatched to Triton or the PyTorch reference.

Triton path (three launches after the alignment; at 128-256 rows per expert the alignment is
``moe_align_mixed``, blocks of 128, 64 and 32 rows, and each GEMM is one launch per size)::

    moe_align_block_size(topk_ids, block_m)            -> sorted ids, expert per block
    gate_up  [M, H] -> [M*top_k, I]   indexed W4A16 GEMM, SiLU-and-mul fused (top_k rows/token)
    down     [M*top_k, I] -> [M*top_k, H]   same routing, top_k = 1
    moe_sum  [M*top_k, H] -> [M, H]   weighted top-k sum, skipping expert id -1
"""

from __future__ import annotations

import torch

from .align import align_row_tiles
from .reference import fused_moe_reference
from .triton_config import SUBNORMAL_W_ORDERS, W_ORDERS

__all__ = ["fused_moe", "prepare_weights"]

IMPLS = ("auto", "reference", "triton")


def _check_inputs(
    hidden_states: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    if hidden_states.dim() != 2 or hidden_states.dtype != torch.bfloat16:
        raise ValueError(f"hidden_states must be BF16 [M, H], got {hidden_states.dtype} "
                         f"{tuple(hidden_states.shape)}")
    m, h = hidden_states.shape
    e, two_i, h_words = w13_packed.shape
    i = two_i // 2
    expected = {
        "w13_packed": (w13_packed, torch.int32, (e, 2 * i, h // 8)),
        "w13_scale": (w13_scale, torch.bfloat16, (e, 2 * i, h // 32)),
        "w2_packed": (w2_packed, torch.int32, (e, h, i // 8)),
        "w2_scale": (w2_scale, torch.bfloat16, (e, h, i // 32)),
    }
    if two_i % 2 or h_words * 8 != h:
        raise ValueError(f"w13_packed {tuple(w13_packed.shape)} does not fit H={h} "
                         "(expected [E, 2I, H/8])")
    for name, (t, dtype, shape) in expected.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids / topk_weights must both be [M={m}, top_k], got "
                         f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")


def prepare_weights(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                    w2_scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """``fused_moe``'s checkpoint weights -> ``(w13_packed, w13_scale, w2_packed, w2_scale,
    w_order)`` for the Triton kernels' fastest path, converted once at load time (as Humming's
    ``transform()``): fragment-order words and subnormal scales in row blocks (``"blocked"``,
    ``chordq.layout.row_blocks``: both GEMMs' N % 128 == 0 and K % 256 == 0, as Kimi's are),
    else not in row blocks (``"subnormal"``), or, when a scale is too large for those (``|s|
    >= 0.498``, far above real checkpoints), fragment-order words with the scales as they are
    (``"fragments"``)."""
    from chordq.layout import K_BLOCK, ROW_BLOCK, fragment_order, row_blocks, subnormal_scales

    words = fragment_order(w13_packed), fragment_order(w2_packed)
    try:
        scales = subnormal_scales(w13_scale), subnormal_scales(w2_scale)
    except ValueError:
        return words[0], w13_scale, words[1], w2_scale, "fragments"
    ks = 8 * w13_packed.shape[2], 8 * w2_packed.shape[2]
    if any(w.shape[1] % ROW_BLOCK or k % K_BLOCK for w, k in zip(words, ks)):
        return words[0], scales[0], words[1], scales[1], "subnormal"
    return (row_blocks(words[0], ks[0]), row_blocks(scales[0], ks[0]),
            row_blocks(words[1], ks[1]), row_blocks(scales[1], ks[1]), "blocked")


def fused_moe(
    hidden_states: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    impl: str = "auto",
    w_order: str = "checkpoint",
) -> torch.Tensor:
    """``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over each token's routed experts.

    :param hidden_states: BF16 ``[M, H]``
    :param w13_packed: int32 ``[E, 2I, H/8]`` (gate rows, then up rows); ``w13_scale`` BF16
        ``[E, 2I, H/32]``
    :param w2_packed: int32 ``[E, H, I/8]``; ``w2_scale`` BF16 ``[E, H, I/32]``
    :param topk_weights: ``[M, top_k]`` (float32 from ``route``)
    :param topk_ids: int ``[M, top_k]`` local expert ids; -1 (expert on another rank) is skipped
    :param impl: ``"triton"``, ``"reference"``, or ``"auto"`` (Triton on CUDA tensors, reference
        otherwise). ``"triton"`` on CPU tensors runs Triton's interpreter, which needs
        ``TRITON_INTERPRET=1`` set before the Triton kernels are first imported; it raises
        otherwise.
    :param w_order: ``"checkpoint"`` (words as chordq writes them), ``"fragments"`` (both
        packed weights converted once with ``chordq.layout.fragment_order``) or
        ``"subnormal"`` (also both scales with ``chordq.layout.subnormal_scales``) or
        ``"blocked"`` (those four in ``chordq.layout.row_blocks``): the Triton kernels' fast
        paths, see :func:`prepare_weights` (the reference converts them back)
    :returns: BF16 ``[M, H]``
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if w_order not in W_ORDERS:
        raise ValueError(f"w_order must be one of {W_ORDERS}, got {w_order!r}")
    _check_inputs(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids)
    if impl == "auto":
        impl = "triton" if hidden_states.is_cuda else "reference"
    if impl == "reference":
        if w_order != "checkpoint":
            from chordq.layout import (fragment_order_inverse, row_blocks_inverse,
                                       subnormal_scales_inverse)

            if w_order == "blocked":
                h, i = hidden_states.shape[1], w2_packed.shape[2] * 8
                w13_packed, w13_scale = (row_blocks_inverse(w13_packed, h),
                                         row_blocks_inverse(w13_scale, h))
                w2_packed, w2_scale = (row_blocks_inverse(w2_packed, i),
                                       row_blocks_inverse(w2_scale, i))
            w13_packed = fragment_order_inverse(w13_packed)
            w2_packed = fragment_order_inverse(w2_packed)
            if w_order in SUBNORMAL_W_ORDERS:
                w13_scale = subnormal_scales_inverse(w13_scale)
                w2_scale = subnormal_scales_inverse(w2_scale)
        return fused_moe_reference(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale,
                                   topk_weights, topk_ids)
    return _fused_moe_triton(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale,
                             topk_weights, topk_ids, w_order)


def _fused_moe_triton(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_order: str,
) -> torch.Tensor:
    # Imported here so the reference path works where Triton is not installed.
    from .triton_moe_sum import moe_sum_triton
    from .triton_w4a16 import moe_gemm_mixed_triton, row_tiles

    m, h = x.shape
    e, two_i, _ = w13_packed.shape
    top_k = topk_ids.shape[1]
    # One alignment serves both GEMMs: its blocks are the gate_up tiles' row counts (one size,
    # or 128 + 64 + 32 at 128-256 rows per expert), and the wrappers' own heuristic (same
    # shapes, so the same tiles, plus split-K for thin grids) picks the rest. A Gluon tile's
    # blocks (8 or 96 rows) are taken only where the down GEMM (N = H, K = I) can run them too.
    sizes = row_tiles(m * top_k / e, two_i // 2, h, e, x.device, w_order, gated=True,
                      down=(h, two_i // 2))
    pieces = align_row_tiles(topk_ids, sizes, e)
    act = moe_gemm_mixed_triton(x, w13_packed, w13_scale, pieces, top_k, activation="silu_mul",
                                w_order=w_order)
    y = moe_gemm_mixed_triton(act, w2_packed, w2_scale, pieces, 1, w_order=w_order)
    return moe_sum_triton(y, topk_weights, topk_ids.to(torch.int32))
