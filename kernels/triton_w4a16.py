"""W4A16 grouped GEMMs for MoE experts in Triton: packed INT4 weights, BF16 activations.

``out[r, n] = sum_k x[row(r), k] * W_e[n, k]``, ``W_e[n, k] = bf16(code - 8) * scale[e, n, k//32]``,
read straight from the checkpoint words (chordq.layout: int32 ``[E, N, K/8]``, 8 codes per
word, lowest nibble first; BF16 scales ``[E, N, K/32]``). No dequantized copy of the weight
exists in memory: each K step loads one tile of words and scales and dequantizes in registers.

Three routings share one main loop (``_w4a16_tile``):

* indexed   (``moe_gemm_indexed_triton``): vLLM's ``moe_align_block_size`` buffers; route id
  ``r`` reads row ``r // top_k`` (gate_up) or row ``r`` (down, ``top_k=1``).
* contiguous (``grouped_gemm_contiguous_triton``): rows grouped by expert, ``m_indices [m]``.
* masked    (``grouped_gemm_masked_triton``): ``[G, max_m, K]`` with ``masked_m [G]`` counts.

Rows a kernel does not own (sentinel ids, expert -1, padding rows, rows past ``masked_m``) are
**left unwritten**, as in Chord's contract: their contents are whatever ``out`` held.

``activation="silu_mul"`` fuses SwiGLU: ``W`` holds gate rows ``[0, N)`` then up rows
``[N, 2N)`` and the kernel writes ``silu(gate) * up`` ``[*, N]`` (gate and up rounded to BF16
first, so the result equals the unfused gate_up GEMM followed by ``silu_and_mul``).

Hopper design (kernels.md §2): the dot is ``C^T = W . X^T`` so the dequantized weight is the
register-resident left operand and the few tokens per expert fill the dot's N slot (>= 16).
Words are unpacked by shift-and-mask into eight nibble planes (``_dequant_tile``); with
``plane_major`` (decode tiles) each K tile is visited in nibble-plane order so the planes *are*
the wgmma register operand, with no shared-memory round trip (``_w4a16_tile``). The int->BF16
convert is a magic-number OR, the group scale is applied per word in BF16 (one rounding, as in
Chord's reference), tiles are constexpr and chosen by ``triton_config.choose_config``.

Under ``TRITON_INTERPRET=1`` tl.dot and BF16 arithmetic operate on raw BF16 bits, so the
``COMPUTE_F32`` flag does the same math in FP32 (with the BF16 rounding of the dequantized
weight kept explicitly); on GPU the dot runs on BF16 tensor cores with FP32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .triton_config import GROUP_SIZE, W4A16Config, choose_config

__all__ = [
    "moe_gemm_indexed_triton",
    "grouped_gemm_contiguous_triton",
    "grouped_gemm_masked_triton",
]

@triton.jit
def _bf16_nearest(x):
    """FP32 -> FP32 holding the nearest-even BF16 value, with integer ops (finite inputs).

    Used under COMPUTE_F32: the interpreter's FP32->BF16 cast truncates, and its float
    conversions are slow, so rounding stays in FP32 bits.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(x, COMPUTE_F32: tl.constexpr):
    """FP32 -> BF16, round to nearest even (also under the interpreter)."""
    if COMPUTE_F32:
        x = _bf16_nearest(x)  # the cast of a representable value is exact
    return x.to(tl.bfloat16)


@triton.jit
def _dequant_plane(words, SHIFT: tl.constexpr, scales, COMPUTE_F32: tl.constexpr):
    """Nibble ``SHIFT / 4`` of every word as ``bf16(code - 8) * scale`` (one BF16 rounding)."""
    codes = (words >> SHIFT) & 0xF
    if COMPUTE_F32:
        return _bf16_nearest((codes - 8).to(tl.float32) * scales.to(tl.float32))
    # Magic number: 0x4300 is BF16 128.0, whose mantissa LSB is worth 1, so OR-ing a code in
    # gives exactly 128 + code without an int->float convert; minus 136 is code - 8, exact.
    w = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return (w - 136.0) * scales  # BF16 multiply: the one rounding


