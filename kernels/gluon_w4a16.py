"""The 8-row W4A16 decode tile in Gluon (Triton's explicit-layout dialect), on ``mma.sync``.

``out[r, n] = sum_k x[row(r), k] * W_e[n, k]`` for the indexed routing of ``triton_w4a16``
(``moe_align_block_size(.., 8)`` blocks), on the shipped weights: words in fragment order
(``chordq.layout.fragment_order``) and ``chordq.layout.subnormal_scales``, dequantized by the
same 12-instruction subnormal PTX as the Triton kernels (``_DEQUANT_SUBNORMAL_ASM``), with
``activation="silu_mul"`` fused as there (gate and up rounded to BF16 first).

Why a second kernel (docs/kernel_notes.md, variant 26): at decode the Triton kernels are
instruction-issue bound on their 16-row wgmma tiles (``tl.dot``'s minimum; wgmma descriptors
and ``WARPGROUP.ARRIVE``/``DEPBAR`` per k16 slice). Here each warp owns 32 weight rows (two
m16 slices) and 8 token rows, and issues ``HMMA.16816``: one instruction per slice, the
dequantized words are its A fragments as they come out of the PTX (fragment order: word
``4 g + t`` of a row is lane ``t``'s fragment for slices ``2 g`` and ``2 g + 1``), and X, in
natural K, is its B fragment. Words, X rows and scales go global -> shared memory by 16-byte
``cp.async`` in a 2-stage ring (one K step of 256 in flight while the other is computed);
words and X reach the registers by ``ldmatrix`` (swizzled, conflict-free).

Measured on the H200 against the shipped Triton decode tiles and Humming 0.1.19, same process
(``scripts/kernel_lab/gluon_decode.py``): 0.76-0.97 of the Triton kernels' time where it is
used (``triton_config.gluon_decode_applies``); Humming's ratio in docs/performance.md §12.

GPU only: Gluon has no interpreter. ``gluon_ready`` says whether this Triton and device run it;
the CPU interpreter and other GPUs keep the Triton tiles. Gluon is experimental and its names
move (Triton 3.6 on the H200, 3.9 in CI): the two that moved are looked up once below.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .triton_w4a16 import _DEQUANT_SUBNORMAL_ASM

__all__ = ["GLUON_BLOCK_K", "compile_kernel_sm90", "compile_sm90", "gluon_ready",
           "moe_gemm_indexed_gluon", "stream_k_registers"]

GLUON_BLOCK_K = 256  # K per step: 8 scale groups, 32 words per weight row
BK = gl.constexpr(GLUON_BLOCK_K)
BT = gl.constexpr(8)  # token rows per tile: mma.sync m16n8k16's N
_ASM = gl.constexpr(_DEQUANT_SUBNORMAL_ASM.value)
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@functools.cache
def gluon_ready(device: torch.device | str) -> bool:
    """True on an sm_90 CUDA device (Hopper): the tile is tuned for the H200."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


