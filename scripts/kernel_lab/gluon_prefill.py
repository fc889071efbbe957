"""Variant 27 (lab): warp-specialized W4A16 prefill tiles in Gluon, on wgmma.

Why (docs/kernel_notes.md, items 1 and 2): the prefill rows left over 1.15 were padding
(``tl.dot``'s power-of-two row tiles) and per-row throughput where Humming runs a
warp-specialized pipeline and Triton 3.6's ``warp_specialize`` fails on the Triton loop.

Two forms, both with a loader partition that copies words, scales and gathered X rows by
16-byte ``cp.async`` into a shared ring and signals per-slot ``ready`` mbarriers, consumers that
dequantize into wgmma's register A, and 96-row blocks as a 64-row and a 32-row accumulator:

- *lockstep* (here: ``w4a16_prefill_kernel``, tiles ``PREFILL_TILES``): one consumer
  partition of one or two warpgroups, A in registers (each step retires its own wgmmas: with
  one group left in flight ptxas hands its A registers to the next step, wrong results) or
  through a 2-slot shared ring (``A_SMEM``). 1.24-2.8x the Triton tiles' time: lost.
- *ping-pong* (shipped: ``chordq.kernels.gluon_prefill``, tiles ``PREFILL_PP``): the loader as
  the default partition, two consumer warpgroups as separate partitions with their own rows
  and stores. 0.79-0.94 of the Triton tiles' time at EP8 T=512-1024.

GPU only (no interpreter); the CPU compiles the lockstep tiles for sm_90 (Triton 3.6 on
PYTHONPATH): ``python scripts/kernel_lab/gluon_prefill.py --sass`` prints loop lengths,
registers and spills. On the GPU: ``OUT=/tmp/lab [GLUON_HUMMING=.whl] [PREFILL_T="256 512"]
[PREFILL_TILES="BN,BK,BT0,BT1,STAGES,WARPS,LW[,A_SMEM[,CTAS[,LREGS]]] ..."]
[PREFILL_PP="BM,BK,STAGES[,ORDER[,PERSIST[,HALVES[,SK[,KS]]]]] ..."] [PREFILL_MIXED="96,32 ..."]
[PREFILL_AB="gluon_prefill_base ..."] python scripts/kernel_lab/gluon_prefill.py`` checks
every tile against the reference (cos_diff; fused SiLU-and-mul too for the ping-pong tile and
the mixed sizes) and times it against the shipped Triton tiles (and Humming), interleaved CUDA
graphs; ``PREFILL_AB`` names copies of ``kernels/gluon_prefill.py`` (other commits, patched
variants) whose ping-pong tiles run in the same process, so their ratios share one clock and
power state (across processes the same tile's time moved by 10%: session 20).
``--profile PROJ T TILE`` runs one lockstep tile (or the ping-pong one,
``pp:BM,BK,STAGES[,ORDER[,PERSIST[,HALVES[,SK]]]]``) and the Triton tiles for
``ncu_prefill.sh`` / ``ncu_source.sh``.

Patches for the ping-pong tile (``git apply``, then run as above): ``patches/ablate.patch``
(``GLUON_ABLATE`` bits: 1 dequantize once, 2 the loader copies nothing, 4 the consumers skip
dequantization and wgmmas, 8 / 16 / 32 no scale / word / X copies; timing only, the results
are wrong) and ``patches/scale_ring.patch`` (variant 33, not shipped), both against the tile
before its words went by TMA (they apply at commit 366640e; variant 35, the TMA words, shipped
in session 22, its A/B script was ``git show 366640e:scripts/kernel_lab/tma_run.sh``). Against
the tile of 4ef166e-48db319 (before its scales went by TMA, variant 41), for 64-row blocks and
plain GEMMs, variants 38-40 (lost; they apply at 48db319): ``patches/wide.patch`` (512 weight
rows), ``patches/quad.patch`` (four 64-row consumers), ``patches/blocked.patch``
(tile-contiguous words); each module docstring says how to run it.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from chordq.kernels.gluon_prefill import (ORDERED, PERSISTENT, _mma_layout, _mma_steps,
                                          _ring_barriers, _store, _x_ptrs, _x_ring,
                                          moe_gemm_indexed_gluon_prefill)
from chordq.kernels.gluon_w4a16 import (_cp_async, _dequant, _operand_layouts,
                                        compile_kernel_sm90)
from chordq.kernels.align import align_row_tiles
from chordq.kernels.triton_config import (GLUON_PREFILL_TILE, GLUON_PREFILL_TILES,
                                          GLUON_PREFILL_WIDE_TILES)
from chordq.kernels.triton_w4a16 import moe_gemm_mixed_triton


@gluon.jit
def _consumer(w_bufs, s_bufs, x0_bufs, x1_bufs, a_bufs, ready, empty, num_steps,
              BN: gl.constexpr, BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr,
              STAGES: gl.constexpr, A_SMEM: gl.constexpr, num_warps: gl.constexpr):
    """The K loop. wgmma reads its register A operand while in flight, and ptxas does not
    keep the next step's dequantization out of those registers (seen: wrong results with
    128 token rows and one group in flight). So either each step waits for its own wgmmas
    (A_SMEM=False; two consumer warpgroups overlap one's dequantization with the other's
    wgmmas), or A goes through a 2-slot shared ring (A_SMEM=True) and one step stays in
    flight."""
    if A_SMEM:
        acc0, acc1 = _a_smem_steps(w_bufs, s_bufs, x0_bufs, x1_bufs, a_bufs, ready, empty,
                                   num_steps, BN, BK, BT0, BT1, STAGES, num_warps)
    else:  # the shipped tile's loop (kernels/gluon_prefill.py)
        acc0, acc1 = _mma_steps(w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, 0, num_steps,
                                BN, BK, BT0, BT1, STAGES, num_warps, ready, -1,
                                False)  # a step's scales per slot, by cp.async
    return acc0, acc1


@gluon.jit
def _a_smem_steps(w_bufs, s_bufs, x0_bufs, x1_bufs, a_bufs, ready, empty, num_steps,
                  BN: gl.constexpr, BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr,
                  STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The K loop with A through a 2-slot shared ring: one step's wgmmas stay in flight."""
    w_l: gl.constexpr = _operand_layouts(BN, BK, num_warps)[0]
    s3_l: gl.constexpr = _operand_layouts(BN, BK, num_warps)[1]
    acc0 = gl.zeros([BN, BT0], gl.float32, _mma_layout(BT0, num_warps))
    if BT1 > 0:
        acc1 = gl.zeros([BN, BT1], gl.float32, _mma_layout(BT1, num_warps))
    gl.assume(num_steps > 0)  # no zero-trip path: ptxas keeps the wgmmas in flight (variant 14)
    for i in range(num_steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        w = w_bufs.index(slot).load(w_l)
        s = s_bufs.index(slot).load(gl.SliceLayout(2, s3_l))
        a_buf = a_bufs.index(i % 2)  # step i - 2's wgmmas, its last readers, are done
        a_buf.store(_dequant(w, s, s3_l, BN, BK))
        fence_async_shared()  # X (cp.async) and A (st.shared) are read by wgmma (async)
        acc0 = warpgroup_mma(a_buf, x0_bufs.index(slot).permute((1, 0)), acc0, is_async=True)
        if BT1 > 0:
            acc1 = warpgroup_mma(a_buf, x1_bufs.index(slot).permute((1, 0)), acc1,
                                 is_async=True)
            acc0, acc1 = warpgroup_mma_wait(2, deps=[acc0, acc1])
        else:
            acc0 = warpgroup_mma_wait(1, deps=[acc0])
        # step i - 1's wgmmas are done: its slot (words, scales, X) can be refilled
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    if BT1 > 0:
        acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
        return acc0, acc1
    else:
        acc0 = warpgroup_mma_wait(0, deps=[acc0])
        return acc0, acc0


@gluon.constexpr_function
def _words_smem_layout(BK):
    """The lockstep tiles' word slots (the ping-pong tile's are TMA's layout): ldmatrix-friendly
    rows of BK/8 words, 16-byte vectors swizzled over 128 bytes."""
    return gl.SwizzledSharedLayout(4, max(1, 256 // BK), min(8, BK // 32), [1, 0])


@gluon.jit
def _rows_ptrs(w_ptr, s_ptr, expert, n_g, N, K, ROWS: gl.constexpr, BK: gl.constexpr,
               GATED: gl.constexpr, LW: gl.constexpr):
    """Word and scale pointers of ROWS weight rows for the lockstep tiles (the ping-pong tile
    loads its words by TMA): rows ``n_g..`` (GATED: ROWS/2 gate rows ``n_g..`` and their up
    rows ``N + n_g..``)."""
    W: gl.constexpr = BK // 8
    G: gl.constexpr = BK // 32
    wtc: gl.constexpr = min(32, W // 4)
    wc_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // wtc, wtc], [LW, 1], [1, 0])
    sc_l: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [LW, 1], [1, 0])
    n_w = 2 * N if GATED else N
    base = expert.to(gl.int64) * n_w
    wr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, wc_l))
    sr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, sc_l))
    if GATED:
        wr = gl.where(wr < ROWS // 2, n_g + wr, N + n_g + wr - ROWS // 2)
        sr = gl.where(sr < ROWS // 2, n_g + sr, N + n_g + sr - ROWS // 2)
    else:
        wr = n_g + wr
        sr = n_g + sr
    w_ptrs = (w_ptr + (base + wr)[:, None] * ((K // BK) * W)
              + gl.arange(0, W, layout=gl.SliceLayout(0, wc_l))[None, :])
    s_ptrs = (s_ptr + (base + sr)[:, None] * ((K // BK) * G)
              + gl.arange(0, G, layout=gl.SliceLayout(0, sc_l))[None, :])
    return w_ptrs, s_ptrs


@gluon.jit
def _loader(w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, num_steps, x_ptr, w_ptr, s_ptr,
            sorted_ids_ptr, row0, expert, n0, N, K, num_routes, stride_xm,
            TOP_K: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, BT0: gl.constexpr,
            BT1: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr, LW: gl.constexpr):
    W: gl.constexpr = BK // 8  # words per row and step
    G: gl.constexpr = BK // 32  # scales per row and step
    w_ptrs, s_ptrs = _rows_ptrs(w_ptr, s_ptr, expert, n0, N, K, BN, BK, GATED, LW)
    x0_ptrs = _x_ptrs(x_ptr, sorted_ids_ptr, row0, num_routes, stride_xm, TOP_K, BT0, BK, LW)
    if BT1 > 0:
        x1_ptrs = _x_ptrs(x_ptr, sorted_ids_ptr, row0 + BT0, num_routes, stride_xm, TOP_K, BT1,
                          BK, LW)
    for i in range(num_steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        _cp_async(w_bufs.index(slot), w_ptrs + i * W)
        _cp_async(s_bufs.index(slot), s_ptrs + i * G)
        _cp_async(x0_bufs.index(slot), x0_ptrs + i * BK)
        if BT1 > 0:
            _cp_async(x1_bufs.index(slot), x1_ptrs + i * BK)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)


@gluon.jit
def w4a16_prefill_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, ntp_ptr,
                         N, K, num_routes, stride_xm, stride_om,
                         TOP_K: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                         BT0: gl.constexpr, BT1: gl.constexpr, GATED: gl.constexpr,
                         STAGES: gl.constexpr, LW: gl.constexpr, LREGS: gl.constexpr,
                         A_SMEM: gl.constexpr, num_warps: gl.constexpr):
    """One (``BT0 + BT1``-row block, column tile): ``C^T [BN, BT]`` over all of K."""
    BT: gl.constexpr = BT0 + BT1
    OUT_N: gl.constexpr = BN // 2 if GATED else BN
    pid_n = gl.program_id(0)
    pid_b = gl.program_id(1)
    expert = gl.load(expert_ids_ptr + pid_b)
    if (pid_b * BT < gl.load(ntp_ptr)) & (expert >= 0):
        w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8],
                                           _words_smem_layout(BK))
        s_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK // 32],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        x0_bufs, x1_bufs = _x_ring(STAGES, BT0, BT1, BK)
        if A_SMEM:
            a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
            a_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], a_sl)
        else:
            a_bufs = x0_bufs
        ready, empty = _ring_barriers(STAGES, 32 * LW, 1)
        n0 = pid_n * OUT_N
        row0 = pid_b * BT
        num_steps = K // BK
        acc0, acc1 = gl.warp_specialize([
            (_consumer, (w_bufs, s_bufs, x0_bufs, x1_bufs, a_bufs, ready, empty, num_steps,
                         BN, BK, BT0, BT1, STAGES, A_SMEM, num_warps)),
            (_loader, (w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, num_steps, x_ptr,
                       w_ptr, s_ptr, sorted_ids_ptr, row0, expert, n0, N, K, num_routes,
                       stride_xm, TOP_K, BN, BK, BT0, BT1, GATED, STAGES, LW)),
        ], [LW], [LREGS])
        _store(acc0, out_ptr, sorted_ids_ptr, row0, n0, num_routes, stride_om, BN, BT0, GATED,
               num_warps)
        if BT1 > 0:
            _store(acc1, out_ptr, sorted_ids_ptr, row0 + BT0, n0, num_routes, stride_om, BN,
                   BT1, GATED, num_warps)


def _maxnreg(num_warps: int, lw: int, ctas: int) -> int:
    """Registers per thread at launch for ``ctas`` CTAs per SM (warpgroups of 4 warps)."""
    warps = num_warps + 4 * -(-lw // 4)
    return min(256, 65536 // (ctas * warps * 32) // 8 * 8)


def prefill_gemm(x, w, s, sorted_ids, expert_ids, ntp, grid_m, top_k, out, *, bn, bk, bt0, bt1,
                 stages, warps, lw, a_smem=0, ctas=1, lregs=56, gated=False, num_routes=None):
    """Launch on fragment-order words and subnormal scales (the shipped weights)."""
    n_w, k = w.shape[1], x.shape[1]
    n = n_w // 2 if gated else n_w
    out_n = bn // 2 if gated else bn
    assert k % bk == 0 and n % out_n == 0 and x.stride(1) == 1
    w4a16_prefill_kernel[(n // out_n, grid_m)](
        x, w, s, out, sorted_ids, expert_ids, ntp, n, k,
        num_routes if num_routes is not None else out.shape[0], x.stride(0), out.stride(0),
        TOP_K=top_k, BN=bn, BK=bk, BT0=bt0, BT1=bt1, GATED=gated, STAGES=stages, LW=lw,
        LREGS=lregs, A_SMEM=bool(a_smem), num_warps=warps, maxnreg=_maxnreg(warps, lw, ctas))
    return out


def compile_sm90(bn, bk, bt0, bt1, stages, warps, lw, a_smem=0, ctas=1, lregs=56, gated=False,
                 top_k=8):
    return compile_kernel_sm90(w4a16_prefill_kernel, {
        "TOP_K": top_k, "BN": bn, "BK": bk, "BT0": bt0, "BT1": bt1, "GATED": gated,
        "STAGES": stages, "LW": lw, "LREGS": lregs, "A_SMEM": bool(a_smem), "num_warps": warps},
        maxnreg=_maxnreg(warps, lw, ctas))


def parse_tile(text: str) -> tuple[int, ...]:
    """``BN,BK,BT0,BT1,STAGES,WARPS,LW[,A_SMEM[,CTAS[,LREGS]]]``: LW loader warps with LREGS
    registers each, CTAS per SM (sets maxnreg)."""
    v = [int(x) for x in text.split(",")]
    return tuple(v + [0, 1, 56][len(v) - 7:])


def parse_pp(text: str) -> tuple[int, int, int, int, int, int, int, int]:
    """The ping-pong tile (kernels/gluon_prefill.py) as
    ``BM,BK,STAGES[,ORDER[,PERSIST[,HALVES[,SK[,KS]]]]]``: BM (96: 64 + 32 rows), ORDER 1
    where the consumers take turns issuing wgmmas, PERSIST 1 for one program per SM walking
    the tiles, 0 for one per tile, HALVES 2 for the wide form (512 weight rows a tile), SK 1
    for the stream-K schedule, KS the parts a step is issued in, 0 for ``k_split_of``'s
    (defaults: ``ORDERED``, ``PERSISTENT``, 1, 0, 0)."""
    v = [int(x) for x in text.split(",")]
    return tuple(v + [int(ORDERED), int(PERSISTENT), 1, 0, 0][len(v) - 3:])


# PREFILL_AB="gluon_prefill_base ...": copies of kernels/gluon_prefill.py (say, from another
# commit: git show C:kernels/gluon_prefill.py > kernels/gluon_prefill_base.py) timed in the
# same process as the shipped one, each ping-pong tile under the copy's name
PP_COPIES = [("pp", moe_gemm_indexed_gluon_prefill)] + [
    (m, importlib.import_module(f"chordq.kernels.{m}").moe_gemm_indexed_gluon_prefill)
    for m in os.environ.get("PREFILL_AB", "").split()]
# PREFILL_BLOCKED=1: the ping-pong tiles on row-blocked words (chordq.layout.row_blocks), as
# the bench and prepare_weights run them (copies named *c8k excepted: prefill_bounds.py)
BLOCKED = os.environ.get("PREFILL_BLOCKED") == "1"
PP_TILES = [parse_pp(t) for t in os.environ.get("PREFILL_PP", ",".join(
    str(v) for v in (GLUON_PREFILL_TILE.block_m, GLUON_PREFILL_TILE.block_k,
                     GLUON_PREFILL_TILE.num_stages))).split()]
PREFILL_TILES = [parse_tile(t) for t in os.environ.get(
    "PREFILL_TILES", "128,64,128,0,4,8,4 128,64,64,32,4,8,4 128,64,64,32,4,8,4,2 "
    "256,64,64,0,4,8,4 256,64,128,0,3,8,4 256,64,64,32,3,8,4 128,64,64,0,4,8,4,2").split()]


def sass_main() -> None:
    """Per tile: the consumer's and loader's K-loop lengths (per warp and step), ptxas's
    registers and any spill or wgmma serialization."""
    sys.path.insert(0, os.path.dirname(__file__))
    import sass

    gated = os.environ.get("GATED") == "1"
    for tile in PREFILL_TILES:
        try:
            kern = compile_sm90(*tile, gated=gated)
        except Exception as exc:
            print(tile, "FAILED:", (str(exc) or repr(exc)).strip().splitlines()[-1][:300])
            continue
        code = sass.sass_of(kern)
        loops = [b for b in sass.loops(code) if any("LDGSTS" in ln or "HGMMA" in ln for ln in b)]
        mma = min((len(b) for b in loops if any("HGMMA" in ln for ln in b)), default=0)
        load = min((len(b) for b in loops if any("LDGSTS" in ln for ln in b)), default=0)
        spills = code.count("STL") + code.count("LDL")
        print(tile, f"consumer loop {mma}, loader loop {load}, spills {spills};",
              "; ".join(sass.ptxas_verdict(kern)))


# PREFILL_MIXED="96,32 ...": row-tile sizes for align.moe_align_mixed (96: the Gluon tile)
MIXED = [tuple(int(v) for v in t.split(",")) for t in os.environ.get("PREFILL_MIXED", "").split()]
ROWS = ([("EP8", proj, t) for t in (256, 512, 1024, 2048, 8192) for proj in ("gate_up", "down")]
        + [("TP8", "gate_up", t) for t in (2048, 8192)])
# PREFILL_T entries "LAYOUT/T" off that list (say EP8/660: 110 rows an expert) add both GEMMs
ROWS += [(layout, proj, int(t)) for layout, t in (e.split("/") for e in os.environ.get(
    "PREFILL_T", "").split() if "/" in e) if not any(r[0] == layout and r[2] == int(t)
                                                     for r in ROWS) for proj in ("gate_up", "down")]


# PREFILL_SPLIT="64,6656 ...": block rows and the columns of a wide-form launch; a 256-row
# launch takes the rest (plain GEMMs): where neither grid alone fills its last round (EP8
# down T=256: 1344 256-row tiles are 10.18 rounds of 132 SMs, 672 wide ones 5.09; 624 wide
# and 96 256-row ones: 4.73 and 0.73), so fewer rounds between the two (variant 57's times)
SPLITS = [tuple(int(v) for v in t.split(",")) for t in os.environ.get("PREFILL_SPLIT",
                                                                       "").split()]


def _split_launch(c, out, a, nb, bm, wide_n, n_out):
    """The shipped wide and 256-row tiles (their block_n, block_k and slots) over the two
    column ranges, one launch each."""
    words, scales = c.extra if BLOCKED else (c.wf, c.sf)
    for lo, hi, tile in ((0, wide_n, GLUON_PREFILL_WIDE_TILES[bm]),
                         (wide_n, n_out, GLUON_PREFILL_TILES[bm])):
        moe_gemm_indexed_gluon_prefill(
            c.x, words, scales, *a, c.p.top_k, out, num_routes=c.rows, grid_m=nb, block_m=bm,
            block_n=tile.block_n, block_k=tile.block_k, num_stages=tile.num_stages,
            gated=False, blocked=BLOCKED, columns=(lo, hi))
    return out


def gpu_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contest

    def contestants(c, add):
        for bn, bk, bt0, bt1, stages, warps, lw, a_smem, ctas, lregs in PREFILL_TILES:
            if c.p.n % bn or c.p.k % bk:
                continue
            add(f"g {bn}x{bk} {bt0}+{bt1} s{stages} w{warps}+{lw}" + " A"[a_smem]
                + f" c{ctas} r{lregs}", bt0 + bt1,
                lambda out, a, nb, t=(bn, bk, bt0, bt1, stages, warps, lw, a_smem, ctas, lregs):
                prefill_gemm(c.x, c.wf, c.sf, *a, nb, c.p.top_k, out, bn=t[0], bk=t[1],
                             bt0=t[2], bt1=t[3], stages=t[4], warps=t[5], lw=t[6], a_smem=t[7],
                             ctas=t[8], lregs=t[9]))
        for bm, bk, stages, order, persist, halves, sk, ks in PP_TILES:  # the shipped tile
            for (name, launcher), gated in itertools.product(
                    PP_COPIES, (False, True) if c.proj == "gate_up" else (False,)):
                add(f"{name} {bm}x{bk} s{stages}" + " o" * order + " p" * persist
                    + " w" * (halves - 1) + " sk" * sk + f" ks{ks}" * bool(ks)
                    + (" fused" if gated else ""), bm,
                    lambda out, a, nb, t=(bm, bk, stages, order, persist, halves, sk, ks),
                    gated=gated,
                    launcher=launcher, blocked=BLOCKED and not name.endswith("c8k"): launcher(
                        c.x, *(c.extra if blocked else (c.wf, c.sf)), *a, c.p.top_k, out,
                        num_routes=c.rows, grid_m=nb, block_m=t[0],
                        block_n=(128 if gated else 256) * t[5], block_k=t[1],
                        num_stages=t[2], gated=gated, order=bool(t[3]),
                        persistent=bool(t[4]), blocked=blocked,
                        **({"stream_k": True} if t[6] else {}),
                        **({"k_split": t[7]} if t[7] else {})),
                    act="silu_mul" if gated else None)

        for bm, wide_n in SPLITS:  # wide tiles over columns [0, wide_n), 256-row over the rest
            n_out = c.p.n
            if n_out <= wide_n or wide_n % 512 or (n_out - wide_n) % 256:
                continue
            add(f"split {bm} wide<{wide_n}", bm,
                lambda out, a, nb, bm=bm, wide_n=wide_n, n_out=n_out: _split_launch(
                    c, out, a, nb, bm, wide_n, n_out))

        for sizes in MIXED:  # the shipped tiles' launches over moe_align_mixed pieces
            pieces = align_row_tiles(c.topk, sizes, c.p.num_experts)
            for gated in (False, True) if c.proj == "gate_up" else (False,):
                act = "silu_mul" if gated else None
                add("mixed " + "+".join(map(str, sizes)) + (" fused" if gated else ""),
                    sizes[0], lambda out, a, nb, pieces=pieces, act=act: moe_gemm_mixed_triton(
                        c.x, c.wf, c.sf, pieces, c.p.top_k, activation=act, out=out,
                        w_order="subnormal"), act=act)

    contest.run(ROWS, os.environ.get("PREFILL_T", ""),
                os.path.join(os.environ.get("OUT", "/tmp/lab"), "gluon_prefill.json"),
                contestants, extra_weights=contest.blocked_weights if BLOCKED else None)


def profile_main(proj: str, tokens: int, tile: str) -> None:
    """Four launches of one Gluon tile, then four of the shipped Triton tiles (EP8), for
    ``ncu --kernel-name`` to pick one of each (``scripts/kernel_lab/ncu_prefill.sh``)."""
    from chordq.kernels.align import moe_align_block_size
    from chordq.kernels.bench_humming import LAYOUTS, convert_weights, make_weights
    from chordq.kernels.triton_config import choose_row_tiles

    pp = tile.startswith("pp:")
    t = parse_pp(tile[3:]) if pp else parse_tile(tile)
    p = next(q for q in LAYOUTS["EP8"] if q.proj == proj)
    wf, sf = convert_weights(*make_weights(p, 0, "cuda"), "subnormal")
    gen = torch.Generator(device="cuda").manual_seed(0)
    topk = torch.rand(tokens, p.num_experts, generator=gen, device="cuda").topk(8, -1).indices
    topk = topk.to(torch.int32)
    x = torch.randn(p.input_rows(tokens), p.k, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty(8 * tokens, p.n, dtype=torch.bfloat16, device="cuda")
    block = t[0] if pp else t[2] + t[3]
    a = moe_align_block_size(topk, block, p.num_experts)
    for _ in range(4):
        if pp:
            moe_gemm_indexed_gluon_prefill(x, wf, sf, *a, p.top_k, out, num_routes=8 * tokens,
                                           grid_m=int(a[2][0]) // block, block_m=t[0],
                                           block_n=256 * t[5], block_k=t[1],
                                           num_stages=t[2], gated=False, order=bool(t[3]),
                                           persistent=bool(t[4]))
            continue
        prefill_gemm(x, wf, sf, a[0], a[1], a[2], int(a[2][0]) // block, p.top_k, out,
                     bn=t[0], bk=t[1], bt0=t[2], bt1=t[3], stages=t[4], warps=t[5], lw=t[6],
                     a_smem=t[7], ctas=t[8], lregs=t[9])
    pieces = align_row_tiles(topk, choose_row_tiles(8 * tokens / p.num_experts, p.n, p.k),
                             p.num_experts)
    for _ in range(4):
        moe_gemm_mixed_triton(x, wf, sf, pieces, p.top_k, out=out, w_order="subnormal")
    torch.cuda.synchronize()


if __name__ == "__main__" and "--profile" in sys.argv:
    profile_main(*sys.argv[2:3], int(sys.argv[3]), sys.argv[4])
elif __name__ == "__main__" and "--sass" not in sys.argv:
    gpu_main()
if __name__ == "__main__" and "--sass" in sys.argv:
    sass_main()
