"""The W4A16 prefill tile in Gluon (128-, 96- or 64-row blocks): warp-specialized, ping-pong
warpgroups, on wgmma.

``out[r, n] = sum_k x[row(r), k] * W_e[n, k]`` for the indexed routing of ``triton_w4a16``
(``moe_align_block_size(.., 96)`` blocks, or 64), on the shipped weights (fragment-order words,
``chordq.layout.subnormal_scales``), dequantized by the subnormal PTX of the Triton kernels,
with ``activation="silu_mul"`` fused as there (gate and up rounded to BF16 first).

Why (docs/kernel_notes.md, variant 27): ``tl.dot``'s row tiles are powers of two, so 85 rows
per expert (EP8 T=512) pad to 128; here a block is a 64-row and a 32-row accumulator fed by
the same dequantized registers (two wgmmas per step), 96 rows. And Triton 3.6 does not
warp-specialize this loop; Gluon states the partitions:

- the *loader* (the default partition, 4 warps, few registers) fills a shared ring (4 slots
  at 96 rows, 5 at 64, 3 at 128) with each 128-deep K step: the words by TMA (one box per
  consumer, on the slot's ``ready`` mbarrier with the step's byte count), the scales by TMA
  too, every other step for two steps (a step's 8 bytes a row are under TMA's 16-byte box
  minimum; the consumers keep the second step's in registers), and the gathered X rows by
  16-byte ``cp.async`` (``cp.async.mbarrier.arrive.noinc``: one arrival per loader thread, when its
  copies land).
  TMA frees the loader's registers for the consumers (``CONSUMER_REGS``; kernel_notes
  variant 35) and spares the scales' 8-byte copies, a cache line per row (variant 41);
- two *consumer* warpgroups (worker partitions of 4 warps) each own 128 weight rows of the
  256-row tile (with ``silu_mul``: 64 gate rows and their 64 up rows): wait on ``ready``,
  read words and scales (``ldmatrix``), dequantize straight into wgmma's register A operand
  (a word is one lane's A fragment for two k16 slices), issue the wgmmas with X from shared
  memory, retire them, free the slot on its ``empty`` mbarrier (count 2), and at the end
  store their own rows. They share nothing but the ring, and take turns issuing a step's
  wgmmas (two ``turn`` mbarriers), so one dequantizes while the other's wgmmas run
  (ping-pong). Without the turns both issued at once and their wgmmas shared the tensor
  cores, so both then dequantized at once too.

The launch is persistent (``PERSISTENT``): one program per SM walks the tiles ``t = program,
program + programs, ..`` (tile ``t``: row block ``t // grid_n``, weight-row tile ``t %
grid_n``, the order a one-tile-per-program grid would run them in), all three partitions in
the same order; the ring's slots and phases and the turns run on across tiles, so the loader
fills the next tile's first slots while the consumers finish and store the last one (with
one program per tile, each tile's first fill and last stores overlapped nothing: EP8 down has
16 K steps a tile).

The *wide* form (``halves=2``, 64-row blocks, ``triton_config.GLUON_PREFILL_TILE_64_WIDE``):
each consumer owns two 128-row halves (with ``silu_mul`` 128 gate rows and their 128 up rows),
512 weight rows a tile, so a slot's gathered X rows serve twice the weight rows; each half is a
turn and retires its wgmmas before the next; 3 ring slots (56 KB each). At 43 rows an expert
X is 22% of the copies (kernel_notes variant 52): the wide form took 0.92-0.94 of the 256-row
form's time on EP8 and TP8 gate_up (variant 55), where its half as many tiles take as few
rounds (``triton_config.choose_gluon_prefill_wide``).

The *128-row* form (``triton_config.GLUON_PREFILL_TILE_128``, variant 58): one 128-row
accumulator a consumer (128 registers), so a step's register A is dequantized and issued in
two 64-deep parts (``k_split_of``; a part a turn, each part's wgmmas retired before the next
part's dequantization), 3 ring slots. One N = 128 wgmma where 96 rows take an N = 64 and an
N = 32 one, and each dequantized weight serves a third more rows: 0.91-0.96 of the 96-row
tile's time where the padding is equal (EP8 T=2048 and 8192), so
``triton_config.gluon_prefill_rows`` takes it where 128-row blocks pad no more rows.

``stream_k`` (variant 56): the persistent programs share a last round under 80% full and the
round before it by K step pairs (``_schedule``); a tile cut in two is handed over in FP32
(variant 62, ``_consume_piece``): the piece with its last steps, the first its program shares,
stores its sums and raises a flag; the piece with its first steps, its program's last, waits
for the flag (it is nearly always up), adds the sums and stores the tile. Adding both pieces'
sums by atomics, the second to arrive reading them back, cost 5 and 12 µs a piece on the H100,
about a round of tiles (``scripts/kernel_lab/prefill_timeline.py``); the handover costs 3.
``stream_k=2`` (variant 64, ``triton_config.GLUON_PREFILL_STREAM_K_WALK32_ROWS``): the same
schedule walked in 32 bits where it fits (``walk_fits_32_bits``).

Each step retires its own wgmmas before the next step's dequantization: wgmma reads its
register operand while in flight, and ptxas reuses those registers for the next step's
values (seen on the H200: wrong results with 128 token rows and one wgmma group left in
flight, ``scripts/kernel_lab/gluon_prefill.py``).

Measured on the H200 against the shipped Triton tiles and Humming 0.1.19, same process
(``scripts/kernel_lab/gluon_prefill.py``, session 18): of the Triton tiles' time, EP8 T=512
gate_up 0.85 and down 0.84, T=1024 0.82 / 0.93, T=2048 0.97 / 0.89, T=8192 0.94 / 0.87, TP8
gate_up T=8192 0.80; it loses at 43 rows per expert (T=256). Persistent against one program
per tile (session 19, same process): EP8 down 0.89-0.94, gate_up 0.94-1.00, TP8 gate_up
T=8192 0.96. Where it runs: ``triton_config.gluon_prefill_applies`` (96 rows) and, at 33-64
rows per expert, ``gluon_prefill_64_applies`` (one 64-row accumulator: with the words by TMA,
0.88-0.97 of the Triton 64-row tile's time for plain GEMMs, session 22; with the scales by
TMA, fused SiLU-and-mul too, at 0.90 of the Triton fused tile's, session 23).

GPU only (no interpreter); ``gluon_w4a16.gluon_ready`` says whether it can run. Built by
Triton 3.6 (the H200's) a step's 32 wgmmas issue as one group; Triton 3.9's build (ptxas
C7511, "insufficient register resources") serializes them, correct but slower, not measured.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_w4a16 import (
    _barrier,
    _cp_async,
    _dequant,
    _operand_layouts,
    _stream_k_shared,
    compile_kernel_sm90,
)
from .triton_config import GLUON_PREFILL_TILE, GLUON_PREFILL_TILE_64_WIDE, GLUON_PREFILL_TILE_128
from .triton_w4a16 import _num_sms, _stream_k_buffers, stream_k_shared

__all__ = ["compile_sm90", "halves_of", "moe_gemm_indexed_gluon_prefill", "split_rows",
           "stream_k_pieces", "walk_fits_32_bits"]

WGR = gl.constexpr(128)  # weight rows per consumer warpgroup
# Registers per consumer thread by block rows; the loader gets the rest of 168 x 12 warps (40).
# With the words by TMA, 224 against 216 at 96 rows (session 22): 0.93-1.00 of the time on 25
# of 30 rows (with cp.async words 224 starved the loader: 1.03-1.16). With the scales by TMA
# too the loader holds only X pointers, and 232 against 224 (96 rows) or 216 (64), H200, same
# process (session 23, one run): EP8 gate_up T=2048 0.96, down 0.96, T=512 1.00-1.01; 64 rows
# gate_up 0.98, down 1.00, TP8 gate_up T=2048 0.98. 240 spills the loader (CPU sm_90 build).
# 32 (the lab's, variant 60, not yet run): as at 64 rows, no spills in the sm_90 build.
CONSUMER_REGS = {128: 224, 96: 232, 64: 232, 32: 232}
# The consumers take turns issuing their wgmmas (_mma_steps' ME). Turns and 4 ring slots
# against neither (3 slots), H200, same process (scripts/kernel_lab/gluon_prefill.py, session
# 18): 0.88-0.99 of the time on EP8 T=256-8192 and TP8 gate_up T=8192, but EP8 down T=512 and
# 1024 (1.00-1.02); 4 slots alone 0.92-1.05, turns alone (3 slots) 0.92-1.03.
ORDERED = True
# One program per SM walks its share of the tiles (module docstring); False: one program per
# tile. H200, same process (session 19): EP8 down T=512-8192 0.89-0.94 of the time per tile,
# gate_up 0.94-1.00 (T=512: 1.00), TP8 gate_up T=8192 0.96.
PERSISTENT = True
# Ring slots of the wide form (two 128-row halves a consumer, 512 weight rows a tile, 64-row
# blocks): 56 KB a slot at 128-deep steps, so 3 (205 KB); 4 (262 KB) exceed an SM's 227 KB.
WIDE_STAGES = GLUON_PREFILL_TILE_64_WIDE.num_stages
# Ring slots of the 128-row form: 52 KB a slot, and its store's 128 x 128 FP32 layout conversion
# takes 32 KB of scratch beside the ring, so 3 (a fourth exceeds an SM's 227 KB).
ROWS128_STAGES = GLUON_PREFILL_TILE_128.num_stages


def split_rows(block_m: int) -> tuple[int, int]:
    """A block's token rows as two power-of-two accumulators: 96 -> (64, 32), 128 -> (128, 0)."""
    first = 1 << (block_m.bit_length() - 1)
    second = block_m - first
    if second & (second - 1) or block_m % 16:
        raise ValueError(f"block_m must be a power of two or the sum of two, >= 16 and a "
                         f"multiple of 16, got {block_m}")
    return first, second