@gluon.constexpr_function
def _operand_layouts(BN, BK, num_warps):
    """Register layouts (linear: bases of register, lane and warp bits) of one K step's words
    ``[BN, BK/8]`` and scales ``[BN, BK/32, 4]`` (each group's scale once per word of the
    group) with ``[num_warps, 1]`` warps of 16 rows: the A fragments of ``mma.sync`` and of
    wgmma's register operand, so converting to the operand layout moves nothing."""
    rows = [[16 * num_warps << i, 0] for i in range((BN // (16 * num_warps)).bit_length() - 1)]
    warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    cols = [[0, 4 << i] for i in range((BK // 32).bit_length() - 1)]
    words = gl.DistributedLinearLayout(
        reg_bases=cols + [[8, 0]] + rows,
        lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=warps, block_bases=[], shape=[BN, BK // 8])
    scales = gl.DistributedLinearLayout(
        reg_bases=[[0, c[1] // 4, 0] for c in cols] + [[8, 0, 0]] + [r + [0] for r in rows],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[w + [0] for w in warps], block_bases=[], shape=[BN, BK // 32, 4])
    return words, scales


@gluon.constexpr_function
def _layouts(BN, num_warps, BM=8):
    """``_operand_layouts`` for one 256-deep step, and X rows ``[BM, 256]`` as ``mma.sync``'s
    B fragment (rows past 8: further n8 fragments, in registers)."""
    words, scales = _operand_layouts(BN, 256, num_warps)
    rows = [[8 << i, 0] for i in range((BM // 8).bit_length() - 1)]
    x = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8]] + rows + [[0, 16], [0, 32], [0, 64], [0, 128]],
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[BM, 256])
    return words, scales, x


@gluon.jit
def _dequant(w, s, s3_layout: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """Words ``[BN, BK/8]`` and scales ``[BN, BK/32]`` -> BF16 ``[BN, BK]`` in natural K."""
    G: gl.constexpr = BK // 32
    s3, _ = gl.broadcast(gl.expand_dims(s, 2), gl.zeros([BN, G, 4], gl.int8, s3_layout))
    s4 = gl.reshape(s3, [BN, BK // 8])  # word 4 g + t: group g's scale
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        _ASM, "=r,=r,=r,=r,r,r,r", [gl.join(w, w), gl.join(s4, s4)],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=2)
    pairs = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [BN, word, h, j & 1, j >> 1]
    # word 4 g + t, pair j, half h: k = 32 g + 16 (j >> 1) + 8 (j & 1) + 2 t + h
    a = gl.reshape(pairs, [BN, G, 4, 2, 2, 2])
    return gl.reshape(gl.permute(a, [0, 1, 5, 4, 2, 3]), [BN, BK])


@gluon.jit
def _dequant_mma(w, s, x, acc, a_layout: gl.constexpr, b_layout: gl.constexpr,
                 s3_layout: gl.constexpr, BN: gl.constexpr):
    """``acc += W x^T`` for one K step: words ``[BN, 32]``, scales ``[BN, 8]``, X ``[8, 256]``."""
    a = gl.convert_layout(_dequant(w, s, s3_layout, BN, BK), a_layout, assert_trivial=True)
    b = gl.convert_layout(gl.permute(x, [1, 0]), b_layout, assert_trivial=True)
    return mma_v2(a, b, acc)


@gluon.jit
def _weight_rows(r, n0, N, OUT_N: gl.constexpr, GATED: gl.constexpr):
    """Tile row ``r`` -> weight row: ``n0 + r``; with GATED, rows ``[0, OUT_N)`` are gate rows
    ``n0 + r`` and the rest the matching up rows ``N + n0 + r - OUT_N``."""
    if GATED:
        return gl.where(r < OUT_N, n0 + r, N + n0 + r - OUT_N)
    return n0 + r


@gluon.constexpr_function
def _mma_layout(num_warps):
    """The accumulator: ``mma.sync`` m16n8, ``[num_warps, 1]`` warps of 16 weight rows."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, 8])


@gluon.constexpr_function
def _shared_layouts():
    """The copy ring's swizzles: words ``[BN, 32]``, X rows ``[BM, 256]``, scales ``[BN, 8]``."""
    return (gl.SwizzledSharedLayout(4, 1, 8, [1, 0]), gl.SwizzledSharedLayout(8, 1, 8, [1, 0]),
            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.jit
def _decode_acc(x_ptr, w_ptr, s_ptr, sorted_ids_ptr, w_smem, x_smem, s_smem, expert, row0, n0,
                first, num_steps, N, K, num_routes, stride_xm, TOP_K: gl.constexpr,
                BN: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr,
                BLOCKED: gl.constexpr, BM: gl.constexpr, num_warps: gl.constexpr):
    """``C^T [BN, BM]`` of the ``BM`` routes at ``sorted_ids_ptr + row0`` (expert ``expert``)
    and the column tile from weight row ``n0``, over K steps ``first .. first + num_steps``,
    through the copy ring in ``w_smem``, ``x_smem``, ``s_smem``."""
    w_l: gl.constexpr = _layouts(BN, num_warps)[0]
    s3_l: gl.constexpr = _layouts(BN, num_warps)[1]
    x_l: gl.constexpr = _layouts(BN, num_warps, BM)[2]
    mma: gl.constexpr = _mma_layout(num_warps)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # copies: one 16-byte chunk per thread and register
    wc_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    xc_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    sc_l: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    OUT_N: gl.constexpr = BN // 2 if GATED else BN

    k8 = (K // BK) * 32  # words per row, visibly a multiple of 32 (16-byte rows)
    ks = (K // BK) * 8
    n_w = 2 * N if GATED else N
    wr = _weight_rows(gl.arange(0, BN, layout=gl.SliceLayout(1, wc_l)), n0, N, OUT_N, GATED)
    sr = _weight_rows(gl.arange(0, BN, layout=gl.SliceLayout(1, sc_l)), n0, N, OUT_N, GATED)
    wc = gl.arange(0, 32, layout=gl.SliceLayout(0, wc_l))
    sc = gl.arange(0, 8, layout=gl.SliceLayout(0, sc_l))
    if BLOCKED:  # row block r // 128 (128 k8 words), row r % 128 of each piece
        w_ptrs = (w_ptr + expert * n_w * k8 + (wr // 128)[:, None] * (128 * k8)
                  + (wr % 128)[:, None] * 32 + wc[None, :])
        s_ptrs = (s_ptr + expert * n_w * ks + (sr // 128)[:, None] * (128 * ks)
                  + (sr % 128)[:, None] * 8 + sc[None, :])
        w_step = 4096  # words and scales from one piece to the next: 128 rows
        s_step = 1024
    else:
        w_ptrs = w_ptr + expert * n_w * k8 + wr[:, None] * k8 + wc[None, :]
        s_ptrs = s_ptr + expert * n_w * ks + sr[:, None] * ks + sc[None, :]
        w_step = 32
        s_step = 8
    xr = gl.arange(0, BM, layout=gl.SliceLayout(1, xc_l))
    xc = gl.arange(0, BK, layout=gl.SliceLayout(0, xc_l))
    routes = gl.load(sorted_ids_ptr + row0 + xr)
    routes = gl.where(routes < num_routes, routes, 0)  # sentinels read row 0, not stored
    x_ptrs = x_ptr + (routes // TOP_K).to(gl.int64)[:, None] * stride_xm + xc[None, :]
    w_ptrs += first * w_step
    s_ptrs += first * s_step
    x_ptrs += first * BK

    for i in gl.static_range(STAGES - 1):
        ok = i < num_steps
        _cp_async(w_smem.index(i), w_ptrs + i * w_step, mask=ok)
        _cp_async(x_smem.index(i), x_ptrs + i * BK, mask=ok)
        _cp_async(s_smem.index(i), s_ptrs + i * s_step, mask=ok)
        async_copy.commit_group()
    acc = gl.zeros([BN, BM], gl.float32, mma)
    for step in range(num_steps):
        nxt = step + STAGES - 1
        slot = nxt % STAGES
        ok = nxt < num_steps
        _barrier()  # every warp is done with this slot (step - 1's data)
        _cp_async(w_smem.index(slot), w_ptrs + nxt * w_step, mask=ok)
        _cp_async(x_smem.index(slot), x_ptrs + nxt * BK, mask=ok)
        _cp_async(s_smem.index(slot), s_ptrs + nxt * s_step, mask=ok)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        _barrier()  # step's copies, made by all threads, are visible
        cur = step % STAGES
        acc = _dequant_mma(w_smem.index(cur).load(w_l), s_smem.index(cur).load(
            gl.SliceLayout(2, s3_l)), x_smem.index(cur).load(x_l), acc, a_l, b_l, s3_l, BN)
    return acc


@gluon.jit
def _store_out(acc, out_ptr, sorted_ids_ptr, row0, n0, num_routes, stride_om,
               OUT_N: gl.constexpr, BM: gl.constexpr, GATED: gl.constexpr, keep=True):
    """Store a finished ``C^T`` tile (the ``BM`` routes at ``sorted_ids_ptr + row0``) as BF16
    rows of ``out`` (GATED: SiLU(gate) * up); ``keep``: a scalar mask, False stores nothing."""
    if GATED:  # rows [0, BN/2) gate, [BN/2, BN) up: the same threads, a register apart
        gate, up = gl.split(gl.permute(gl.reshape(acc, [2, OUT_N, BM]), [1, 2, 0]))
        gate = gate.to(gl.bfloat16).to(gl.float32)
        up = up.to(gl.bfloat16).to(gl.float32)
        res = gate / (1.0 + gl.exp(-gate)) * up
    else:
        res = acc
    o_l: gl.constexpr = res.type.layout
    orow = gl.arange(0, OUT_N, layout=gl.SliceLayout(1, o_l))
    ocol = gl.arange(0, BM, layout=gl.SliceLayout(0, o_l))
    oroutes = gl.load(sorted_ids_ptr + row0 + ocol)
    o_ptrs = out_ptr + oroutes.to(gl.int64)[None, :] * stride_om + (n0 + orow)[:, None]
    gl.store(o_ptrs, res.to(gl.bfloat16), mask=(oroutes < num_routes)[None, :] & keep)


@gluon.jit
def _decode_rows(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, w_smem, s_smem, expert, row0, n0,
                 first, num_steps, N, K, num_routes, stride_xm, stride_om, TOP_K: gl.constexpr,
                 BN: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr,
                 BLOCKED: gl.constexpr, BM: gl.constexpr, num_warps: gl.constexpr):
    """``_decode_acc`` and ``_store_out`` of the ``BM`` routes at ``row0`` with an X ring of
    ``BM`` rows allocated here (HALVE's two branches: disjoint lifetimes, which the allocator
    overlaps)."""
    OUT_N: gl.constexpr = BN // 2 if GATED else BN
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], _shared_layouts()[1])
    acc = _decode_acc(x_ptr, w_ptr, s_ptr, sorted_ids_ptr, w_smem, x_smem, s_smem, expert, row0,
                      n0, first, num_steps, N, K, num_routes, stride_xm, TOP_K, BN, GATED,
                      STAGES, BLOCKED, BM, num_warps)
    _store_out(acc, out_ptr, sorted_ids_ptr, row0, n0, num_routes, stride_om, OUT_N, BM, GATED)


@gluon.jit
def _w4a16_decode_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, ntp_ptr,
                         N, K, num_routes, stride_xm, stride_om,
                         TOP_K: gl.constexpr, BN: gl.constexpr, GATED: gl.constexpr,
                         STAGES: gl.constexpr, BLOCKED: gl.constexpr, BM: gl.constexpr,
                         num_warps: gl.constexpr, SPLIT: gl.constexpr = 1,
                         HALVE: gl.constexpr = False):
    """One (BM-row block, column tile): ``C^T [BN, BM]`` over all of K, then the store. With
    GATED the tile's rows are ``BN / 2`` gate rows and the matching up rows (``N + n``), kept
    in the same threads (the top row bit is a register bit) for the fused SiLU-and-mul.
    SPLIT > 1: program ``(.., .., s)`` runs the s-th share of the K steps and stores its FP32
    sums (before any activation) into ``out_ptr``'s partial ``s``.
    BLOCKED: words and scales in ``chordq.layout.row_blocks`` (a step of 128 rows is one
    16 KB piece of words). HALVE (16-row blocks, no SPLIT): a block whose last 8 rows are all
    padding runs as an 8-row block (one ``mma.sync`` n8 fragment a slice instead of two), so
    one launch serves experts of up to 8 rows at the 8-row tile's cost and those of 9-16 rows
    in one block instead of two."""
    mma: gl.constexpr = _mma_layout(num_warps)
    OUT_N: gl.constexpr = BN // 2 if GATED else BN

    pid_n = gl.program_id(0)
    pid_b = gl.program_id(1)
    expert = gl.load(expert_ids_ptr + pid_b).to(gl.int64)
    if (pid_b * BM < gl.load(ntp_ptr)) & (expert >= 0):
        n0 = pid_n * OUT_N
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 32], _shared_layouts()[0])
        s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 8], _shared_layouts()[2])
        num_steps = K // BK
        first = 0
        if SPLIT > 1:  # this program's share of the K steps (the host leaves none empty)
            per = (num_steps + SPLIT - 1) // SPLIT
            first = gl.program_id(2) * per
            num_steps = gl.minimum(per, num_steps - first)
        if HALVE:  # sorted ids keep an expert's routes first: row 8 tells if rows 8-15 are any
            if gl.load(sorted_ids_ptr + pid_b * BM + BM // 2) < num_routes:
                _decode_rows(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, w_smem, s_smem,
                             expert, pid_b * BM, n0, first, num_steps, N, K, num_routes,
                             stride_xm, stride_om, TOP_K, BN, GATED, STAGES, BLOCKED, BM,
                             num_warps)
            else:
                _decode_rows(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, w_smem, s_smem,
                             expert, pid_b * BM, n0, first, num_steps, N, K, num_routes,
                             stride_xm, stride_om, TOP_K, BN, GATED, STAGES, BLOCKED, BM // 2,
                             num_warps)
            return
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], _shared_layouts()[1])
        acc = _decode_acc(x_ptr, w_ptr, s_ptr, sorted_ids_ptr, w_smem, x_smem, s_smem, expert,
                          pid_b * BM, n0, first, num_steps, N, K, num_routes, stride_xm, TOP_K,
                          BN, GATED, STAGES, BLOCKED, BM, num_warps)
        if SPLIT > 1:  # FP32 partial [SPLIT, num_routes, n_w] (gate, then up columns): the
            # reduce kernel (triton_w4a16._split_k_reduce_kernel) sums and finishes
            prow = _weight_rows(gl.arange(0, BN, layout=gl.SliceLayout(1, mma)), n0, N, OUT_N,
                                GATED)
            pcol = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
            proutes = gl.load(sorted_ids_ptr + pid_b * BM + pcol)
            p_ptrs = (out_ptr + gl.program_id(2).to(gl.int64) * num_routes * stride_om
                      + proutes.to(gl.int64)[None, :] * stride_om + prow[:, None])
            gl.store(p_ptrs, acc, mask=(proutes < num_routes)[None, :])
        else:
            _store_out(acc, out_ptr, sorted_ids_ptr, pid_b * BM, n0, num_routes, stride_om,
                       OUT_N, BM, GATED)


@gluon.jit
def _decode_piece(tile, first, num, steps, slot, col_tiles, x_ptr, w_ptr, s_ptr, out_ptr,
                  sorted_ids_ptr, expert_ids_ptr, parts_ptr, arrivals_ptr, w_smem, x_smem, s_smem,
                  N, K, num_routes, stride_xm, stride_om, stride_p, TOP_K: gl.constexpr,
                  BN: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr,
                  BLOCKED: gl.constexpr, BM: gl.constexpr, num_warps: gl.constexpr):
    """K steps ``first .. first + num`` of ``tile`` (block ``tile // col_tiles``, column tile
    ``tile % col_tiles``) for the stream-K kernel: a whole tile is stored; a cut one is added
    into boundary ``slot`` of ``parts_ptr`` and stored by the second of its two programs to
    arrive (``triton_w4a16._streamk_piece``'s protocol)."""
    mma: gl.constexpr = _mma_layout(num_warps)
    OUT_N: gl.constexpr = BN // 2 if GATED else BN
    pid_b = tile // col_tiles
    n0 = (tile % col_tiles) * OUT_N
    expert = gl.load(expert_ids_ptr + pid_b).to(gl.int64)
    if expert >= 0:  # both programs of a cut tile skip an expert of another rank alike
        _barrier()  # every warp is done with the copy ring's last piece
        acc = _decode_acc(x_ptr, w_ptr, s_ptr, sorted_ids_ptr, w_smem, x_smem, s_smem, expert,
                          pid_b * BM, n0, first, num, N, K, num_routes, stride_xm, TOP_K, BN,
                          GATED, STAGES, BLOCKED, BM, num_warps)
        # Masks, not branches, pick what happens: Triton 3.6 fails to lower this kernel with
        # a store under either branch of a run-time condition next to another store
        cut = num < steps
        prow = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        pcol = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        part = parts_ptr + slot * stride_p + prow[:, None] * BM + pcol[None, :]
        zeros = gl.zeros([BN, BM], gl.int32, mma)
        gl.atomic_add(part, acc, mask=zeros + cut.to(gl.int32) != 0, sem="relaxed")
        _barrier()  # every thread's partial is in before the count
        second = cut & (gl.atomic_add(arrivals_ptr + slot, 1, mask=cut, sem="acq_rel") == 1)
        last = zeros + second.to(gl.int32) != 0
        # read where the adds went, and leave zeros for the next launch
        total = gl.atomic_add(part, zeros.to(gl.float32), mask=last, sem="relaxed")
        gl.store(part, zeros.to(gl.float32), mask=last)
        gl.store(arrivals_ptr + slot, 0, mask=second)
        _store_out(gl.where(cut, total, acc), out_ptr, sorted_ids_ptr, pid_b * BM, n0,
                   num_routes, stride_om, OUT_N, BM, GATED, (not cut) | second)


@gluon.jit
def _stream_k_shared(tiles, programs):
    """``triton_w4a16._stream_k_shared`` for the Gluon kernels (a Gluon kernel cannot call a
    Triton function where ``TRITON_INTERPRET=1`` interprets Triton's; host twin
    ``triton_w4a16.stream_k_shared``)."""
    tail = tiles % programs
    return gl.where((tail > 0) & (tail * 5 < programs * 4), gl.minimum(tiles, tail + programs), 0)


@gluon.jit
def _w4a16_decode_sk_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr,
                            ntp_ptr, parts_ptr, arrivals_ptr, N, K, num_routes, num_blocks,
                            stride_xm, stride_om, stride_p, TOP_K: gl.constexpr,
                            BN: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr,
                            BLOCKED: gl.constexpr, BM: gl.constexpr, num_warps: gl.constexpr):
    """The decode tile as stream-K (``triton_w4a16._w4a16_indexed_streamk_kernel``'s
    schedule): persistent programs take whole tiles (column tiles fastest) for the full waves;
    a last wave under 80% full and the full wave before it are laid end to end as K steps and
    cut into one equal range per program. ``parts_ptr`` ``[programs, stride_p]`` FP32 and
    ``arrivals_ptr`` ``[programs]`` int32 are zero before and after each launch.

    Why: TP8 gate_up decode makes about as many tiles as the 528 program slots (4 an SM):
    T=20 ran 69.5 µs where one wave sufficed and 91.3 where ~540 tiles spilled a few into a
    second (H200, variant 50); Humming runs these rows stream-K."""
    OUT_N: gl.constexpr = BN // 2 if GATED else BN
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 32], _shared_layouts()[0])
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], _shared_layouts()[1])
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 8], _shared_layouts()[2])
    col_tiles = N // OUT_N
    live = gl.minimum((gl.load(ntp_ptr) + BM - 1) // BM, num_blocks)
    tiles = live * col_tiles
    programs = gl.minimum(gl.num_programs(0), tiles)
    pid = gl.program_id(0)
    if pid < programs:
        steps = K // BK
        sk_tiles = _stream_k_shared(tiles, programs)
        dp_tiles = tiles - sk_tiles
        for tile in range(pid, dp_tiles, programs):
            _decode_piece(tile, 0, steps, steps, 0, col_tiles, x_ptr, w_ptr, s_ptr, out_ptr,
                          sorted_ids_ptr, expert_ids_ptr, parts_ptr, arrivals_ptr, w_smem,
                          x_smem, s_smem, N, K, num_routes, stride_xm, stride_om, stride_p,
                          TOP_K, BN, GATED, STAGES, BLOCKED, BM, num_warps)
        total = sk_tiles.to(gl.int64) * steps
        it = pid * total // programs
        end = (pid + 1) * total // programs
        while it < end:
            tile = dp_tiles + (it // steps).to(gl.int32)
            first = (it - (tile - dp_tiles).to(gl.int64) * steps).to(gl.int32)
            num = gl.minimum(steps - first, (end - it).to(gl.int32))
            slot = gl.where(first > 0, pid, pid + 1)  # the boundary inside a cut tile
            _decode_piece(tile, first, num, steps, slot, col_tiles, x_ptr, w_ptr, s_ptr,
                          out_ptr, sorted_ids_ptr, expert_ids_ptr, parts_ptr, arrivals_ptr,
                          w_smem, x_smem, s_smem, N, K, num_routes, stride_xm, stride_om,
                          stride_p, TOP_K, BN, GATED, STAGES, BLOCKED, BM, num_warps)
            it += num


@gluon.jit
def _w4a16_decode_cols_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr,
                              ntp_ptr, N, num_routes, stride_xm, stride_om,
                              TOP_K: gl.constexpr, BN: gl.constexpr, N_TILES: gl.constexpr,
                              STAGES: gl.constexpr, num_warps: gl.constexpr):
    """One (8-row block, ``N_TILES`` column tiles) where K is one 256-deep step (TP8 down):
    the X rows are copied once and held as the B fragment, the loop runs over the column
    tiles with ``STAGES - 1`` tiles' words in flight, and each tile is stored as it is done.
    The K-loop kernel above has nothing to overlap at one step a tile and copies its X rows
    for every tile. One step a row is one row-block piece, so 'blocked' words and scales are
    in the plain order here."""
    # _w4a16_decode_kernel's layouts, restated: a Gluon body cannot unpack a tuple of
    # constexpr layouts ("cannot unpack non-iterable value", Triton 3.9), so no shared helper
    w_l: gl.constexpr = _layouts(BN, num_warps)[0]
    s3_l: gl.constexpr = _layouts(BN, num_warps)[1]
    x_l: gl.constexpr = _layouts(BN, num_warps)[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    wc_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    xc_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    sc_l: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    x_sl: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    s_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    pid_n = gl.program_id(0)
    pid_b = gl.program_id(1)
    expert = gl.load(expert_ids_ptr + pid_b).to(gl.int64)
    if (pid_b * BT < gl.load(ntp_ptr)) & (expert >= 0):
        n0 = pid_n * (N_TILES * BN)
        wr = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, wc_l))
        sr = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, sc_l))
        wc = gl.arange(0, 32, layout=gl.SliceLayout(0, wc_l))
        sc = gl.arange(0, 8, layout=gl.SliceLayout(0, sc_l))
        w_ptrs = w_ptr + expert * N * 32 + wr[:, None] * 32 + wc[None, :]
        s_ptrs = s_ptr + expert * N * 8 + sr[:, None] * 8 + sc[None, :]
        xr = gl.arange(0, BT, layout=gl.SliceLayout(1, xc_l))
        xc = gl.arange(0, BK, layout=gl.SliceLayout(0, xc_l))
        routes = gl.load(sorted_ids_ptr + pid_b * BT + xr)
        routes = gl.where(routes < num_routes, routes, 0)  # sentinels read row 0, not stored
        x_ptrs = x_ptr + (routes // TOP_K).to(gl.int64)[:, None] * stride_xm + xc[None, :]

        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 32], w_sl)
        s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 8], s_sl)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [BT, BK], x_sl)
        _cp_async(x_smem, x_ptrs)  # in the first group, with tile 0
        for i in gl.static_range(STAGES - 1):
            ok = i < N_TILES
            _cp_async(w_smem.index(i), w_ptrs + i * (BN * 32), mask=ok)
            _cp_async(s_smem.index(i), s_ptrs + i * (BN * 8), mask=ok)
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 2)
        _barrier()
        xb = gl.convert_layout(gl.permute(x_smem.load(x_l), [1, 0]), b_l, assert_trivial=True)

        orow = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        ocol = gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
        oroutes = gl.load(sorted_ids_ptr + pid_b * BT + ocol)
        o_ptrs = out_ptr + oroutes.to(gl.int64)[None, :] * stride_om + (n0 + orow)[:, None]
        o_mask = (oroutes < num_routes)[None, :]
        for j in range(N_TILES):
            nxt = j + STAGES - 1
            slot = nxt % STAGES
            ok = nxt < N_TILES
            _barrier()  # every warp is done with this slot (tile j - 1's words)
            _cp_async(w_smem.index(slot), w_ptrs + nxt * (BN * 32), mask=ok)
            _cp_async(s_smem.index(slot), s_ptrs + nxt * (BN * 8), mask=ok)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)
            _barrier()  # tile j's copies, made by all threads, are visible
            cur = j % STAGES
            w = _dequant(w_smem.index(cur).load(w_l),
                         s_smem.index(cur).load(gl.SliceLayout(2, s3_l)), s3_l, BN, BK)
            acc = mma_v2(gl.convert_layout(w, a_l, assert_trivial=True), xb,
                         gl.zeros([BN, BT], gl.float32, mma))
            gl.store(o_ptrs + j * BN, acc.to(gl.bfloat16), mask=o_mask)