@triton.jit
def _dequant_tile(
    w_ptrs,  # int32 pointers [BLOCK_N, BLOCK_K/8]: the words of one tile (k = 8*word + j)
    s_ptrs,  # bf16 pointers [BLOCK_N, BLOCK_K/32]: one scale per row and group
    n_mask,  # [BLOCK_N] rows inside N
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PLANE_MAJOR: tl.constexpr,  # tile K order: plane-major (see _w4a16_tile) or natural
    COMPUTE_F32: tl.constexpr,
):
    """Load and dequantize one ``[BLOCK_N, BLOCK_K]`` weight tile: BF16 (FP32 under COMPUTE_F32).

    The eight nibbles of a word are unpacked as eight planes (shift-and-mask by 0, 4, .., 28)
    and joined with a tree of ``tl.join``. Unlike broadcasting the words against
    ``arange(8) * 4``, join keeps a word's nibbles in the thread that loaded it; with the
    broadcast, Triton spreads the nibbles over 8 threads and every element re-reads its word and
    scale from shared memory (2 loads per weight, ~1.75x the instructions in the sm_90 PTX).
    """
    words = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
    scales = tl.load(s_ptrs, mask=n_mask[:, None], other=0.0)
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], (BLOCK_N, BLOCK_K // 32, 4)),
                        (BLOCK_N, BLOCK_K // 8))  # the scale of each word's group
    d0 = _dequant_plane(words, 0, scales, COMPUTE_F32)
    d1 = _dequant_plane(words, 4, scales, COMPUTE_F32)
    d2 = _dequant_plane(words, 8, scales, COMPUTE_F32)
    d3 = _dequant_plane(words, 12, scales, COMPUTE_F32)
    d4 = _dequant_plane(words, 16, scales, COMPUTE_F32)
    d5 = _dequant_plane(words, 20, scales, COMPUTE_F32)
    d6 = _dequant_plane(words, 24, scales, COMPUTE_F32)
    d7 = _dequant_plane(words, 28, scales, COMPUTE_F32)
    # join appends a minor axis, so [BLOCK_N, word, b2, b1, b0] holds nibble j = 4*b2 + 2*b1 + b0.
    even = tl.join(tl.join(d0, d4), tl.join(d2, d6))
    odd = tl.join(tl.join(d1, d5), tl.join(d3, d7))
    planes = tl.join(even, odd)
    if PLANE_MAJOR:
        planes = tl.permute(planes, (0, 2, 3, 4, 1))  # tile column j * BLOCK_K/8 + word
    return tl.reshape(planes, (BLOCK_N, BLOCK_K))  # natural: column 8 * word + j


@triton.jit
def _mma(w, x, acc, COMPUTE_F32: tl.constexpr):
    """``acc += w @ x``: BF16 tensor cores, or exact FP32 (never TF32) when COMPUTE_F32."""
    if COMPUTE_F32:
        return tl.dot(w, x, acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _w4a16_tile(
    x_ptr,  # bf16 activations; row i starts at x_ptr + i * stride_xm
    a_rows,  # [BLOCK_M] int64 activation rows of this tile
    row_mask,  # [BLOCK_M] rows that exist (masked rows load zeros)
    w_ptr,  # int32 [E, N_w, K/8] packed codes
    s_ptr,  # bf16 [E, N_w, K/32] scales
    expert,  # int64 expert of this tile
    offs_n,  # [BLOCK_N] output features of this tile
    N,  # output features (with GATED: the up rows start at N)
    K,  # reduction size, a multiple of BLOCK_K
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    GATED: tl.constexpr,  # compute silu(gate) * up
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PLANE_MAJOR: tl.constexpr,  # run each K tile in nibble-plane-major order
    COMPUTE_F32: tl.constexpr,
):
    """FP32 ``C^T [BLOCK_N, BLOCK_M]`` of one (expert, row tile, column tile).

    The reduction does not care in which order a tile's K columns are visited, as long as W and
    X agree. PLANE_MAJOR visits column ``k = 8 * word + j`` at position ``j * BLOCK_K/8 + word``:
    each thread then needs every nibble of the words it loads, so Triton builds the wgmma
    register operand straight from the words (no shared-memory round trip of the dequantized
    tile, ~1/3 fewer registers at decode tiles); the X tile is permuted instead, which is cheap
    when it is small (BLOCK_M <= 32). Natural order is better for wide row tiles.
    """
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_word = tl.arange(0, BLOCK_K // 8)
    offs_group = tl.arange(0, BLOCK_K // 32)
    rows_n = offs_n[:, None].to(tl.int64)
    x_ptrs = x_ptr + a_rows[None, :] * stride_xm + offs_k[:, None]  # X^T tile [BLOCK_K, BLOCK_M]
    w_ptrs = w_ptr + expert * stride_we + rows_n * stride_wn + offs_word[None, :]
    s_ptrs = s_ptr + expert * stride_se + rows_n * stride_sn + offs_group[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=row_mask[None, :], other=0.0)
        if COMPUTE_F32:
            x = x.to(tl.float32)
        if PLANE_MAJOR:
            x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_K // 8, 8, BLOCK_M)), (1, 0, 2)),
                           (BLOCK_K, BLOCK_M))
        w = _dequant_tile(w_ptrs, s_ptrs, n_mask, BLOCK_N, BLOCK_K, PLANE_MAJOR, COMPUTE_F32)
        acc = _mma(w, x, acc, COMPUTE_F32)
        if GATED:
            w_up = _dequant_tile(w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, n_mask,
                                 BLOCK_N, BLOCK_K, PLANE_MAJOR, COMPUTE_F32)
            acc_up = _mma(w_up, x, acc_up, COMPUTE_F32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // 32
    if GATED:
        # Round gate and up to BF16 as the unfused path would, then SiLU-and-mul in FP32.
        if COMPUTE_F32:
            gate, up = _bf16_nearest(acc), _bf16_nearest(acc_up)
        else:
            gate, up = acc.to(tl.bfloat16).to(tl.float32), acc_up.to(tl.bfloat16).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up
    return acc


@triton.jit
def _store_tile(out_ptr, acc, out_rows, row_mask, offs_n, N, stride_om, COMPUTE_F32: tl.constexpr):
    """Store ``C^T [BLOCK_N, BLOCK_M]`` as BF16 rows ``out_rows`` of ``out``; others untouched."""
    ptrs = out_ptr + out_rows[None, :] * stride_om + offs_n[:, None]
    tl.store(ptrs, _round_to_bf16(acc, COMPUTE_F32), mask=row_mask[None, :] & (offs_n < N)[:, None])


@triton.jit
def _w4a16_indexed_kernel(
    x_ptr,  # bf16 [num_routes / TOP_K, K]
    w_ptr,  # int32 [E, N_w, K/8]
    s_ptr,  # bf16 [E, N_w, K/32]
    out_ptr,  # bf16 [num_routes, N]
    sorted_ids_ptr,  # int32 [capacity] route ids per block, sentinel >= num_routes
    expert_ids_ptr,  # int32 [num_m_blocks] expert per block, -1 = not local
    ntp_ptr,  # int32 [1] num_tokens_post_padded
    num_routes,  # valid route ids are < num_routes
    N,
    K,
    num_m_blocks,  # grid rows (capacity); blocks past ntp exit at once
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TOP_K: tl.constexpr,  # activation row = route id // TOP_K
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PLANE_MAJOR: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
):
    # Row blocks vary fastest so the tiles sharing one weight tile run together (L2 reuse).
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    if pid_m * BLOCK_M >= tl.load(ntp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return  # expert on another rank: rows left unwritten
    routes = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = routes < num_routes
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _w4a16_tile(x_ptr, routes // TOP_K, row_mask, w_ptr, s_ptr, expert, offs_n, N, K,
                      stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                      GATED, BLOCK_M, BLOCK_N, BLOCK_K, PLANE_MAJOR, COMPUTE_F32)
    _store_tile(out_ptr, acc, routes, row_mask, offs_n, N, stride_om, COMPUTE_F32)


@triton.jit
def _w4a16_contiguous_kernel(
    x_ptr,  # bf16 [m, K]
    w_ptr,  # int32 [E, N_w, K/8]
    s_ptr,  # bf16 [E, N_w, K/32]
    out_ptr,  # bf16 [m, N]
    m_indices_ptr,  # int32 [m] expert per row, -1 = padding
    m,  # rows
    N,
    K,
    num_m_blocks,  # cdiv(m, BLOCK_M)
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PLANE_MAJOR: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(m_indices_ptr + rows, mask=rows < m, other=-1)
    # Segments are aligned to BLOCK_M (it divides 128), so a block holds one expert + padding.
    expert = tl.max(ids, axis=0).to(tl.int64)
    if expert < 0:
        return  # all padding
    row_mask = ids == expert
    rows = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _w4a16_tile(x_ptr, rows, row_mask, w_ptr, s_ptr, expert, offs_n, N, K,
                      stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                      GATED, BLOCK_M, BLOCK_N, BLOCK_K, PLANE_MAJOR, COMPUTE_F32)
    _store_tile(out_ptr, acc, rows, row_mask, offs_n, N, stride_om, COMPUTE_F32)


@triton.jit
def _w4a16_masked_kernel(
    x_ptr,  # bf16 [G * max_m, K]
    w_ptr,  # int32 [G, N_w, K/8]
    s_ptr,  # bf16 [G, N_w, K/32]
    out_ptr,  # bf16 [G * max_m, N]
    masked_m_ptr,  # int32 [G] valid rows per group
    max_m,
    N,
    K,
    num_m_blocks,  # G * cdiv(max_m, BLOCK_M)
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PLANE_MAJOR: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    blocks_per_group = tl.cdiv(max_m, BLOCK_M)
    group = pid_m // blocks_per_group
    first = (pid_m % blocks_per_group) * BLOCK_M
    count = tl.load(masked_m_ptr + group)
    if first >= count:
        return
    offs = first + tl.arange(0, BLOCK_M)
    row_mask = offs < count
    rows = group.to(tl.int64) * max_m + offs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _w4a16_tile(x_ptr, rows, row_mask, w_ptr, s_ptr, group.to(tl.int64), offs_n, N, K,
                      stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                      GATED, BLOCK_M, BLOCK_N, BLOCK_K, PLANE_MAJOR, COMPUTE_F32)
    _store_tile(out_ptr, acc, rows, row_mask, offs_n, N, stride_om, COMPUTE_F32)


# ----------------------------------------------------------------------------- host side

# @triton.jit chose compiled or interpreted kernels when this module was imported
# (TRITON_INTERPRET=1 then); the interpreter needs COMPUTE_F32 and is the only way to run on CPU.
_INTERPRETED = isinstance(_w4a16_indexed_kernel, InterpretedFunction)


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got "
                         f"{[str(t.device) for t in tensors]}")
    if device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            "Triton W4A16 kernels need CUDA tensors; to run them on CPU set TRITON_INTERPRET=1 "
            "before chordq.kernels' Triton modules are first imported, or use the references"
        )


def _check_weights(
    x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, gated: bool
) -> int:
    """Validate the operands; returns the output width N."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a 2-D BF16 tensor with unit last stride, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if w_packed.dtype != torch.int32 or w_packed.dim() != 3 or not w_packed.is_contiguous():
        raise ValueError(f"w_packed must be contiguous int32 [E, N, K/8], got {w_packed.dtype} "
                         f"{tuple(w_packed.shape)}")
    e, n_w, k_words = w_packed.shape
    k = x.shape[1]
    if k != 8 * k_words or k % GROUP_SIZE:
        raise ValueError(f"x has K={k} but w_packed holds K={8 * k_words}; "
                         "K must be a multiple of 32")
    if (w_scale.dtype != torch.bfloat16 or tuple(w_scale.shape) != (e, n_w, k // GROUP_SIZE)
            or not w_scale.is_contiguous()):
        raise ValueError(f"w_scale must be contiguous BF16 {(e, n_w, k // GROUP_SIZE)}, got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if gated and n_w % 2:
        raise ValueError(f"silu_mul needs gate and up halves, but N={n_w} is odd")
    return n_w // 2 if gated else n_w


def _gated(activation: str | None) -> bool:
    if activation not in (None, "silu_mul"):
        raise ValueError(f"activation must be None or 'silu_mul', got {activation!r}")
    return activation == "silu_mul"


def _resolve_config(config: W4A16Config | None, rows_per_expert: float, n: int, k: int,
                    gated: bool, x: torch.Tensor, block_m: int | None = None) -> W4A16Config:
    if config is None:
        return choose_config(rows_per_expert, n, k, gated=gated, block_m=block_m,
                             interpret=x.device.type == "cpu")
    if block_m is not None and config.block_m != block_m:
        raise ValueError(f"config.block_m={config.block_m} differs from the alignment "
                         f"block {block_m}")
    if k % config.block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={config.block_k}")
    return config


def _output(out: torch.Tensor | None, rows: int, n: int, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(rows, n, dtype=torch.bfloat16, device=like.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be BF16 {(rows, n)} with unit last stride, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def _launch_args(cfg: W4A16Config, gated: bool) -> dict:
    return dict(GATED=gated, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                PLANE_MAJOR=cfg.plane_major, COMPUTE_F32=_INTERPRETED,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def moe_gemm_indexed_triton(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    block_m: int,
    *,
    num_routes: int | None = None,
    activation: str | None = None,
    config: W4A16Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexed W4A16 grouped GEMM over vLLM ``moe_align_block_size`` buffers.

    :param x: BF16 ``[M, K]``; route id ``r`` reads row ``r // top_k`` (down: ``top_k=1``)
    :param w_packed: int32 ``[E, N_w, K/8]``; ``w_scale``: BF16 ``[E, N_w, K/32]``
    :param sorted_token_ids, expert_ids, num_tokens_post_padded: from
        ``moe_align_block_size(topk_ids, block_m, ...)`` (int32)
    :param block_m: the alignment block size (becomes the kernel's BLOCK_M)
    :param num_routes: valid route ids (default ``M * top_k``); larger ids are sentinels
    :param activation: None, or ``"silu_mul"`` (N = N_w / 2)
    :param config: tile config (default: ``choose_config``); ``config.block_m == block_m``
    :param out: optional BF16 ``[num_routes, N]`` output; rows not routed to a local expert
        are left as they are
    :returns: BF16 ``[num_routes, N]``
    """
    gated = _gated(activation)
    _check_device(x, w_packed, w_scale, sorted_token_ids, expert_ids, num_tokens_post_padded)
    n = _check_weights(x, w_packed, w_scale, gated)
    for name, t in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids),
                    ("num_tokens_post_padded", num_tokens_post_padded)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32, got {t.dtype}")
    # Blocks below num_tokens_post_padded lie inside sorted_token_ids, so the grid may cover
    # every entry of expert_ids; blocks past the padded count exit at once.
    num_m_blocks = expert_ids.numel()
    if num_m_blocks * block_m < sorted_token_ids.numel():
        raise ValueError(f"{num_m_blocks} expert_ids x block_m={block_m} do not cover the "
                         f"{sorted_token_ids.numel()} sorted_token_ids: wrong block_m?")
    num_routes = x.shape[0] * top_k if num_routes is None else num_routes
    k = x.shape[1]
    cfg = _resolve_config(config, num_routes / w_packed.shape[0], n, k, gated, x, block_m)
    out = _output(out, num_routes, n, x)
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    if grid[0] == 0:
        return out
    _w4a16_indexed_kernel[grid](
        x, w_packed, w_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
        num_routes, n, k, num_m_blocks,
        x.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), TOP_K=top_k, **_launch_args(cfg, gated))
    return out


def grouped_gemm_contiguous_triton(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    m_indices: torch.Tensor,
    *,
    activation: str | None = None,
    config: W4A16Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Contiguous grouped W4A16 GEMM (DeepGEMM layout, format.md §5.2).

    :param x: BF16 ``[m, K]``; each expert's rows consecutive, segments aligned to 128 rows
        (more precisely: to ``config.block_m``, which divides 128)
    :param m_indices: int32 ``[m]`` expert per row, -1 for padding rows (left unwritten)
    :returns: BF16 ``[m, N]`` (``N_w / 2`` with silu_mul)
    """
    gated = _gated(activation)
    _check_device(x, w_packed, w_scale, m_indices)
    n = _check_weights(x, w_packed, w_scale, gated)
    m, k = x.shape
    if m_indices.dtype != torch.int32 or tuple(m_indices.shape) != (m,):
        raise ValueError(f"m_indices must be int32 [{m}], got {m_indices.dtype} "
                         f"{tuple(m_indices.shape)}")
    cfg = _resolve_config(config, m / w_packed.shape[0], n, k, gated, x)
    out = _output(out, m, n, x)
    num_m_blocks = triton.cdiv(m, cfg.block_m)
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    if grid[0] == 0:
        return out
    _w4a16_contiguous_kernel[grid](
        x, w_packed, w_scale, out, m_indices, m, n, k, num_m_blocks,
        x.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), **_launch_args(cfg, gated))
    return out


def grouped_gemm_masked_triton(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int | None = None,
    *,
    activation: str | None = None,
    config: W4A16Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked grouped W4A16 GEMM (DeepGEMM layout, format.md §5.2).

    :param x: BF16 ``[G, max_m, K]`` (or flat ``[G * max_m, K]``); group g uses expert g
    :param masked_m: int32 ``[G]`` valid rows per group (rows past it are left unwritten)
    :param expected_m: typical rows per group, only for the config heuristic (default max_m)
    :returns: BF16 ``[G * max_m, N]`` (``N_w / 2`` with silu_mul)
    """
    gated = _gated(activation)
    g = w_packed.shape[0]
    if x.dim() == 3:
        if x.shape[0] != g:
            raise ValueError(f"x has {x.shape[0]} groups but w_packed has {g} experts")
        x = x.reshape(-1, x.shape[-1])
    _check_device(x, w_packed, w_scale, masked_m)
    n = _check_weights(x, w_packed, w_scale, gated)
    if x.shape[0] % g:
        raise ValueError(f"{x.shape[0]} rows do not split into {g} groups")
    if masked_m.dtype != torch.int32 or tuple(masked_m.shape) != (g,):
        raise ValueError(f"masked_m must be int32 [{g}], got {masked_m.dtype} "
                         f"{tuple(masked_m.shape)}")
    max_m, k = x.shape[0] // g, x.shape[1]
    cfg = _resolve_config(config, max_m if expected_m is None else expected_m, n, k, gated, x)
    out = _output(out, g * max_m, n, x)
    num_m_blocks = g * triton.cdiv(max_m, cfg.block_m)
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    if grid[0] == 0:
        return out
    _w4a16_masked_kernel[grid](
        x, w_packed, w_scale, out, masked_m, max_m, n, k, num_m_blocks,
        x.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), **_launch_args(cfg, gated))
    return out