@gluon.constexpr_function
def _mma_layout(BT, num_warps):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, BT, 16])


# Triton 3.6 (the H200's) names it async_copy_global_to_shared, 3.9 async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.constexpr_function
def _words_box(BK, GATED):
    """The TMA box of a consumer's words for one step: its rows (GATED: the gate half or the
    up half, one box each) x BK/8 words, and the shared layout TMA writes it in."""
    rows = WGR.value // 2 if GATED else WGR.value
    return [rows, BK // 8], gl.NVMMASharedLayout.get_default_for([rows, BK // 8], gl.int32)


@gluon.constexpr_function
def _scales_box(BK, GATED):
    """The TMA box of a consumer's scales for two steps (TMA's boxes are at least 16 bytes
    wide, a step's scales 8): its rows (GATED: a half) x 2 BK/32 groups, and its layout."""
    rows = WGR.value // 2 if GATED else WGR.value
    return [rows, BK // 16], gl.NVMMASharedLayout.get_default_for([rows, BK // 16], gl.bfloat16)


@gluon.jit
def _tma_at(desc, row, col, bar, dst, BLOCKED: gl.constexpr, KB, INNER: gl.constexpr):
    """Rows ``row..`` (within one 128-row block), columns ``col..`` of the weights into ``dst``
    by TMA. BLOCKED (``chordq.layout.row_blocks``, the descriptor over ``[pieces x 128, INNER]``
    rows: 32 words or 8 scales): piece ``(row // 128) KB + col // INNER`` of the ``KB = K/256``
    pieces a row block, its row ``row % 128``, column ``col % INNER``."""
    if BLOCKED:
        _tma_load(desc, [((row // 128) * KB + col // INNER) * 128 + row % 128, col % INNER],
                  bar, dst)
    else:
        _tma_load(desc, [row, col], bar, dst)


@gluon.jit
def _tma_rows(desc, row0, n_g, N, col, bar, dst, GATED: gl.constexpr, BLOCKED: gl.constexpr,
              KB, INNER: gl.constexpr):
    """A consumer's rows ``n_g..`` of expert rows ``row0..`` (GATED: WGR/2 gate rows ``n_g..``
    and their up rows ``N + n_g..``), columns ``col..``, into ``dst`` by TMA: a step's words,
    or two steps' scales."""
    if GATED:
        half: gl.constexpr = WGR // 2
        _tma_at(desc, row0 + n_g, col, bar, dst.slice(0, half), BLOCKED, KB, INNER)
        _tma_at(desc, row0 + N + n_g, col, bar, dst.slice(half, half), BLOCKED, KB, INNER)
    else:
        _tma_at(desc, row0 + n_g, col, bar, dst, BLOCKED, KB, INNER)


@gluon.jit
def _x_ring(STAGES: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr, BK: gl.constexpr):
    """The X slots of the ring: ``[STAGES, BT0, BK]`` (and ``[STAGES, BT1, BK]``), as wgmma
    reads them."""
    x0_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT0, BK], gl.bfloat16)
    x0_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT0, BK], x0_sl)
    if BT1 > 0:
        x1_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT1, BK], gl.bfloat16)
        x1_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT1, BK], x1_sl)
    else:
        x1_bufs = x0_bufs
    return x0_bufs, x1_bufs


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, READY: gl.constexpr, EMPTY: gl.constexpr):
    """Per slot, ``ready`` (READY arrivals: one per loader thread) and ``empty`` (EMPTY: one
    per consumer partition)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=EMPTY)
    return ready, empty


@gluon.jit
def _x_ptrs(x_ptr, sorted_ids_ptr, row0, num_routes, stride_xm, TOP_K: gl.constexpr,
            BT: gl.constexpr, BK: gl.constexpr, LW: gl.constexpr):
    """Pointers of one step's X rows ``[BT, BK]``, 16 bytes per thread and register."""
    tpc: gl.constexpr = min(32, BK // 8)
    xc_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpc, tpc], [LW, 1], [1, 0])
    xr = gl.arange(0, BT, layout=gl.SliceLayout(1, xc_l))
    xc = gl.arange(0, BK, layout=gl.SliceLayout(0, xc_l))
    routes = gl.load(sorted_ids_ptr + row0 + xr)
    routes = gl.where(routes < num_routes, routes, 0)  # sentinels read row 0, not stored
    return x_ptr + (routes // TOP_K).to(gl.int64)[:, None] * stride_xm + xc[None, :]


@gluon.jit
def _tile_count(ntp_ptr, grid_n, grid_m, BT: gl.constexpr):
    """Tiles of this launch: ``grid_n`` weight-row tiles for each of the row blocks that hold
    routes (``moe_align_block_size``'s padded count), at most ``grid_m`` of them."""
    return gl.minimum(gl.cdiv(gl.load(ntp_ptr), BT), grid_m) * grid_n


@gluon.jit
def _schedule(tiles, SK: gl.constexpr):
    """``(programs, whole, shared)``: the programs that work, the tiles they take whole
    (``t = program, program + programs, ..``) and, after them, the tiles they share by K steps
    (SK, stream-K: a last round under 80% full and the full round before it, laid end to end
    and cut into one equal range of step pairs a program, ``triton_w4a16``'s schedule)."""
    if SK:
        programs = gl.maximum(gl.minimum(gl.num_programs(0), tiles), 1)
        shared = _stream_k_shared(tiles, programs)
    else:
        programs = gl.num_programs(0)
        shared = 0
    return programs, tiles - shared, shared


@gluon.jit
def _sk_range(programs, shared, num_steps, SK: gl.constexpr):
    """This program's range of the shared tiles' step pairs, ``[it, end)`` (empty past
    ``programs``; ``_schedule``). ``SK`` 2 (variant 64): in 32 bits, where the host has
    bounded ``programs x total`` under 2^31 (``walk_fits_32_bits``): each piece's two 64-bit
    divisions are 312-360 SASS instructions of a build, 0.1-0.2 µs a piece in variant 62's
    timeline."""
    pid = gl.program_id(0)
    if SK == 2:
        total = shared * (num_steps // 2)
    else:
        total = shared.to(gl.int64) * (num_steps // 2)
    it = pid * total // programs
    end = gl.where(pid < programs, (pid + 1) * total // programs, it)
    return it, end


@gluon.jit
def _sk_piece(j, mine, it, end, whole, programs, num_steps, SK: gl.constexpr):
    """Stream-K: this program's next piece, ``(tile, first step, steps, whole?)``: its
    ``j``-th whole tile while ``j < mine``, then the shared tiles' steps from pair ``it`` (up
    to ``end``, within one tile). One loop walks both (one copy of the consumer's K loop)."""
    pairs = num_steps // 2
    if SK == 2:  # _sk_range's 32-bit walk
        tile = whole + it // pairs
        first = it - (tile - whole) * pairs
        num = gl.minimum(pairs - first, end - it)
    else:
        tile = whole + (it // pairs).to(gl.int32)
        first = (it - (tile - whole).to(gl.int64) * pairs).to(gl.int32)
        num = gl.minimum(pairs - first, (end - it).to(gl.int32))
    own = j < mine
    return (gl.where(own, gl.program_id(0) + j * programs, tile), gl.where(own, 0, 2 * first),
            gl.where(own, num_steps, 2 * num), own)


def walk_fits_32_bits(programs: int, num_steps: int) -> bool:
    """Whether ``_sk_range``'s 32-bit walk (``SK`` 2) stays under 2^31: ``(pid + 1) x total``
    with ``pid < programs`` and ``total`` under two rounds of tiles' step pairs. A Kimi
    launch (132 programs, 28 pairs) is 2^20."""
    return 2 * programs * programs * (num_steps // 2) < 2**31


def stream_k_pieces(tiles: int, programs: int, num_steps: int) -> list[list[tuple[int, int,
                                                                              int]]]:
    """The stream-K schedule on the host (``_each_piece``'s walk: ``_schedule``, ``_sk_range``,
    ``_whole_count``, ``_sk_piece``; the kernel's twin for tests): for each launched program,
    its pieces ``(tile, first step, steps)`` in the order it walks them."""
    working = max(min(programs, tiles), 1)
    shared = stream_k_shared(tiles, working)
    whole, pairs = tiles - shared, num_steps // 2
    total = shared * pairs
    out = []
    for pid in range(programs):
        pieces = [(t, 0, num_steps) for t in range(pid, whole, working)]
        it = pid * total // working
        end = (pid + 1) * total // working if pid < working else it
        while it < end:
            tile = whole + it // pairs
            first = it - (tile - whole) * pairs
            num = min(pairs - first, end - it)
            pieces.append((tile, 2 * first, 2 * num))
            it += num
        out.append(pieces)
    return out


@gluon.jit
def _whole_count(whole, programs):
    """Whole tiles of this program: ``t = program, program + programs, .. < whole``."""
    return gl.maximum(whole - gl.program_id(0) + programs - 1, 0) // programs


@gluon.jit
def _each_piece(piece: gl.constexpr, args, ntp_ptr, grid_n, grid_m, num_steps,
                BT: gl.constexpr, SK: gl.constexpr):
    """Runs ``g = piece(t, first, num, g, *args)`` for each piece of this program in turn
    (``_schedule``; ``g`` the ring position, from 0): the one walk that the loader and both
    consumers take, so their ring positions and phases agree."""
    pid = gl.program_id(0)
    programs, whole, shared = _schedule(_tile_count(ntp_ptr, grid_n, grid_m, BT), SK)
    g = 0
    if SK:
        it, end = _sk_range(programs, shared, num_steps, SK)
        mine = _whole_count(whole, programs)
        j = 0
        while (j < mine) | (it < end):
            t, first, num, own = _sk_piece(j, mine, it, end, whole, programs, num_steps, SK)
            g = piece(t, first, num, g, *args)
            j += own.to(gl.int32)
            it += gl.where(own, 0, num // 2)
    else:
        for t in range(pid, whole, programs):
            g = piece(t, 0, num_steps, g, *args)


@gluon.jit
def _load_piece(t, first, num, g, w0_bufs, w1_bufs, s0_bufs, s1_bufs, x0_bufs, x1_bufs, ready,
                empty, x_ptr, w_desc, s_desc, sorted_ids_ptr, expert_ids_ptr, grid_n, kb, apart,
                OUT_W: gl.constexpr, N, num_routes, stride_xm, TOP_K: gl.constexpr,
                BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr, GATED: gl.constexpr,
                STAGES: gl.constexpr, BLOCKED: gl.constexpr, HALVES: gl.constexpr,
                num_warps: gl.constexpr):
    """Steps ``first .. first + num`` (``first`` even) of tile ``t`` into the ring from
    position ``g``; returns the position after them."""
    SPLIT: gl.constexpr = GATED and HALVES == 1
    BT: gl.constexpr = BT0 + BT1
    expert = gl.load(expert_ids_ptr + t // grid_n)
    if expert >= 0:
        n0 = (t % grid_n) * (2 * OUT_W)
        row0 = (t // grid_n) * BT
        w_row0 = expert * (2 * N if GATED else N)
        x0_ptrs = _x_ptrs(x_ptr, sorted_ids_ptr, row0, num_routes, stride_xm, TOP_K, BT0,
                          BK, num_warps)
        if BT1 > 0:
            x1_ptrs = _x_ptrs(x_ptr, sorted_ids_ptr, row0 + BT0, num_routes, stride_xm,
                              TOP_K, BT1, BK, num_warps)
        for i in range(first, first + num):
            slot = g % STAGES
            mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)  # both are done
            # words (every step) and scales (every other step, for two) by TMA, the
            # expect being the slot's one arrival besides the loader threads'; the
            # gathered X rows by cp.async
            if i % 2 == 0:
                mbarrier.expect(ready.index(slot), 2 * HALVES * WGR * (BK // 2 + BK // 8))
                for h in gl.static_range(HALVES):
                    _tma_rows(s_desc, w_row0, n0 + h * apart, N, i * (BK // 32),
                              ready.index(slot), s0_bufs.index(slot).slice(h * WGR, WGR),
                              SPLIT, BLOCKED, kb, 8)
                    _tma_rows(s_desc, w_row0, n0 + OUT_W + h * apart, N, i * (BK // 32),
                              ready.index(slot), s1_bufs.index(slot).slice(h * WGR, WGR),
                              SPLIT, BLOCKED, kb, 8)
            else:
                mbarrier.expect(ready.index(slot), 2 * HALVES * WGR * (BK // 2))
            for h in gl.static_range(HALVES):
                _tma_rows(w_desc, w_row0, n0 + h * apart, N, i * (BK // 8), ready.index(slot),
                          w0_bufs.index(slot).slice(h * WGR, WGR), SPLIT, BLOCKED, kb, 32)
                _tma_rows(w_desc, w_row0, n0 + OUT_W + h * apart, N, i * (BK // 8),
                          ready.index(slot), w1_bufs.index(slot).slice(h * WGR, WGR), SPLIT,
                          BLOCKED, kb, 32)
            _cp_async(x0_bufs.index(slot), x0_ptrs + i * BK)
            if BT1 > 0:
                _cp_async(x1_bufs.index(slot), x1_ptrs + i * BK)
            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
            g += 1
    return g


@gluon.jit
def _loader(w0_bufs, w1_bufs, s0_bufs, s1_bufs, x0_bufs, x1_bufs, ready, empty, num_steps,
            x_ptr, w_desc, s_desc, sorted_ids_ptr, expert_ids_ptr, ntp_ptr, grid_n, grid_m,
            OUT_W: gl.constexpr, N, num_routes, stride_xm, TOP_K: gl.constexpr,
            BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr, GATED: gl.constexpr,
            STAGES: gl.constexpr, BLOCKED: gl.constexpr, HALVES: gl.constexpr,
            SK: gl.constexpr, num_warps: gl.constexpr):
    """Fills the ring for every piece of this program in turn (``_schedule``), so the next
    tile's first slots fill while the consumers finish and store the last one. A consumer's
    rows come as HALVES boxes of WGR rows: the wide form's (HALVES 2) 128 rows apart, or with
    GATED 128 gate rows and their 128 up rows, N apart; the 256-row form's (HALVES 1) with
    GATED as 64 gate rows and their up rows (``_tma_rows``, SPLIT)."""
    if GATED and HALVES == 2:
        apart = N
    else:
        apart: gl.constexpr = OUT_W // HALVES
    kb = num_steps * BK // 256  # row-block pieces a row (BLOCKED)
    _each_piece(_load_piece, (w0_bufs, w1_bufs, s0_bufs, s1_bufs, x0_bufs, x1_bufs, ready, empty,
                              x_ptr, w_desc, s_desc, sorted_ids_ptr, expert_ids_ptr, grid_n, kb,
                              apart, OUT_W, N, num_routes, stride_xm, TOP_K, BK, BT0, BT1, GATED,
                              STAGES, BLOCKED, HALVES, num_warps),
                ntp_ptr, grid_n, grid_m, num_steps, BT0 + BT1, SK)


@gluon.jit
def _k_part(w, s, q: gl.constexpr, ROWS: gl.constexpr, BK: gl.constexpr,
            num_warps: gl.constexpr):
    """Part ``q`` (0 or 1) of a step's words ``[ROWS, BK/8]`` and scales ``[ROWS, BK/32]``
    held in registers: K ``q BK/2 ..``, in ``_operand_layouts(ROWS, BK/2)`` (the highest
    column bit of each is a register bit, so nothing moves)."""
    wh_l: gl.constexpr = _operand_layouts(ROWS, BK // 2, num_warps)[0]
    sh_l: gl.constexpr = gl.SliceLayout(2, _operand_layouts(ROWS, BK // 2, num_warps)[1])
    w0, w1 = gl.split(gl.permute(gl.reshape(w, [ROWS, 2, BK // 16]), [0, 2, 1]))
    s0, s1 = gl.split(gl.permute(gl.reshape(s, [ROWS, 2, BK // 64]), [0, 2, 1]))
    if q == 0:
        return (gl.convert_layout(w0, wh_l, assert_trivial=True),
                gl.convert_layout(s0, sh_l, assert_trivial=True))
    else:
        return (gl.convert_layout(w1, wh_l, assert_trivial=True),
                gl.convert_layout(s1, sh_l, assert_trivial=True))


@gluon.jit
def _x_part(x_bufs, slot, q: gl.constexpr, BK: gl.constexpr, KSPLIT: gl.constexpr):
    """A slot's X rows ``[BT, BK]`` (KSPLIT 2: part ``q``'s ``[BT, BK/2]``) as wgmma's B."""
    x = x_bufs.index(slot)
    if KSPLIT == 2:
        x = x.slice(q * (BK // 2), BK // 2, dim=1)
    return x.permute((1, 0))


@gluon.jit
def _mma_steps(w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, g0, num_steps,
               ROWS: gl.constexpr, BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr,
               STAGES: gl.constexpr, num_warps: gl.constexpr, turn, ME: gl.constexpr,
               PAIRS: gl.constexpr = True, HALVES: gl.constexpr = 1, KSPLIT: gl.constexpr = 1):
    """A consumer's K loop over ROWS weight rows: ``[ROWS, BT0]`` and ``[ROWS, BT1]``
    accumulators; each step retires its own wgmmas (module docstring) and frees its slot.
    ``g0``: the ring position of the first step (steps this program consumed before).

    ``ME`` 0 or 1 (two consumers): the consumers take turns issuing a step's wgmmas
    (``turn``: two mbarriers, each consumer arrives on the other's after issuing), so one's
    dequantization overlaps the other's wgmmas instead of both issuing at once; -1: no turns.
    ``PAIRS``: an even step's slot holds its own and the next step's scales (``_loader``),
    else (the kernel lab's tiles) each slot its own step's.
    ``HALVES`` 2 (``BT1 == 0``): the consumer owns 2 ROWS weight rows, a slot's two ROWS-row
    halves, a ``[ROWS, BT0]`` accumulator each (returned in that order); each half is a turn
    and retires its wgmmas before the next half is dequantized; the slot is freed after both.
    ``KSPLIT`` 2: each (half's) step is dequantized and issued in two BK/2-deep parts, a turn
    each, the first part's wgmmas retired before the second part is dequantized, so a 128-row
    accumulator (128 registers) leaves room for a part's register A (32)."""
    w_l: gl.constexpr = _operand_layouts(ROWS, BK, num_warps)[0]
    s3_l: gl.constexpr = _operand_layouts(ROWS, BK, num_warps)[1]
    mma0: gl.constexpr = _mma_layout(BT0, num_warps)
    a0_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma0, k_width=2)
    acc0 = gl.zeros([ROWS, BT0], gl.float32, mma0)
    if BT1 > 0:
        mma1: gl.constexpr = _mma_layout(BT1, num_warps)
        a1_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma1, k_width=2)
        acc1 = gl.zeros([ROWS, BT1], gl.float32, mma1)
    if HALVES == 2:
        acc1 = gl.zeros([ROWS, BT0], gl.float32, mma0)
    s_l: gl.constexpr = gl.SliceLayout(2, s3_l)
    sh3_l: gl.constexpr = _operand_layouts(ROWS, BK // 2, num_warps)[1]
    G: gl.constexpr = BK // 32
    s_next = gl.zeros([ROWS, G], gl.bfloat16, s_l)
    if HALVES == 2:
        s_next1 = gl.zeros([ROWS, G], gl.bfloat16, s_l)
    gl.assume(num_steps > 0)  # no zero-trip path: ptxas keeps the wgmmas of a step together
    for i in range(num_steps):
        g = g0 + i
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        for c in gl.static_range(HALVES):
            w = w_bufs.index(slot).slice(c * ROWS, ROWS).load(w_l)
            sb = s_bufs.index(slot).slice(c * ROWS, ROWS)
            if PAIRS:  # an even step's slot holds this step's and the next one's scales
                if i % 2 == 0:
                    s = sb.slice(0, G, dim=1).load(s_l)
                    if c == 0:
                        s_next = sb.slice(G, G, dim=1).load(s_l)
                    else:
                        s_next1 = sb.slice(G, G, dim=1).load(s_l)
                else:
                    if c == 0:
                        s = s_next
                    else:
                        s = s_next1
            else:
                s = sb.load(s_l)
            for q in gl.static_range(KSPLIT):
                if KSPLIT == 1:
                    a = _dequant(w, s, s3_l, ROWS, BK)
                else:
                    wq, sq = _k_part(w, s, q, ROWS, BK, num_warps)
                    a = _dequant(wq, sq, sh3_l, ROWS, BK // 2)
                if q == 0:  # X arrived by cp.async (generic proxy); wgmma reads it (async)
                    fence_async_shared()
                if ME >= 0:  # consumer 0 goes first: turn h waits for consumer 1's turn h - 1
                    turn_no = (HALVES * g + c) * KSPLIT + q
                    mbarrier.wait(turn.index(ME), (turn_no & 1) ^ (1 - ME))
                a0 = gl.convert_layout(a, a0_l, assert_trivial=True)
                if c == 0:
                    acc0 = warpgroup_mma(a0, _x_part(x0_bufs, slot, q, BK, KSPLIT), acc0,
                                         is_async=True)
                    if BT1 > 0:
                        a1 = gl.convert_layout(a, a1_l, assert_trivial=True)
                        acc1 = warpgroup_mma(a1, _x_part(x1_bufs, slot, q, BK, KSPLIT), acc1,
                                             is_async=True)
                else:
                    acc1 = warpgroup_mma(a0, _x_part(x0_bufs, slot, q, BK, KSPLIT), acc1,
                                         is_async=True)
                if ME >= 0:
                    mbarrier.arrive(turn.index(1 - ME))
                if c == 0 and BT1 > 0:
                    acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
                elif c == 0:
                    acc0 = warpgroup_mma_wait(0, deps=[acc0])
                else:
                    acc1 = warpgroup_mma_wait(0, deps=[acc1])
        mbarrier.arrive(empty.index(slot))
    if BT1 > 0 or HALVES == 2:
        return acc0, acc1
    else:
        return acc0, acc0


@gluon.jit
def _store(acc, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om, BN: gl.constexpr,
           BT: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr, ok=True):
    """``out[route, n_out + n] = acc[n, r]`` for ``acc [BN, BT]`` (SiLU(gate) * up with GATED:
    rows ``[0, BN/2)`` gate, ``[BN/2, BN)`` the matching up rows), 16-byte stores, where
    ``ok``."""
    OUT_N: gl.constexpr = BN // 2 if GATED else BN
    tn: gl.constexpr = min(32, OUT_N // 8)
    if GATED:
        e3: gl.constexpr = gl.BlockedLayout([2, 8, 1], [1, tn, 32 // tn], [1, 1, num_warps],
                                            [0, 1, 2])
        g = gl.convert_layout(gl.reshape(acc, [2, OUT_N, BT]), e3)
        gate, up = gl.split(gl.permute(g, [1, 2, 0]))
        res = _silu_mul(gate, up)
    else:
        e2: gl.constexpr = gl.BlockedLayout([8, 1], [tn, 32 // tn], [1, num_warps], [0, 1])
        res = gl.convert_layout(acc, e2)
    _store_rows(res, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om, OUT_N, BT, ok)


@gluon.jit
def _silu_mul(gate, up):
    """``SiLU(gate) * up`` in FP32, gate and up rounded to BF16 first (the reference's
    order: its GEMM writes BF16, then ``silu_and_mul``)."""
    g = gate.to(gl.bfloat16).to(gl.float32)
    u = up.to(gl.bfloat16).to(gl.float32)
    return g / (1.0 + gl.exp(-g)) * u


@gluon.jit
def _store_silu_mul(gate, up, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om,
                    BN: gl.constexpr, BT: gl.constexpr, num_warps: gl.constexpr, ok=True):
    """``out[route, n_out + n] = SiLU(gate[n, r]) * up[n, r]`` for the wide form's halves
    (``[BN, BT]`` each, the same layout), as ``_store``."""
    tn: gl.constexpr = min(32, BN // 8)
    e2: gl.constexpr = gl.BlockedLayout([8, 1], [tn, 32 // tn], [1, num_warps], [0, 1])
    res = gl.convert_layout(_silu_mul(gate, up), e2)
    _store_rows(res, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om, BN, BT, ok)


@gluon.jit
def _store_rows(res, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om,
                OUT_N: gl.constexpr, BT: gl.constexpr, ok):
    """``out[route, n_out + n] = res[n, r]`` (BF16) for the block's routed rows, where ``ok``
    (a stream-K piece stores only if it completes its tile)."""
    o_l: gl.constexpr = res.type.layout
    orow = gl.arange(0, OUT_N, layout=gl.SliceLayout(1, o_l))
    ocol = gl.arange(0, BT, layout=gl.SliceLayout(0, o_l))
    oroutes = gl.load(sorted_ids_ptr + row0 + ocol)
    o_ptrs = out_ptr + oroutes.to(gl.int64)[None, :] * stride_om + (n_out + orow)[:, None]
    gl.store(o_ptrs, res.to(gl.bfloat16), mask=(oroutes < num_routes)[None, :] & ok)


@gluon.jit
def _sk_parts(acc, part):
    """Pointers of a ``[R, C]`` accumulator's partial sums at ``part`` (row-major), in the
    accumulator's layout."""
    layout: gl.constexpr = acc.type.layout
    R: gl.constexpr = acc.type.shape[0]
    C: gl.constexpr = acc.type.shape[1]
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    return part + r[:, None] * C + c[None, :]


@gluon.jit
def _consume_piece(t, first, num, g, w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, turn,
                   num_steps, out_ptr, sorted_ids_ptr, expert_ids_ptr, parts_ptr, arrivals_ptr,
                   stride_p, grid_n, n_off, OUT_W: gl.constexpr, num_routes, stride_om,
                   BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr,
                   GATED: gl.constexpr, STAGES: gl.constexpr, ME: gl.constexpr,
                   HALVES: gl.constexpr, SK: gl.constexpr, KSPLIT: gl.constexpr):
    """Steps ``first .. first + num`` of tile ``t`` from ring position ``g``, then the stores
    (SK: a cut tile's two pieces hand over at the boundary's slot, one per consumer: the
    piece with the tile's last steps stores its sums in ``parts_ptr`` and raises the slot's
    flag, the piece with its first steps waits for the flag, adds them and stores the tile).
    Returns the ring position after them."""
    BT: gl.constexpr = BT0 + BT1
    TWO: gl.constexpr = BT1 > 0 or HALVES == 2  # a second accumulator
    if gl.load(expert_ids_ptr + t // grid_n) >= 0:
        acc0, acc1 = _mma_steps(w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, g,
                                num, WGR, BK, BT0, BT1, STAGES, 4, turn, ME, HALVES=HALVES,
                                KSPLIT=KSPLIT)
        g += num
        n_out = (t % grid_n) * (2 * OUT_W) + n_off
        row0 = (t // grid_n) * BT
        if SK:
            # A cut tile's last steps are the first piece their program takes after its
            # whole tiles, its first steps the last piece of the program before, so the
            # second nearly always runs later: it waits for the first's sums by a flag
            # (variant 62; adding both by atomics cost 5 and 12 µs a piece, on the tail)
            cut = num < num_steps
            if cut:
                pid = gl.program_id(0)
                slot = gl.where(first > 0, pid, pid + 1) * 2 + n_off // OUT_W  # consumer
                part = parts_ptr + slot.to(gl.int64) * stride_p
                if first > 0:
                    gl.store(_sk_parts(acc0, part), acc0)
                    if TWO:
                        gl.store(_sk_parts(acc1, part + WGR * BT0), acc1)
                    _barrier()  # every thread's sums are out before the flag
                    gl.atomic_xchg(arrivals_ptr + slot, 1, sem="release")
                else:
                    while gl.atomic_add(arrivals_ptr + slot, 0, sem="acquire") == 0:
                        pass
                    acc0 += gl.load(_sk_parts(acc0, part), cache_modifier=".cg")
                    if TWO:
                        acc1 += gl.load(_sk_parts(acc1, part + WGR * BT0), cache_modifier=".cg")
                    gl.atomic_xchg(arrivals_ptr + slot, 0, sem="relaxed")  # flags left zero
            ok = (not cut) | (first == 0)
        else:
            ok = True
        if HALVES == 2 and GATED:  # the halves are gate rows and their up rows
            _store_silu_mul(acc0, acc1, out_ptr, sorted_ids_ptr, row0, n_out, num_routes,
                            stride_om, WGR, BT0, 4, ok)
        else:
            _store(acc0, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om, WGR,
                   BT0, GATED, 4, ok)
        if BT1 > 0:
            _store(acc1, out_ptr, sorted_ids_ptr, row0 + BT0, n_out, num_routes, stride_om,
                   WGR, BT1, GATED, 4, ok)
        if HALVES == 2 and not GATED:
            _store(acc1, out_ptr, sorted_ids_ptr, row0, n_out + WGR, num_routes, stride_om,
                   WGR, BT0, GATED, 4, ok)
    return g


@gluon.jit
def _consumer(w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, turn, num_steps, out_ptr,
              sorted_ids_ptr, expert_ids_ptr, ntp_ptr, parts_ptr, arrivals_ptr, stride_p,
              grid_n, grid_m, n_off, OUT_W: gl.constexpr, num_routes, stride_om,
              BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr, GATED: gl.constexpr,
              STAGES: gl.constexpr, ME: gl.constexpr, HALVES: gl.constexpr,
              SK: gl.constexpr, KSPLIT: gl.constexpr):
    """One warpgroup's rows (output columns ``n_off..`` of each tile, OUT_W of them) for every
    piece of this program, in the loader's order (``_schedule``)."""
    _each_piece(_consume_piece, (w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, turn,
                                 num_steps, out_ptr, sorted_ids_ptr, expert_ids_ptr, parts_ptr,
                                 arrivals_ptr, stride_p, grid_n, n_off, OUT_W, num_routes,
                                 stride_om, BK, BT0, BT1, GATED, STAGES, ME, HALVES, SK, KSPLIT),
                ntp_ptr, grid_n, grid_m, num_steps, BT0 + BT1, SK)


@gluon.jit
def _w4a16_prefill_kernel(x_ptr, w_desc, s_desc, out_ptr, sorted_ids_ptr, expert_ids_ptr, ntp_ptr,
                          parts_ptr, arrivals_ptr, N, K, num_routes, stride_xm, stride_om,
                          stride_p, grid_n, grid_m, TOP_K: gl.constexpr, BK: gl.constexpr,
                          BT0: gl.constexpr, BT1: gl.constexpr, GATED: gl.constexpr,
                          STAGES: gl.constexpr, CREGS: gl.constexpr, ORDER: gl.constexpr,
                          BLOCKED: gl.constexpr, HALVES: gl.constexpr, SK: gl.constexpr,
                          KSPLIT: gl.constexpr, num_warps: gl.constexpr):
    """Tiles ``t = program, program + programs, ..``: (``BT0 + BT1``-row block ``t //
    grid_n``, ``HALVES x 256``-weight-row tile ``t % grid_n``), each over all of K."""
    # output columns per warpgroup
    OUT_W: gl.constexpr = HALVES * (WGR // 2 if GATED else WGR)
    w_sl: gl.constexpr = w_desc.layout
    s_sl: gl.constexpr = s_desc.layout
    w0_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, HALVES * WGR, BK // 8], w_sl)
    w1_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, HALVES * WGR, BK // 8], w_sl)
    s0_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HALVES * WGR, BK // 16], s_sl)
    s1_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HALVES * WGR, BK // 16], s_sl)
    x0_bufs, x1_bufs = _x_ring(STAGES, BT0, BT1, BK)
    ready, empty = _ring_barriers(STAGES, 32 * num_warps + 1, 2)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(2):
        mbarrier.init(turn.index(t), count=1)
    num_steps = K // BK
    gl.warp_specialize([
        (_loader, (w0_bufs, w1_bufs, s0_bufs, s1_bufs, x0_bufs, x1_bufs, ready, empty, num_steps,
                   x_ptr, w_desc, s_desc, sorted_ids_ptr, expert_ids_ptr, ntp_ptr, grid_n, grid_m,
                   OUT_W, N, num_routes, stride_xm, TOP_K, BK, BT0, BT1, GATED, STAGES,
                   BLOCKED, HALVES, SK, num_warps)),
        (_consumer, (w0_bufs, s0_bufs, x0_bufs, x1_bufs, ready, empty, turn, num_steps, out_ptr,
                     sorted_ids_ptr, expert_ids_ptr, ntp_ptr, parts_ptr, arrivals_ptr,
                     stride_p, grid_n, grid_m, 0, OUT_W, num_routes, stride_om, BK, BT0, BT1,
                     GATED, STAGES, 0 if ORDER else -1, HALVES, SK, KSPLIT)),
        (_consumer, (w1_bufs, s1_bufs, x0_bufs, x1_bufs, ready, empty, turn, num_steps, out_ptr,
                     sorted_ids_ptr, expert_ids_ptr, ntp_ptr, parts_ptr, arrivals_ptr,
                     stride_p, grid_n, grid_m, OUT_W, OUT_W, num_routes, stride_om, BK, BT0,
                     BT1, GATED, STAGES, 1 if ORDER else -1, HALVES, SK, KSPLIT)),
    ], [4, 4], [CREGS, CREGS])


_MAXNREG = 168  # 12 warps (loader + two consumer warpgroups), one CTA per SM: 65536 / 384


def halves_of(block_n: int, gated: bool) -> int:
    """A consumer's 128-row halves for a tile of ``block_n`` output columns: 1 (256 weight
    rows a tile), or 2 (512, the wide form); else ValueError."""
    one = WGR.value if gated else 2 * WGR.value  # output columns of a 256-weight-row tile
    if block_n not in (one, 2 * one):
        raise ValueError(f"the Gluon prefill tile computes 256 or 512 weight rows: block_n "
                         f"{one} or {2 * one}, got {block_n}")
    return block_n // one


def _launch_options(top_k: int, block_m: int, block_k: int, num_stages: int,
                    gated: bool, order: bool = ORDERED, blocked: bool = False,
                    halves: int = 1, stream_k: int = 0, k_split: int | None = None) -> dict:
    bt0, bt1 = split_rows(block_m)
    if block_m == 128 and num_stages > ROWS128_STAGES:
        raise ValueError(f"the 128-row Gluon prefill tile takes at most {ROWS128_STAGES} ring "
                         f"slots (shared memory), got num_stages {num_stages}")
    k_split = k_split_of(block_m) if k_split is None else k_split
    if k_split not in (1, 2):
        raise ValueError(f"the Gluon prefill tile issues a step in 1 or 2 parts, got {k_split}")
    if halves == 2 and (bt1 or num_stages > WIDE_STAGES):
        raise ValueError(f"the wide Gluon prefill tile (512 weight rows) takes power-of-two "
                         f"row blocks and at most {WIDE_STAGES} ring slots, got block_m "
                         f"{block_m}, num_stages {num_stages}")
    return {"TOP_K": top_k, "BK": block_k, "BT0": bt0, "BT1": bt1, "GATED": gated,
            "STAGES": num_stages, "CREGS": CONSUMER_REGS.get(block_m, 216), "ORDER": order,
            "BLOCKED": blocked, "HALVES": halves, "SK": int(stream_k), "KSPLIT": k_split,
            "num_warps": 4}


def k_split_of(block_m: int) -> int:
    """Parts a consumer dequantizes and issues a step in: 2 for 128-row blocks (a 128-row
    accumulator and a whole step's register A run out of registers), else 1."""
    return 2 if block_m > 96 else 1


def _partial_sums(block_m: int, halves: int) -> int:
    """FP32 partial sums a consumer of a cut stream-K tile leaves: its accumulators'."""
    bt0, bt1 = split_rows(block_m)
    return WGR.value * (bt0 + (bt0 if halves == 2 else bt1))


def _descriptors(w_packed, w_scale, k: int, block_k: int, split: bool, blocked: bool,
                 first_row: int = 0):
    """TMA descriptors of the words and scales: rows of K/8 words and K/32 scales, or with
    ``blocked`` (``chordq.layout.row_blocks``) rows of one piece, 32 words and 8 scales;
    ``split``: boxes of 64 rows (the 256-row form's gate or up half), else 128.
    ``first_row`` (a multiple of 128): the descriptors start that many weight rows in, so the
    kernel's row ``e N + n`` reads ``e N + first_row + n`` (a launch over later columns)."""
    skip = first_row // 128 * (k // 256) * 128 if blocked else first_row  # descriptor rows
    box, layout = _words_box(block_k, split)
    words = w_packed.view(-1, 32 if blocked else k // 8)[skip:]
    w_desc = TensorDescriptor.from_tensor(words, box, layout)
    box, layout = _scales_box(block_k, split)
    scales = w_scale.view(-1, 8 if blocked else k // 32)[skip:]
    s_desc = TensorDescriptor.from_tensor(scales, box, layout)
    return w_desc, s_desc


def moe_gemm_indexed_gluon_prefill(x, w_packed, w_scale, sorted_token_ids, expert_ids,
                                   num_tokens_post_padded, top_k, out, *, num_routes, grid_m,
                                   block_m, block_n, block_k, num_stages, gated,
                                   order: bool = ORDERED, persistent: bool = PERSISTENT,
                                   blocked: bool = False, stream_k: int = 0,
                                   k_split: int | None = None,
                                   columns: tuple[int, int] | None = None):
    """Launch the prefill tile; ``triton_w4a16.moe_gemm_indexed_triton`` checks the arguments
    (subnormal weights, ``block_m``-row alignment) and calls this for its configs
    (``triton_config.GLUON_PREFILL_TILE``). ``block_n``: output columns per tile.
    ``persistent``: one program per SM shares the ``grid_m x N / block_n`` tiles (module
    docstring), else one program per tile. ``blocked``: the weights are in
    ``chordq.layout.row_blocks`` (``w_order="blocked"``). ``stream_k`` (persistent only): a
    last round of tiles under 80% full and the round before it are shared out by K steps
    (``_schedule``); a tile cut in two is summed in FP32 through ``triton_w4a16``'s stream-K
    buffers; ``stream_k=2``: the same on the 32-bit walk (variant 64), 1 where it would not
    fit (``walk_fits_32_bits``). ``k_split``: parts a step is dequantized and issued in
    (default ``k_split_of``).
    ``columns``: ``(lo, hi)``, compute only output columns ``lo..hi`` (``out``'s others are
    left as they are): a launch of one tile form over part of N, beside another form's launch
    over the rest (the descriptors and ``out`` start at ``lo``; the kernel is unchanged)."""
    n_w, k = w_packed.shape[1], x.shape[1]
    n = n_w // 2 if gated else n_w
    lo, hi = columns or (0, n)
    halves = halves_of(block_n, gated)
    if k % (2 * block_k) or (hi - lo) % block_n:  # scales: a TMA box covers two steps
        raise ValueError(f"the Gluon prefill tile needs K % {2 * block_k} == 0 and N % "
                         f"{block_n} == 0, got K={k}, N={hi - lo}")
    if not 0 <= lo < hi <= n or lo % 128:
        raise ValueError(f"columns must be 0 <= lo < hi <= N={n} with lo a multiple of 128, "
                         f"got {columns}")
    if x.stride(1) != 1 or x.stride(0) % 8:
        raise ValueError("the Gluon prefill tile needs X rows contiguous and 16-byte aligned")
    if blocked and block_k > 128:  # two steps' scales: one piece's 8
        raise ValueError(f"the Gluon prefill tile on row blocks needs block_k <= 128, got "
                         f"{block_k}")
    if stream_k and not persistent:
        raise ValueError("stream_k shares the persistent programs' last rounds: persistent only")
    if stream_k not in (0, 1, 2):
        raise ValueError(f"stream_k is 0, 1 or 2 (the 32-bit walk), got {stream_k}")
    tiles = (hi - lo) // block_n * grid_m
    programs = min(tiles, _num_sms(x.device)) if persistent else tiles
    if stream_k == 2 and not walk_fits_32_bits(programs, k // block_k):
        stream_k = 1
    opts = _launch_options(top_k, block_m, block_k, num_stages, gated, order, blocked, halves,
                           stream_k, k_split)
    w_desc, s_desc = _descriptors(w_packed, w_scale, k, block_k, gated and halves == 1, blocked,
                                  lo)
    if stream_k:  # a boundary slot per program and one more, a part per consumer; the parts
        # are written before they are read, so not the zeroed ones other kernels add into
        parts, arrivals = _stream_k_buffers(x.device, 2 * (programs + 1),
                                            _partial_sums(block_m, halves) // 2, "handover")
    else:
        parts, arrivals = out, sorted_token_ids  # not read
    _w4a16_prefill_kernel[(programs,)](
        x, w_desc, s_desc, out[:, lo:], sorted_token_ids, expert_ids, num_tokens_post_padded,
        parts, arrivals, n, k, num_routes, x.stride(0), out.stride(0), parts.stride(0),
        (hi - lo) // block_n, grid_m, maxnreg=_MAXNREG, **opts)
    return out


def compile_sm90(block_m: int = GLUON_PREFILL_TILE.block_m,
                 block_k: int = GLUON_PREFILL_TILE.block_k,
                 num_stages: int = GLUON_PREFILL_TILE.num_stages, gated: bool = False,
                 top_k: int = 8, order: bool = ORDERED, blocked: bool = True,
                 halves: int = 1, stream_k: int = 0, k_split: int | None = None):
    """The tile built for sm_90 on the CPU (``gluon_w4a16.compile_kernel_sm90``: tests, lab);
    by default the shipped one (``triton_config.GLUON_PREFILL_TILE``, ``ORDERED``);
    ``halves=2``: the wide form (512 weight rows); ``stream_k``: the stream-K schedule (2: its
    32-bit walk)."""
    box, layout = _words_box(block_k, gated and halves == 1)
    s_box, s_layout = _scales_box(block_k, gated and halves == 1)
    return compile_kernel_sm90(_w4a16_prefill_kernel,
                               _launch_options(top_k, block_m, block_k, num_stages, gated, order,
                                               blocked, halves, stream_k, k_split),
                               types={"w_desc": f"tensordesc<i32{box},{layout!r}>",
                                      "s_desc": f"tensordesc<bf16{s_box},{s_layout!r}>",
                                      "parts_ptr": "*fp32", "arrivals_ptr": "*i32"},
                               maxnreg=_MAXNREG)
