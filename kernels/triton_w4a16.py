"""W4A16 grouped GEMMs for MoE experts in Triton: packed INT4 weights, BF16 activations.

``out[r, n] = sum_k x[row(r), k] * W_e[n, k]``, ``W_e[n, k] = bf16(code - 8) * scale[e, n, k//32]``,
read straight from the checkpoint words (chordq.layout: int32 ``[E, N, K/8]``, 8 codes per
word, lowest nibble first; BF16 scales ``[E, N, K/32]``), or from the same words converted once
to fragment order (``w_order="fragments"``, ``chordq.layout.fragment_order``), with the scales
also converted (``w_order="subnormal"``, ``chordq.layout.subnormal_scales``), and those stored
in row blocks (``w_order="blocked"``, ``chordq.layout.row_blocks``). No dequantized
copy of the weight exists in memory: each K step loads one tile of words and scales and
dequantizes in registers.

Three routings share one main loop (``_w4a16_tile``):

* indexed   (``moe_gemm_indexed_triton``): vLLM's ``moe_align_block_size`` buffers; route id
  ``r`` reads row ``r // top_k`` (gate_up) or row ``r`` (down, ``top_k=1``).
  ``moe_gemm_mixed_triton`` runs it once per row-tile size over ``align.moe_align_mixed``
  pieces (less padding at 128-256 rows per expert).
* contiguous (``grouped_gemm_contiguous_triton``): rows grouped by expert, ``m_indices [m]``.
* masked    (``grouped_gemm_masked_triton``): ``[G, max_m, K]`` with ``masked_m [G]`` counts.

When K fits one step (TP8 down, K = 256) the indexed path runs ``_w4a16_indexed_wide_kernel``
instead (``W4A16Config.n_tiles > 1``): each program loads its X rows once and loops over
``n_tiles`` column tiles, so the loop that is pipelined runs over N rather than K.

Rows a kernel does not own (sentinel ids, expert -1, padding rows, rows past ``masked_m``) are
**left unwritten**, as in Chord's contract: their contents are whatever ``out`` held.

``activation="silu_mul"`` fuses SwiGLU: ``W`` holds gate rows ``[0, N)`` then up rows
``[N, 2N)`` and the kernel writes ``silu(gate) * up`` ``[*, N]`` (gate and up rounded to BF16
first, so the result equals the unfused gate_up GEMM followed by ``silu_and_mul``).

Hopper design (kernels.md §2): the dot is ``C^T = W . X^T`` so the dequantized weight is the
register-resident left operand and the few tokens per expert fill the dot's N slot (>= 16).
Each K tile is visited in the order its dequantization produces (``k_order``, see
``_w4a16_tile``), so the dequantized words *are* the wgmma register operand, with no
shared-memory round trip. On the GPU the "pairs" and "fragments" orders dequantize two weights
per instruction in inline PTX (``_DEQUANT_PAIRS_ASM``: the int->BF16 convert is a magic-number
OR, then subtract and scale); "subnormal" masks each code into subnormal BF16 range and ends
with one fma (``_DEQUANT_SUBNORMAL_ASM``). Either way the group scale is applied in BF16 with
one rounding, as in Chord's reference; tiles are constexpr and chosen by
``triton_config.choose_config``.

Under ``TRITON_INTERPRET=1`` tl.dot and BF16 arithmetic operate on raw BF16 bits, so the
``COMPUTE_F32`` flag does the same math in FP32 (with the BF16 rounding of the dequantized
weight kept explicitly); on GPU the dot runs on BF16 tensor cores with FP32 accumulation.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from chordq.layout import K_BLOCK, ROW_BLOCK

from . import triton_config
from .triton_config import (GROUP_SIZE, K_ORDER_OF, K_ORDERS,
                            SUBNORMAL_W_ORDERS, W_ORDERS, W4A16Config, choose_config,
                            choose_gluon_n_tiles, choose_gluon_split_k,
                            choose_gluon_stream_k, choose_n_tiles, choose_split_k)

__all__ = [
    "indexed_config",
    "moe_gemm_indexed_triton",
    "moe_gemm_mixed_triton",
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


# One word -> its 8 weights as four BF16 pairs (nibbles j and j + 4 in one 32-bit register):
# mask-and-OR the nibbles into BF16 128.0's mantissa (lop3), subtract 136 (exact), multiply by
# the group scale (the one rounding), two weights per instruction. $4/$5 are the word twice
# (pack=2 passes one int32 per element), $6 is the scale pair {s, s}.
_DEQUANT_PAIRS_ASM = tl.constexpr("""{
.reg .b32 t1, t2, t3, c;
shr.u32 t1, $4, 4;
shr.u32 t2, $4, 8;
shr.u32 t3, $4, 12;
lop3.b32 $0, $4, 0x000f000f, 0x43004300, 0xea;
lop3.b32 $1, t1, 0x000f000f, 0x43004300, 0xea;
lop3.b32 $2, t2, 0x000f000f, 0x43004300, 0xea;
lop3.b32 $3, t3, 0x000f000f, 0x43004300, 0xea;
mov.b32 c, 0x43084308;
sub.rn.bf16x2 $0, $0, c;
sub.rn.bf16x2 $1, $1, c;
sub.rn.bf16x2 $2, $2, c;
sub.rn.bf16x2 $3, $3, c;
mul.rn.bf16x2 $0, $0, $6;
mul.rn.bf16x2 $1, $1, $6;
mul.rn.bf16x2 $2, $2, $6;
mul.rn.bf16x2 $3, $3, $6;
}""")


# The same pairs from scales stored times 2**129 (``chordq.layout.subnormal_scales``): a BF16
# whose bits are below 0x100 is worth bits * 2**-133 (the lowest two binades are evenly spaced),
# so a nibble masked into bits 4-7 of each half is code * 2**-129 with no OR and no subtract,
# and one fma gives code * s - 8 s rounded once: the reference's bf16((code - 8) * s). 12
# instructions per word instead of 15. $6 is {s', s'} = {s * 2**129, ...}; 0x80808080 is
# {-2**-126, ...}, so b = -8 s exactly.
_DEQUANT_SUBNORMAL_ASM = tl.constexpr("""{
.reg .b32 t0, t2, t3, b, c;
shl.b32 t0, $4, 4;
shr.u32 t2, $4, 4;
shr.u32 t3, $4, 8;
and.b32 $0, t0, 0x00f000f0;
and.b32 $1, $4, 0x00f000f0;
and.b32 $2, t2, 0x00f000f0;
and.b32 $3, t3, 0x00f000f0;
mov.b32 c, 0x80808080;
mul.rn.bf16x2 b, $6, c;
fma.rn.bf16x2 $0, $0, $6, b;
fma.rn.bf16x2 $1, $1, $6, b;
fma.rn.bf16x2 $2, $2, $6, b;
fma.rn.bf16x2 $3, $3, $6, b;
}""")


@triton.jit
def _dequant_tile_pairs(
    w_ptrs,  # int32 pointers [BLOCK_N, BLOCK_K/8]
    s_ptrs,  # bf16 pointers [BLOCK_N, BLOCK_K/32]
    n_mask,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FRAGMENTS: tl.constexpr,  # words in fragment order (layout.fragment_order): natural K
    SUBNORMAL: tl.constexpr,  # scales stored times 2**129 (_DEQUANT_SUBNORMAL_ASM)
    COMPUTE_F32: tl.constexpr,
):
    """Load and dequantize one weight tile in *pair order*: tile column ``(j * W + w) * 2 + h``
    holds ``k = 8 w + j + 4 h`` (``W = BLOCK_K / 8``, nibble ``j + 4 h`` of word ``w``).

    Adjacent columns are the two halves of one BF16x2 register, as the tensor-core operand
    wants them, so the PTX above feeds the dot with no repacking: ~15 instructions per word
    (12 with SUBNORMAL) against ~35 for shift-mask-convert per nibble.
    """
    words = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
    scales = tl.load(s_ptrs, mask=n_mask[:, None], other=0.0)
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], (BLOCK_N, BLOCK_K // 32, 4)),
                        (BLOCK_N, BLOCK_K // 8))
    if COMPUTE_F32:
        if SUBNORMAL:  # back to the true scale, exactly (two powers of two: FP32 ends at 2**-149)
            scales = scales.to(tl.float32) * 5.421010862427522e-20 * 2.710505431213761e-20
        p0 = tl.join(_dequant_plane(words, 0, scales, 1), _dequant_plane(words, 16, scales, 1))
        p1 = tl.join(_dequant_plane(words, 4, scales, 1), _dequant_plane(words, 20, scales, 1))
        p2 = tl.join(_dequant_plane(words, 8, scales, 1), _dequant_plane(words, 24, scales, 1))
        p3 = tl.join(_dequant_plane(words, 12, scales, 1), _dequant_plane(words, 28, scales, 1))
    else:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _DEQUANT_SUBNORMAL_ASM if SUBNORMAL else _DEQUANT_PAIRS_ASM, "=r,=r,=r,=r,r,r,r",
            [tl.join(words, words), tl.join(scales, scales)],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    pairs = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [BLOCK_N, w, h, j & 1, j >> 1]
    if FRAGMENTS:  # word 4 g + t, pair j, half h: k = 32 g + 16 (j >> 1) + 8 (j & 1) + 2 t + h
        tile = tl.permute(tl.reshape(pairs, (BLOCK_N, BLOCK_K // 32, 4, 2, 2, 2)),
                          (0, 1, 5, 4, 2, 3))
    else:
        tile = tl.permute(pairs, (0, 4, 3, 1, 2))
    return tl.reshape(tile, (BLOCK_N, BLOCK_K))


@triton.jit
def _mma(w, x, acc, COMPUTE_F32: tl.constexpr):
    """``acc += w @ x``: BF16 tensor cores, or exact FP32 (never TF32) when COMPUTE_F32."""
    if COMPUTE_F32:
        return tl.dot(w, x, acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _load_x(x_ptrs, row_mask, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_ORDER: tl.constexpr,
            COMPUTE_F32: tl.constexpr):
    """X^T tile ``[BLOCK_K, BLOCK_M]`` with its K rows in the weight tile's order."""
    x = tl.load(x_ptrs, mask=row_mask[None, :], other=0.0)
    if COMPUTE_F32:
        x = x.to(tl.float32)
    if K_ORDER == 1:  # planes: position j * W + w holds k = 8 w + j
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_K // 8, 8, BLOCK_M)), (1, 0, 2)),
                       (BLOCK_K, BLOCK_M))
    elif K_ORDER == 2:  # pairs: position (j * W + w) * 2 + h holds k = 8 w + 4 h + j
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_K // 8, 2, 4, BLOCK_M)), (2, 0, 1, 3)),
                       (BLOCK_K, BLOCK_M))
    return x