def stream_k_registers(per_sm: int, num_warps: int) -> int:
    """The register cap that fits ``per_sm`` programs of the stream-K tile an SM, up to 4
    (more wait for a slot): ptxas takes 136 uncapped (3 an SM), 106 under a 128 cap, without
    spilling."""
    return min(255, 65536 // (min(per_sm, 4) * num_warps * 32) // 8 * 8)


def moe_gemm_indexed_gluon(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                           sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                           num_tokens_post_padded: torch.Tensor, top_k: int, out: torch.Tensor,
                           *, num_routes: int, grid_m: int, block_n: int, num_warps: int,
                           num_stages: int, gated: bool, blocked: bool = False,
                           n_tiles: int = 1, block_m: int = 8, split_k: int = 1,
                           max_registers: int | None = None, stream_k: int = 0,
                           halve: bool = False) -> torch.Tensor:
    """Launch the decode tile on ``block_m``-row blocks (8, 16 or 32);
    ``triton_w4a16.moe_gemm_indexed_triton`` checks the arguments (subnormal weights, the
    blocks' alignment) and calls this for ``backend="gluon"`` configs.
    ``blocked``: the weights are in ``chordq.layout.row_blocks`` (``w_order="blocked"``).
    ``n_tiles`` > 1: each program loops over that many column tiles (K = 256, no
    activation: ``_w4a16_decode_cols_kernel``). ``split_k`` > 1: FP32 partials over shares
    of the K steps, summed and finished by ``triton_w4a16._split_k_reduce_kernel``
    (``triton_config.choose_gluon_split_k``); ``max_registers``: Triton's ``maxnreg`` (a lab
    option). ``stream_k`` > 0: that many persistent programs an SM
    (``_w4a16_decode_sk_kernel``, ``triton_config.choose_gluon_stream_k``). ``halve``
    (``W4A16Config.halve``; 16-row blocks, no split or stream-K): a block whose last 8 rows are
    padding runs as an 8-row one (``_w4a16_decode_kernel``'s HALVE)."""
    n_w, k = w_packed.shape[1], x.shape[1]
    n = n_w // 2 if gated else n_w
    out_n = block_n // 2 if gated else block_n
    if k % GLUON_BLOCK_K or n % out_n:
        raise ValueError(f"the Gluon decode tile needs K % {GLUON_BLOCK_K} == 0 and N % "
                         f"{out_n} == 0, got K={k}, N={n}")
    if x.stride(1) != 1 or x.stride(0) % 8:
        raise ValueError("the Gluon decode tile needs X rows contiguous and 16-byte aligned")
    if n_tiles > 1:
        if gated or k != GLUON_BLOCK_K or n % (block_n * n_tiles) or num_stages < 2:
            raise ValueError(f"the column-looping decode tile needs K = {GLUON_BLOCK_K}, no "
                             f"activation, N % (block_n x n_tiles) == 0 and 2+ stages, got "
                             f"K={k}, N={n}, {block_n} x {n_tiles}, {num_stages} stages")
        _w4a16_decode_cols_kernel[(n // (block_n * n_tiles), grid_m)](
            x, w_packed, w_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
            n, num_routes, x.stride(0), out.stride(0), TOP_K=top_k, BN=block_n,
            N_TILES=n_tiles, STAGES=num_stages, num_warps=num_warps)
        return out
    opts = {} if max_registers is None else {"maxnreg": max_registers}
    if halve:
        if block_m != 16 or split_k > 1 or stream_k:
            raise ValueError(f"halve runs 16-row blocks without split_k or stream_k, got "
                             f"block_m={block_m}, split_k={split_k}, stream_k={stream_k}")
        opts["HALVE"] = True
    if stream_k:
        if split_k > 1 or block_m != 8:
            raise ValueError(f"stream_k runs the 8-row tile without split_k, got block_m="
                             f"{block_m}, split_k={split_k}")
        from .triton_w4a16 import _num_sms, _stream_k_buffers

        opts.setdefault("maxnreg", stream_k_registers(stream_k, num_warps))
        programs = min(_num_sms(x.device) * stream_k, grid_m * (n // out_n))
        parts, arrivals = _stream_k_buffers(x.device, programs, block_n * block_m)
        _w4a16_decode_sk_kernel[(programs,)](
            x, w_packed, w_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
            parts, arrivals, n, k, num_routes, grid_m, x.stride(0), out.stride(0),
            parts.stride(0), TOP_K=top_k, BN=block_n, GATED=gated, STAGES=num_stages,
            BLOCKED=blocked, BM=block_m, num_warps=num_warps, **opts)
        return out
    if split_k == 1:
        _w4a16_decode_kernel[(n // out_n, grid_m)](
            x, w_packed, w_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
            n, k, num_routes, x.stride(0), out.stride(0), TOP_K=top_k, BN=block_n, GATED=gated,
            STAGES=num_stages, BLOCKED=blocked, BM=block_m, num_warps=num_warps, **opts)
        return out
    steps = k // GLUON_BLOCK_K
    if not 1 < split_k <= steps or -(-steps // split_k) * (split_k - 1) >= steps:
        raise ValueError(f"split_k={split_k} leaves a split of the {steps} K steps empty")
    from .triton_w4a16 import _split_k_reduce_kernel

    partials = torch.empty(split_k, num_routes, n_w, dtype=torch.float32, device=x.device)
    _w4a16_decode_kernel[(n // out_n, grid_m, split_k)](
        x, w_packed, w_scale, partials, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_routes, x.stride(0), n_w, TOP_K=top_k, BN=block_n, GATED=gated,
        STAGES=num_stages, BLOCKED=blocked, BM=block_m, num_warps=num_warps, SPLIT=split_k,
        **opts)
    _split_k_reduce_kernel[(grid_m * -(-n // 128),)](
        partials, out, sorted_token_ids, expert_ids, num_tokens_post_padded, num_routes, n,
        grid_m, n_w, out.stride(0), GATED=gated, BLOCK_M=block_m, BLOCK_N=128, SPLIT_K=split_k,
        COMPUTE_F32=False, PART_BY_SLOT=False, num_warps=4)
    return out


# pointer arguments of the indexed kernels (the rest, but constexprs, are i32 scalars)
_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16",
             "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "ntp_ptr": "*i32"}


def compile_kernel_sm90(fn, consts: dict, types: dict | None = None, **options):
    """Build a Gluon indexed kernel for sm_90 without a GPU (Triton's compiler and ptxas run on
    the CPU): ``consts`` its constexprs (``num_warps`` among them), ``options`` the compile
    options beyond ``num_warps``. The compiled kernel's ``asm`` holds the PTX and cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    types = {**_POINTERS, **(types or {})}  # argument types beyond the pointers and i32
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in consts}
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                         constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": consts["num_warps"], **options})


def compile_sm90(block_n: int = 128, num_warps: int = 4, num_stages: int = 2, gated: bool = False,
                 top_k: int = 8, blocked: bool = True, n_tiles: int = 1, block_m: int = 8,
                 stream_k: int = 0, halve: bool = False):
    """The decode tile built for sm_90 on the CPU (``compile_kernel_sm90``: tests, kernel lab);
    ``n_tiles`` > 1: the column-looping form; ``stream_k`` > 0: the stream-K form under the
    register cap that ``moe_gemm_indexed_gluon`` gives it; ``halve``: 16-row blocks that run
    as 8 rows where their last 8 are padding."""
    if stream_k:
        return compile_kernel_sm90(_w4a16_decode_sk_kernel, {
            "TOP_K": top_k, "BN": block_n, "GATED": gated, "STAGES": num_stages,
            "BLOCKED": blocked, "BM": block_m, "num_warps": num_warps},
            {"parts_ptr": "*fp32", "arrivals_ptr": "*i32"},
            maxnreg=stream_k_registers(stream_k, num_warps))
    if n_tiles > 1:
        return compile_kernel_sm90(_w4a16_decode_cols_kernel, {
            "TOP_K": top_k, "BN": block_n, "N_TILES": n_tiles, "STAGES": num_stages,
            "num_warps": num_warps})
    return compile_kernel_sm90(_w4a16_decode_kernel, {
        "TOP_K": top_k, "BN": block_n, "GATED": gated, "STAGES": num_stages,
        "BLOCKED": blocked, "BM": block_m, "num_warps": num_warps, "SPLIT": 1, "HALVE": halve})