@triton.jit
def _load_w(w_ptrs, s_ptrs, n_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            K_ORDER: tl.constexpr, COMPUTE_F32: tl.constexpr):
    if K_ORDER >= 2:
        return _dequant_tile_pairs(w_ptrs, s_ptrs, n_mask, BLOCK_N, BLOCK_K, K_ORDER >= 3,
                                   K_ORDER >= 4,
                                   COMPUTE_F32)
    return _dequant_tile(w_ptrs, s_ptrs, n_mask, BLOCK_N, BLOCK_K, K_ORDER == 1, COMPUTE_F32)


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
    first_step,  # first K step (of BLOCK_K) of this tile's K range
    num_steps,  # K steps in the range
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    GATED: tl.constexpr,  # also compute the up half
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ORDER: tl.constexpr,  # 0 natural, 1 planes, 2 pairs, 3 fragments, 4 subnormal (fragments),
    # 5 subnormal in row blocks (chordq.layout.row_blocks)
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no row masks on the weight loads
    COMPUTE_F32: tl.constexpr,
):
    """FP32 ``C^T [BLOCK_N, BLOCK_M]`` of one (expert, row tile, column tile, K range), and the
    up half's with GATED (else zeros).

    GATED stacks the gate and up rows into one ``2 BLOCK_N``-row weight tile and one dot, so
    the gated loop is the unfused loop on a taller tile (one load, dequantization and wgmma
    chain per step; the halves are split once, after the loop).

    The reduction does not care in which order a tile's K columns are visited, as long as W and
    X agree, so the weight tile is visited in the order its dequantization produces cheaply and
    the (small) X tile is permuted to match. Planes (K_ORDER 1): position ``j * W + w`` holds
    ``k = 8 w + j``; every thread needs every nibble of the words it loads, so Triton builds the
    wgmma register operand straight from the words. Pairs (K_ORDER 2, ``_dequant_tile_pairs``)
    also puts the two weights of one BF16x2 register next to each other, so the dequantization
    runs two weights per instruction. Fragments (K_ORDER 3) reads words already permuted so
    that the same registers hold natural K: X is not permuted at all. Row blocks (K_ORDER 5)
    are the subnormal weights stored 128 rows x 256 K a piece: a row's step lies in one piece
    (BLOCK_K divides 256), at the piece of its K and row block.
    """
    if GATED:  # gate rows, then the matching up rows: one [2 BLOCK_N, BLOCK_K] weight tile
        w_rows = tl.reshape(tl.permute(tl.join(offs_n, offs_n + N), (1, 0)), (2 * BLOCK_N,))
        valid = tl.reshape(tl.permute(tl.join(offs_n, offs_n), (1, 0)), (2 * BLOCK_N,)) < N
    else:
        w_rows, valid = offs_n, offs_n < N
    if EVEN_N:  # an all-true mask: the compiler drops the load predicates
        valid = tl.full(valid.shape, True, tl.int1)
    k0 = first_step * BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    offs_word = tl.arange(0, BLOCK_K // 8)
    offs_group = tl.arange(0, BLOCK_K // 32)
    rows_n = w_rows[:, None].to(tl.int64)
    x_ptrs = x_ptr + a_rows[None, :] * stride_xm + k0 + offs_k[:, None]  # X^T [BLOCK_K, BLOCK_M]
    if K_ORDER == 5:  # the row block's offset, the row's in each piece (K: in the loop)
        w_rows_at = (rows_n // 128) * (128 * stride_wn) + (rows_n % 128) * 32
        s_rows_at = (rows_n // 128) * (128 * stride_sn) + (rows_n % 128) * 8
    else:
        w_rows_at, s_rows_at = rows_n * stride_wn + k0 // 8, rows_n * stride_sn + k0 // 32
    w_ptrs = w_ptr + expert * stride_we + w_rows_at + offs_word[None, :]
    s_ptrs = s_ptr + expert * stride_se + s_rows_at + offs_group[None, :]
    acc = tl.zeros((w_rows.shape[0], BLOCK_M), dtype=tl.float32)
    for step in range(0, num_steps):
        x = _load_x(x_ptrs, row_mask, BLOCK_M, BLOCK_K, K_ORDER, COMPUTE_F32)
        if K_ORDER == 5:  # piece (4096 words, 1024 scales) and step inside it, written as
            # products of constants so that Triton proves the 16-byte alignment of each row's
            # words: from kw % 32 it could not, and loaded 4 bytes at a time (1.5x slower)
            at = first_step + step
            piece, inside = at // (256 // BLOCK_K), at % (256 // BLOCK_K)
            w = _load_w(w_ptrs + piece * 4096 + inside * (BLOCK_K // 8),
                        s_ptrs + piece * 1024 + inside * (BLOCK_K // 32), valid, w_rows.shape[0],
                        BLOCK_K, K_ORDER, COMPUTE_F32)
        else:
            w = _load_w(w_ptrs, s_ptrs, valid, w_rows.shape[0], BLOCK_K, K_ORDER, COMPUTE_F32)
            w_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 32
        acc = _mma(w, x, acc, COMPUTE_F32)
        x_ptrs += BLOCK_K
    if GATED:
        acc, acc_up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    else:
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    return acc, acc_up


@triton.jit
def _silu_mul(acc, acc_up, COMPUTE_F32: tl.constexpr):
    """SiLU(gate) * up in FP32, gate and up first rounded to BF16 as the unfused path would."""
    if COMPUTE_F32:
        gate, up = _bf16_nearest(acc), _bf16_nearest(acc_up)
    else:
        gate, up = acc.to(tl.bfloat16).to(tl.float32), acc_up.to(tl.bfloat16).to(tl.float32)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _store_tile(out_ptr, acc, acc_up, out_rows, row_mask, offs_n, N, stride_om,
                GATED: tl.constexpr, COMPUTE_F32: tl.constexpr):
    """Store ``C^T [BLOCK_N, BLOCK_M]`` (with GATED: silu(acc) * acc_up) as BF16 rows
    ``out_rows`` of ``out``; other rows untouched."""
    if GATED:
        acc = _silu_mul(acc, acc_up, COMPUTE_F32)
    ptrs = out_ptr + out_rows[None, :] * stride_om + offs_n[:, None]
    tl.store(ptrs, _round_to_bf16(acc, COMPUTE_F32), mask=row_mask[None, :] & (offs_n < N)[:, None])


@triton.jit
def _indexed_tile(pid, num_m_blocks, ntp_ptr, expert_ids_ptr, sorted_ids_ptr, num_routes,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N=0,
                  COLUMNS_FIRST: tl.constexpr = False):
    """(expert, route ids, valid rows, output columns, the rows' slots in ``sorted_ids``) of
    tile ``pid`` of a grid with ``num_m_blocks`` row blocks; expert -1 when there is nothing
    to do (past ``num_tokens_post_padded``, or an expert on another rank).

    Row blocks vary fastest so the tiles sharing one weight tile run together (L2 reuse);
    with COLUMNS_FIRST the column tiles of one row block do (one expert's weights at a time).
    """
    if COLUMNS_FIRST:
        n_col = tl.cdiv(N, BLOCK_N)
        pid_m = pid // n_col
        offs_n = (pid % n_col) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        pid_m = pid % num_m_blocks
        offs_n = (pid // num_m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    ntp = tl.load(ntp_ptr)  # blocks below it lie inside sorted_ids; pid_m < len(expert_ids)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    expert = tl.where(pid_m * BLOCK_M < ntp, expert, -1)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    routes = tl.load(sorted_ids_ptr + offs, mask=offs < ntp, other=num_routes).to(tl.int64)
    return expert, routes, routes < num_routes, offs_n, offs.to(tl.int64)


@triton.jit
def _w4a16_indexed_kernel(
    x_ptr,  # bf16 [num_routes / TOP_K, K]
    w_ptr,  # int32 [E, N_w, K/8]
    s_ptr,  # bf16 [E, N_w, K/32]
    out_ptr,  # bf16 [num_routes, N]; with SPLIT_K > 1 fp32 partials [SPLIT_K, rows, N_w]
    sorted_ids_ptr,  # int32 [capacity] route ids per block, sentinel >= num_routes
    expert_ids_ptr,  # int32 [num_m_blocks] expert per block, -1 = not local
    ntp_ptr,  # int32 [1] num_tokens_post_padded
    num_routes,  # valid route ids are < num_routes
    N,
    K,
    num_m_blocks,  # grid rows; blocks past ntp exit at once
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
    K_ORDER: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: program_id(1) takes every SPLIT_K-th slice of the K steps
    COMPUTE_F32: tl.constexpr,
    COLUMNS_FIRST: tl.constexpr = False,
    PART_BY_SLOT: tl.constexpr = False,  # partial rows: slots in sorted_ids, not route ids
):
    expert, routes, row_mask, offs_n, slots = _indexed_tile(
        tl.program_id(0), num_m_blocks, ntp_ptr, expert_ids_ptr, sorted_ids_ptr, num_routes,
        BLOCK_M, BLOCK_N, N, COLUMNS_FIRST)
    if expert < 0:
        return  # rows left unwritten
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = tl.program_id(1) * per_split
    acc, acc_up = _w4a16_tile(x_ptr, routes // TOP_K, row_mask, w_ptr, s_ptr, expert, offs_n, N,
                              first, tl.minimum(per_split, steps - first),
                              stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                              GATED, BLOCK_M, BLOCK_N, BLOCK_K, K_ORDER, EVEN_N, COMPUTE_F32)
    if SPLIT_K == 1:
        _store_tile(out_ptr, acc, acc_up, routes, row_mask, offs_n, N, stride_om, GATED,
                    COMPUTE_F32)
    else:  # FP32 partial sums, gate in columns [0, N), up in [N, 2N); the reduce kernel ends
        part_rows = num_m_blocks * BLOCK_M if PART_BY_SLOT else num_routes
        part = out_ptr.to(tl.pointer_type(tl.float32)) + tl.program_id(1) * part_rows * stride_om
        ptrs = part + (slots if PART_BY_SLOT else routes)[None, :] * stride_om + offs_n[:, None]
        mask = row_mask[None, :] & (offs_n < N)[:, None]
        tl.store(ptrs, acc, mask=mask)
        if GATED:
            tl.store(ptrs + N, acc_up, mask=mask)


@triton.jit
def _streamk_piece(tile, first, num, steps, slot, live_m, x_ptr, w_ptr, s_ptr, out_ptr,
                   sorted_ids_ptr, expert_ids_ptr, ntp_ptr, parts_ptr, arrivals_ptr, num_routes,
                   N, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                   TOP_K: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ORDER: tl.constexpr,
                   EVEN_N: tl.constexpr, COMPUTE_F32: tl.constexpr,
                   COLUMNS_FIRST: tl.constexpr):
    """K steps ``first .. first + num`` of ``tile`` for the stream-K kernel: a whole tile is
    stored; a cut one is added into boundary ``slot`` of ``parts_ptr`` and stored by the
    second of its two programs to arrive (see ``_w4a16_indexed_streamk_kernel``)."""
    expert, routes, row_mask, offs_n, _ = _indexed_tile(tile, live_m, ntp_ptr, expert_ids_ptr,
                                                        sorted_ids_ptr, num_routes, BLOCK_M,
                                                        BLOCK_N, N, COLUMNS_FIRST)
    if expert >= 0:  # both programs of a cut tile skip an expert of another rank alike
        acc, acc_up = _w4a16_tile(x_ptr, routes // TOP_K, row_mask, w_ptr, s_ptr, expert,
                                  offs_n, N, first, num, stride_xm, stride_we, stride_wn,
                                  stride_se, stride_sn, GATED, BLOCK_M, BLOCK_N, BLOCK_K,
                                  K_ORDER, EVEN_N, COMPUTE_F32)
        if num == steps:
            _store_tile(out_ptr, acc, acc_up, routes, row_mask, offs_n, N, stride_om, GATED,
                        COMPUTE_F32)
        else:
            part = (parts_ptr + slot * (2 * BLOCK_N * BLOCK_M)
                    + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :])
            tl.atomic_add(part, acc, sem="relaxed")
            if GATED:
                tl.atomic_add(part + BLOCK_N * BLOCK_M, acc_up, sem="relaxed")
            tl.debug_barrier()  # every thread's partial is in before the count
            if tl.atomic_add(arrivals_ptr + slot, 1, sem="acq_rel") == 1:
                zeros = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc = tl.atomic_add(part, zeros, sem="relaxed")  # read where the adds went
                tl.store(part, zeros)
                if GATED:
                    acc_up = tl.atomic_add(part + BLOCK_N * BLOCK_M, zeros, sem="relaxed")
                    tl.store(part + BLOCK_N * BLOCK_M, zeros)
                tl.store(arrivals_ptr + slot, 0)
                _store_tile(out_ptr, acc, acc_up, routes, row_mask, offs_n, N, stride_om,
                            GATED, COMPUTE_F32)


@triton.jit
def _stream_k_shared(tiles, programs):
    """The tiles a stream-K schedule shares out by K steps (every stream-K kernel's; the Gluon
    kernels' copy: ``gluon_w4a16._stream_k_shared``; host twin ``stream_k_shared``): full
    waves run one whole tile a program; only a last wave under 80% full, with the full wave
    before it, is shared (cutting tiles costs ~7%, plan25); 0 where the last wave is full
    enough."""
    tail = tiles % programs
    return tl.where((tail > 0) & (tail * 5 < programs * 4), tl.minimum(tiles, tail + programs), 0)


def stream_k_shared(tiles: int, programs: int) -> int:
    """``_stream_k_shared`` on the host (the schedules' twins for tests)."""
    tail = tiles % programs
    return min(tiles, tail + programs) if tail and tail * 5 < programs * 4 else 0


@triton.jit
def _w4a16_indexed_streamk_kernel(
    x_ptr,  # bf16 [num_routes / TOP_K, K]
    w_ptr,  # int32 [E, N_w, K/8]
    s_ptr,  # bf16 [E, N_w, K/32]
    out_ptr,  # bf16 [num_routes, N]
    sorted_ids_ptr,  # int32 [capacity] route ids per block, sentinel >= num_routes
    expert_ids_ptr,  # int32 [num_m_blocks] expert per block, -1 = not local
    ntp_ptr,  # int32 [1] num_tokens_post_padded
    parts_ptr,  # fp32 [programs, 2, BLOCK_N, BLOCK_M] partial tiles; zeros between launches
    arrivals_ptr,  # int32 [programs] partial tiles arrived per boundary; zeros between launches
    num_routes,
    N,
    K,
    num_m_blocks,  # grid rows bound (live blocks are fewer: ntp / BLOCK_M)
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ORDER: tl.constexpr,
    EVEN_N: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    COLUMNS_FIRST: tl.constexpr = False,
):
    """Stream-K indexed GEMM (opt-in, ``W4A16Config.stream_k``) for grids that end in a thin
    last wave, such as TP8 decode past ~133 experts touched (``wave_sweep.py``; docs/
    kernel_notes.md, variants 22 and 25). Persistent programs take whole tiles for the full
    waves; when the last wave would be under 80% full, it and the full wave before it are
    laid end to end as K steps and cut into one equal range per program, so every program
    ends at about the same time.

    A tile cut by a range boundary is finished by whichever of its two programs arrives second:
    both add their FP32 partial into the boundary's slot of ``parts_ptr``, count themselves in
    ``arrivals_ptr``, and the second reads the sum (an atomic add of zero, so it comes from
    where the adds went), stores it, and zeroes slot and count for the next launch. At most
    one boundary falls inside a tile because every range holds at least one tile's steps
    (programs beyond the live tiles exit), so the sum is ``a + b`` in either order:
    deterministic.
    """
    ntp = tl.load(ntp_ptr)
    live_m = tl.minimum(tl.cdiv(ntp, BLOCK_M), num_m_blocks)
    tiles = live_m * tl.cdiv(N, BLOCK_N)
    programs = tl.minimum(tl.num_programs(0), tiles)
    pid = tl.program_id(0)
    if pid >= programs:
        return
    steps = K // BLOCK_K
    sk_tiles = _stream_k_shared(tiles, programs)
    dp_tiles = tiles - sk_tiles
    for tile in range(pid, dp_tiles, programs):
        _streamk_piece(tile, 0, steps, steps, 0, live_m, x_ptr, w_ptr, s_ptr, out_ptr,
                       sorted_ids_ptr, expert_ids_ptr, ntp_ptr, parts_ptr, arrivals_ptr,
                       num_routes, N, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                       stride_om, TOP_K, GATED, BLOCK_M, BLOCK_N, BLOCK_K, K_ORDER, EVEN_N,
                       COMPUTE_F32, COLUMNS_FIRST)
    total = sk_tiles.to(tl.int64) * steps
    it = pid * total // programs
    end = (pid + 1) * total // programs
    while it < end:
        tile = dp_tiles + (it // steps).to(tl.int32)
        first = (it - (tile - dp_tiles).to(tl.int64) * steps).to(tl.int32)
        num = tl.minimum(steps - first, (end - it).to(tl.int32))
        slot = pid if first > 0 else pid + 1  # the boundary inside a cut tile
        _streamk_piece(tile, first, num, steps, slot, live_m, x_ptr, w_ptr, s_ptr, out_ptr,
                       sorted_ids_ptr, expert_ids_ptr, ntp_ptr, parts_ptr, arrivals_ptr,
                       num_routes, N, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                       stride_om, TOP_K, GATED, BLOCK_M, BLOCK_N, BLOCK_K, K_ORDER, EVEN_N,
                       COMPUTE_F32, COLUMNS_FIRST)
        it += num


@triton.jit
def _w4a16_indexed_wide_kernel(
    x_ptr,  # bf16 [num_routes / TOP_K, K]
    w_ptr,  # int32 [E, N, K/8]
    s_ptr,  # bf16 [E, N, K/32]
    out_ptr,  # bf16 [num_routes, N]
    sorted_ids_ptr,
    expert_ids_ptr,
    ntp_ptr,
    num_routes,
    N,
    K,  # == BLOCK_K
    num_m_blocks,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,  # must be False (the host checks; _launch_args passes it to all)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ORDER: tl.constexpr,
    EVEN_N: tl.constexpr,  # N % (BLOCK_N * N_TILES) == 0
    N_TILES: tl.constexpr,  # column tiles per program
    COMPUTE_F32: tl.constexpr,
):
    """Indexed GEMM for a K that fits one step (TP8 down, K = 256): each program loads its X
    rows once and loops over ``N_TILES`` column tiles, so the weight loads of the next tiles are
    in flight while one is dequantized (a one-step K loop has nothing to pipeline), and X is
    read once per ``N_TILES`` tiles instead of once per tile. (Row blocks, K_ORDER 5, with K <=
    256 are the unblocked order: one piece a row block.)"""
    tl.static_assert(not GATED, "the column loop has no SiLU-and-mul epilogue")
    expert, routes, row_mask, _, _ = _indexed_tile(
        tl.program_id(0), num_m_blocks, ntp_ptr, expert_ids_ptr, sorted_ids_ptr, num_routes,
        BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    pid_n = tl.program_id(0) // num_m_blocks
    offs_k = tl.arange(0, BLOCK_K)
    x = _load_x(x_ptr + (routes // TOP_K)[None, :] * stride_xm + offs_k[:, None], row_mask,
                BLOCK_M, BLOCK_K, K_ORDER, COMPUTE_F32)
    offs_n = pid_n * (BLOCK_N * N_TILES) + tl.arange(0, BLOCK_N)
    rows_n = offs_n[:, None].to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + rows_n * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    s_ptrs = s_ptr + expert * stride_se + rows_n * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :]
    for _ in range(0, N_TILES):
        if EVEN_N:
            n_mask = tl.full([BLOCK_N], True, tl.int1)
        else:
            n_mask = offs_n < N
        w = _load_w(w_ptrs, s_ptrs, n_mask, BLOCK_N, BLOCK_K, K_ORDER, COMPUTE_F32)
        acc = _mma(w, x, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), COMPUTE_F32)
        _store_tile(out_ptr, acc, acc, routes, row_mask, offs_n, N, stride_om, False,
                    COMPUTE_F32)
        offs_n += BLOCK_N
        w_ptrs += BLOCK_N * stride_wn
        s_ptrs += BLOCK_N * stride_sn


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # fp32 [SPLIT_K, rows, N_w] partial sums (rows: slots or route ids)
    out_ptr,  # bf16 [num_routes, N]
    sorted_ids_ptr,
    expert_ids_ptr,
    ntp_ptr,
    num_routes,
    N,
    num_m_blocks,
    stride_pm,  # N_w
    stride_om,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    PART_BY_SLOT: tl.constexpr = False,
):
    """Sum the split-K partials in split order (deterministic) and finish like SPLIT_K == 1.
    Same row blocks as the GEMM, so exactly the rows it owns are written."""
    expert, routes, row_mask, offs_n, slots = _indexed_tile(
        tl.program_id(0), num_m_blocks, ntp_ptr, expert_ids_ptr, sorted_ids_ptr, num_routes,
        BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    mask = row_mask[None, :] & (offs_n < N)[:, None]
    ptrs = part_ptr + (slots if PART_BY_SLOT else routes)[None, :] * stride_pm + offs_n[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, SPLIT_K):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        if GATED:
            acc_up += tl.load(ptrs + N, mask=mask, other=0.0)
        ptrs += (num_m_blocks * BLOCK_M if PART_BY_SLOT else num_routes) * stride_pm
    _store_tile(out_ptr, acc, acc_up, routes, row_mask, offs_n, N, stride_om, GATED, COMPUTE_F32)


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
    K_ORDER: tl.constexpr,
    EVEN_N: tl.constexpr,
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
    acc, acc_up = _w4a16_tile(x_ptr, rows, row_mask, w_ptr, s_ptr, expert, offs_n, N,
                              0, K // BLOCK_K, stride_xm, stride_we, stride_wn, stride_se,
                              stride_sn, GATED, BLOCK_M, BLOCK_N, BLOCK_K, K_ORDER, EVEN_N,
                              COMPUTE_F32)
    _store_tile(out_ptr, acc, acc_up, rows, row_mask, offs_n, N, stride_om, GATED, COMPUTE_F32)


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
    K_ORDER: tl.constexpr,
    EVEN_N: tl.constexpr,
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
    acc, acc_up = _w4a16_tile(x_ptr, rows, row_mask, w_ptr, s_ptr, group.to(tl.int64), offs_n,
                              N, 0, K // BLOCK_K, stride_xm, stride_we, stride_wn, stride_se,
                              stride_sn, GATED, BLOCK_M, BLOCK_N, BLOCK_K, K_ORDER, EVEN_N,
                              COMPUTE_F32)
    _store_tile(out_ptr, acc, acc_up, rows, row_mask, offs_n, N, stride_om, GATED, COMPUTE_F32)


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
                    gated: bool, device: torch.device, w_order: str, block_m: int | None = None,
                    indexed: bool = False) -> W4A16Config:
    if w_order not in W_ORDERS:
        raise ValueError(f"w_order must be one of {W_ORDERS}, got {w_order!r}")
    if w_order == "blocked" and ((2 * n if gated else n) % ROW_BLOCK or k % K_BLOCK):
        raise ValueError(f"w_order 'blocked' (chordq.layout.row_blocks) needs N % {ROW_BLOCK} "
                         f"== 0 and K % {K_BLOCK} == 0, got N={2 * n if gated else n}, K={k}: "
                         "keep such weights 'subnormal'")
    if config is None:
        return choose_config(rows_per_expert, n, k, gated=gated, block_m=block_m,
                             w_order=w_order, interpret=device.type == "cpu",
                             gluon=indexed and _gluon_usable(device, w_order))
    if config.backend == "gluon" and (not indexed or device.type != "cuda"):
        raise ValueError("the gluon backend (decode and prefill tiles) "
                         "runs the indexed path on an sm_90 GPU only")
    if config.split_k > 1 and not indexed:
        raise ValueError("split_k > 1 is implemented for the indexed path only")
    want = K_ORDER_OF[w_order]
    if (config.k_order != want) if want else (config.k_order in K_ORDER_OF.values()):
        raise ValueError(f"config.k_order={config.k_order!r} does not read w_order={w_order!r} "
                         "weights: k_order 'fragments' / 'subnormal' go with the w_order of "
                         "the same name only")
    if block_m is not None and config.block_m != block_m:
        raise ValueError(f"config.block_m={config.block_m} differs from the alignment "
                         f"block {block_m}")
    if k % config.block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={config.block_k}")
    if w_order == "blocked" and K_BLOCK % config.block_k:
        raise ValueError(f"w_order 'blocked' needs block_k to divide {K_BLOCK} (a step inside "
                         f"one row-block piece), got {config.block_k}")
    if config.stream_k and not indexed:
        raise ValueError("stream_k is implemented for the indexed path only")
    if config.n_tiles > 1 and not (indexed and not gated and config.block_k == k):
        raise ValueError(f"n_tiles={config.n_tiles} needs the indexed path, no activation and "
                         f"block_k == K (got block_k={config.block_k}, K={k})")
    return config


def _output(out: torch.Tensor | None, rows: int, n: int, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(rows, n, dtype=torch.bfloat16, device=like.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be BF16 {(rows, n)} with unit last stride, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def _launch_args(cfg: W4A16Config, gated: bool, n: int, w_order: str) -> dict:
    # EVEN_N: every program's columns lie inside N (a column-looping program covers n_tiles);
    # K_ORDER 5: the subnormal tiles on row blocks (w_order "blocked")
    k_order = 5 if w_order == "blocked" else K_ORDERS.index(cfg.k_order)
    args = dict(GATED=gated, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                K_ORDER=k_order, EVEN_N=n % (cfg.block_n * cfg.n_tiles) == 0,
                COMPUTE_F32=_INTERPRETED,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_registers and not _INTERPRETED:
        args["maxnreg"] = cfg.max_registers
    return args


def row_tiles(rows_per_expert: float, n: int, k: int, num_experts: int, device: torch.device,
              w_order: str, *, gated: bool = False, down: tuple[int, int] | None = None
              ) -> tuple[int, ...]:
    """``triton_config.choose_row_tiles`` for ``device``: the Gluon tiles (8-row decode, 96- and
    128-row prefill) are candidates on an sm_90 GPU with subnormal weights
    (``gluon_w4a16.gluon_ready``; where ``down`` is given, only if they apply to that GEMM on
    the same blocks too)."""
    device = torch.device(device)
    experts = num_experts if _gluon_usable(device, w_order) else 0
    return triton_config.choose_row_tiles(rows_per_expert, n, k, interpret=device.type == "cpu",
                                          gluon_experts=experts, num_sms=_num_sms(device),
                                          gated=gated, down=down)


def _gluon_usable(device: torch.device, w_order: str) -> bool:
    """The Gluon tiles can run: subnormal weights (or those in row blocks) on an sm_90 GPU
    (``gluon_w4a16.gluon_ready``)."""
    if device.type != "cuda" or w_order not in SUBNORMAL_W_ORDERS or _INTERPRETED:
        return False
    try:  # Gluon is experimental: a Triton without it (or with other names) keeps Triton's
        from . import gluon_prefill  # noqa: F401  (the prefill tile's names too)
        from .gluon_w4a16 import gluon_ready
    except (ImportError, AttributeError):
        return False
    return gluon_ready(device)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H200 so CPU tests take the GPU's path
    return torch.cuda.get_device_properties(device).multi_processor_count


# (device, stream) -> (partial tiles, arrival counts); the stream-K kernel leaves them zero
_STREAM_K_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _stream_k_buffers(device: torch.device, programs: int, tile: int, use: str = "add"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed FP32 ``[programs, 2 tile]`` partials and int32 ``[programs]`` counts for the
    stream-K kernel, one pair per device, stream and ``use``: kernels on one stream run one at
    a time and each launch leaves them zero again ("add": the kernels that add partial sums
    by atomics; "handover": the Gluon prefill tile, which leaves its counts zero but not its
    partials). Made while a CUDA graph is captured, they live in the graph's memory pool and
    serve that stream's later launches too."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, use)
    have = _STREAM_K_BUFFERS.get(key)
    if have is None or have[1].numel() < programs or have[0].shape[1] < 2 * tile:
        programs = max(programs, have[1].numel() if have else 0)
        tile = max(tile, have[0].shape[1] // 2 if have else 0)
        have = (torch.zeros(programs, 2 * tile, dtype=torch.float32, device=device),
                torch.zeros(programs, dtype=torch.int32, device=device))
        _STREAM_K_BUFFERS[key] = have
    return have


def _stream_k_buffers_left_zero() -> bool:
    """Whether every stream-K buffer is as the next launch on its stream expects: the counts
    zero, and the partials too where kernels add into them ("add"; the "handover" partials
    are written before they are read)."""
    return all(not arrivals.any() and (use == "handover" or not parts.any())
               for (_, _, use), (parts, arrivals) in _STREAM_K_BUFFERS.items())


def _prefill_stream_k(block_m: int, rows: tuple[int, ...]) -> int:
    """The Gluon prefill tile's ``stream_k`` on ``block_m``-row blocks: 1 where ``rows`` (the
    form's ``triton_config`` list) holds them, 2 (the 32-bit walk) where
    ``GLUON_PREFILL_STREAM_K_WALK32_ROWS`` does too, else 0."""
    if block_m not in rows:
        return 0
    return 2 if block_m in triton_config.GLUON_PREFILL_STREAM_K_WALK32_ROWS else 1


def indexed_config(
    num_routes: int,
    num_experts: int,
    n: int,
    k: int,
    block_m: int,
    *,
    activation: str | None = None,
    config: W4A16Config | None = None,
    w_order: str = "checkpoint",
    device: torch.device | str = "cuda",
    live_blocks: int | None = None,
) -> W4A16Config:
    """The config ``moe_gemm_indexed_triton`` launches with: ``config`` or the heuristic's,
    with the split-K factor decided (heuristic only) and trimmed so that no split is empty.

    :param n: output features (after ``silu_mul``: N_w / 2)
    :param live_blocks: the alignment's block count (``expert_ids.numel()``): it caps the
        busy-block estimate where the alignment is trimmed to its live blocks, as
        ``align.moe_align_mixed``'s remainder pieces are (a few experts' last rows; those are
        not split); an untrimmed alignment holds more blocks than the estimate, so it changes
        nothing there
    """
    device = torch.device(device)
    gated = _gated(activation)
    cfg = _resolve_config(config, num_routes / num_experts, n, k, gated, device, w_order,
                          block_m, indexed=True)
    split = cfg.split_k
    if config is None:
        # experts hit by num_routes uniform draws, times blocks per expert
        touched = triton_config.touched_experts(num_experts, num_routes)
        estimate = round(touched) * max(1, round(num_routes / num_experts / cfg.block_m))
        busy_blocks = min(estimate, live_blocks or estimate)
        if cfg.backend == "gluon" and cfg.block_m == 8:
            sms = _num_sms(device)
            per = 1 if gated else choose_gluon_n_tiles(busy_blocks, num_routes / num_experts,
                                                       n, k, sms)
            if per > 1:
                return dataclasses.replace(cfg, n_tiles=per)
            per_sm = choose_gluon_stream_k(busy_blocks, n, k, gated, sms)
            if per_sm:
                return dataclasses.replace(cfg, stream_k=per_sm)
            split = choose_gluon_split_k(busy_blocks, n, k, gated, sms)
            return dataclasses.replace(cfg, split_k=split) if split > 1 else cfg
    if cfg.backend == "gluon":
        if config is not None or cfg.halve:
            return cfg
        if (cfg.block_m in triton_config.GLUON_PREFILL_WIDE_ROWS
                and triton_config.choose_gluon_prefill_wide(busy_blocks, n, gated,
                                                            _num_sms(device))):
            wide = triton_config.GLUON_PREFILL_WIDE_TILES[cfg.block_m]
            sk = _prefill_stream_k(cfg.block_m, triton_config.GLUON_PREFILL_WIDE_STREAM_K_ROWS)
            return dataclasses.replace(cfg, block_n=2 * cfg.block_n, num_stages=wide.num_stages,
                                       stream_k=sk)
        if cfg.block_m != 32:
            sk = _prefill_stream_k(cfg.block_m, triton_config.GLUON_PREFILL_STREAM_K_ROWS)
            return dataclasses.replace(cfg, stream_k=sk)
        # 32-row blocks take the Gluon tile in its wide form only: the 256-row form ran
        # 1.00-1.03 of the Triton tile's time at EP8 down T=128 (variant 60)
        cfg = choose_config(num_routes / num_experts, n, k, gated=gated, block_m=block_m,
                            w_order=w_order)
    if config is None:
        if cfg.n_tiles > 1:
            per = choose_n_tiles(cfg, busy_blocks, n, _num_sms(device))
            return dataclasses.replace(cfg, n_tiles=per)
        # A piece trimmed to fewer blocks than the estimate is a mixed alignment's remainder
        # (a few experts' last rows, launched after the main piece): unsplit, it took 0.95-0.98
        # of 2 or 4 splits' time at EP8 gate_up T=512 (4-7 blocks of 32 column tiles, 4 draws,
        # H100, scripts/kernel_lab/remainder_split.py, docs/performance.md §24)
        remainder = live_blocks is not None and live_blocks < estimate
        split = 1 if remainder else choose_split_k(
            cfg, busy_blocks * triton.cdiv(n, cfg.block_n), k, _num_sms(device))
    steps = k // cfg.block_k
    split = triton.cdiv(steps, triton.cdiv(steps, split))  # no empty split
    return cfg if split == cfg.split_k else dataclasses.replace(cfg, split_k=split)


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
    w_order: str = "checkpoint",
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
    :param w_order: ``"checkpoint"`` (``w_packed`` as written by chordq), ``"fragments"``
        (``chordq.layout.fragment_order(w_packed)``, converted once at load time: ~10-20%
        faster at decode and prefill), ``"subnormal"`` (those words and
        ``w_scale = chordq.layout.subnormal_scales(scale)``) or ``"blocked"`` (those two in
        ``chordq.layout.row_blocks``, N % 128 == 0 and K % 256 == 0; ``moe.prepare_weights``
        picks it when every scale fits and the shapes allow)
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
    out = _output(out, num_routes, n, x)
    # Every live block holds at least one route, so at most num_routes blocks are live: a
    # tighter grid than the alignment's capacity, which is mostly padding when experts are many
    # and tokens few (TP8 at T = 1: 8 live of ~360 blocks).
    grid_m = min(num_m_blocks, num_routes)
    cfg = indexed_config(num_routes, w_packed.shape[0], n, k, block_m, activation=activation,
                         config=config, w_order=w_order, device=x.device,
                         live_blocks=num_m_blocks)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if grid_m * n_tiles == 0:
        return out
    split = cfg.split_k
    if cfg.gluon_decode:
        from .gluon_w4a16 import moe_gemm_indexed_gluon

        return moe_gemm_indexed_gluon(
            x, w_packed, w_scale, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
            out, num_routes=num_routes, grid_m=grid_m, block_n=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, gated=gated,
            blocked=w_order == "blocked", n_tiles=cfg.n_tiles, block_m=cfg.block_m,
            stream_k=cfg.stream_k, split_k=cfg.split_k, halve=cfg.halve)
    if cfg.backend == "gluon":
        from .gluon_prefill import moe_gemm_indexed_gluon_prefill

        return moe_gemm_indexed_gluon_prefill(
            x, w_packed, w_scale, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
            out, num_routes=num_routes, grid_m=grid_m, block_m=cfg.block_m,
            block_n=cfg.block_n, block_k=cfg.block_k, num_stages=cfg.num_stages, gated=gated,
            blocked=w_order == "blocked", stream_k=cfg.stream_k)
    args = (num_routes, n, k, grid_m, x.stride(0), w_packed.stride(0), w_packed.stride(1),
            w_scale.stride(0), w_scale.stride(1))
    if cfg.n_tiles > 1:
        _w4a16_indexed_wide_kernel[(grid_m * triton.cdiv(n, cfg.block_n * cfg.n_tiles),)](
            x, w_packed, w_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
            *args, out.stride(0), TOP_K=top_k, N_TILES=cfg.n_tiles, **_launch_args(cfg, gated, n, w_order))
        return out
    if cfg.stream_k:
        programs = min(_num_sms(x.device) * cfg.stream_k, grid_m * n_tiles)
        _w4a16_indexed_streamk_kernel[(programs,)](
            x, w_packed, w_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
            *_stream_k_buffers(x.device, programs, cfg.block_n * cfg.block_m), *args,
            out.stride(0), TOP_K=top_k, COLUMNS_FIRST=cfg.columns_first,
            **_launch_args(cfg, gated, n, w_order))
        return out
    if split == 1:
        _w4a16_indexed_kernel[(grid_m * n_tiles, 1)](
            x, w_packed, w_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
            *args, out.stride(0), TOP_K=top_k, SPLIT_K=1, COLUMNS_FIRST=cfg.columns_first,
            **_launch_args(cfg, gated, n, w_order))
        return out
    n_w = w_packed.shape[1]
    rows, by_slot = split_k_partial_rows(grid_m, cfg.block_m, num_routes)
    partials = torch.empty(split, rows, n_w, dtype=torch.float32, device=x.device)
    _w4a16_indexed_kernel[(grid_m * n_tiles, split)](
        x, w_packed, w_scale, partials, sorted_token_ids, expert_ids, num_tokens_post_padded,
        *args, n_w, TOP_K=top_k, SPLIT_K=split, COLUMNS_FIRST=cfg.columns_first,
        PART_BY_SLOT=by_slot, **_launch_args(cfg, gated, n, w_order))
    reduce_n = min(128, cfg.block_n)
    _split_k_reduce_kernel[(grid_m * triton.cdiv(n, reduce_n),)](
        partials, out, sorted_token_ids, expert_ids, num_tokens_post_padded, num_routes, n,
        grid_m, n_w, out.stride(0), GATED=gated, BLOCK_M=cfg.block_m, BLOCK_N=reduce_n,
        SPLIT_K=split, COMPUTE_F32=_INTERPRETED, PART_BY_SLOT=by_slot, num_warps=4)
    return out


def split_k_partial_rows(grid_m: int, block_m: int, num_routes: int) -> tuple[int, bool]:
    """Rows of the split-K partials and whether they are the grid's slots in ``sorted_ids``
    (else route ids): whichever are fewer. A piece of a mixed alignment holds a few blocks
    of all the routes (EP8 T=512's 32-row remainder piece: about 5 blocks, 160 slots against
    4096 route ids, so 10 MB of FP32 partials at 4 splits instead of 268 MB)."""
    slots = grid_m * block_m
    return (slots, True) if slots < num_routes else (num_routes, False)


def moe_gemm_mixed_triton(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    pieces: list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
    top_k: int,
    *,
    activation: str | None = None,
    out: torch.Tensor | None = None,
    w_order: str = "checkpoint",
) -> torch.Tensor:
    """``moe_gemm_indexed_triton`` over ``align.moe_align_mixed`` pieces: one launch per row-tile
    size, each with the heuristic's config for its size, into one output (disjoint rows).

    :param pieces: ``[(block_m, (sorted_token_ids, expert_ids, num_tokens_post_padded)), ...]``
    Other parameters and the result as for ``moe_gemm_indexed_triton``.
    """
    n = _check_weights(x, w_packed, w_scale, _gated(activation))
    out = _output(out, x.shape[0] * top_k, n, x)
    for block_m, aligned in pieces:
        moe_gemm_indexed_triton(x, w_packed, w_scale, *aligned, top_k, block_m,
                                activation=activation, out=out, w_order=w_order)
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
    w_order: str = "checkpoint",
) -> torch.Tensor:
    """Contiguous grouped W4A16 GEMM (DeepGEMM layout, format.md §5.2).

    :param x: BF16 ``[m, K]``; each expert's rows consecutive, segments aligned to 128 rows
        (more precisely: to ``config.block_m``, which divides 128)
    :param m_indices: int32 ``[m]`` expert per row, -1 for padding rows (left unwritten)
    :param w_order: as for ``moe_gemm_indexed_triton``
    :returns: BF16 ``[m, N]`` (``N_w / 2`` with silu_mul)
    """
    gated = _gated(activation)
    _check_device(x, w_packed, w_scale, m_indices)
    n = _check_weights(x, w_packed, w_scale, gated)
    m, k = x.shape
    if m_indices.dtype != torch.int32 or tuple(m_indices.shape) != (m,):
        raise ValueError(f"m_indices must be int32 [{m}], got {m_indices.dtype} "
                         f"{tuple(m_indices.shape)}")
    cfg = _resolve_config(config, m / w_packed.shape[0], n, k, gated, x.device, w_order)
    out = _output(out, m, n, x)
    num_m_blocks = triton.cdiv(m, cfg.block_m)
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    if grid[0] == 0:
        return out
    _w4a16_contiguous_kernel[grid](
        x, w_packed, w_scale, out, m_indices, m, n, k, num_m_blocks,
        x.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), **_launch_args(cfg, gated, n, w_order))
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
    w_order: str = "checkpoint",
) -> torch.Tensor:
    """Masked grouped W4A16 GEMM (DeepGEMM layout, format.md §5.2).

    :param x: BF16 ``[G, max_m, K]`` (or flat ``[G * max_m, K]``); group g uses expert g
    :param masked_m: int32 ``[G]`` valid rows per group (rows past it are left unwritten)
    :param expected_m: typical rows per group, only for the config heuristic (default max_m)
    :param w_order: as for ``moe_gemm_indexed_triton``
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
    cfg = _resolve_config(config, max_m if expected_m is None else expected_m, n, k, gated,
                          x.device, w_order)
    out = _output(out, g * max_m, n, x)
    num_m_blocks = g * triton.cdiv(max_m, cfg.block_m)
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    if grid[0] == 0:
        return out
    _w4a16_masked_kernel[grid](
        x, w_packed, w_scale, out, masked_m, max_m, n, k, num_m_blocks,
        x.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), **_launch_args(cfg, gated, n, w_order))
    return out
