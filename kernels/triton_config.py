"""Tile configs for the W4A16 grouped GEMMs and the heuristic that picks them (no autotuning).

Names follow the *output* (rows = tokens/routes, columns = N features). Inside the kernel the
dot is swapped, ``C^T[BLOCK_N, BLOCK_M] = W[BLOCK_N, BLOCK_K] . X^T[BLOCK_K, BLOCK_M]``, so the
dequantized weight tile is the dot's left operand (kernels.md §2.1) and BLOCK_M, the tokens,
sits in the dot's N slot where 16 is the minimum.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["W4A16Config", "choose_config", "choose_row_tiles", "choose_split_k",
           "gluon_decode_applies", "gluon_decode_halve_applies", "gluon_prefill_applies",
           "GLUON_DECODE_TILE",
           "choose_gluon_n_tiles", "choose_gluon_stream_k", "choose_gluon_split_k",
           "GLUON_STREAM_K_PER_SM",
           "GLUON_PREFILL_TILE", "GLUON_PREFILL_TILE_64", "GLUON_PREFILL_TILE_64_WIDE",
           "GLUON_PREFILL_TILE_128", "gluon_prefill_rows",
           "choose_gluon_prefill_wide", "gluon_prefill_64_applies",
           "GLUON_PREFILL_TILE_32", "GLUON_PREFILL_TILE_32_WIDE", "gluon_prefill_32_applies",
           "GLUON_PREFILL_TILES", "GLUON_PREFILL_WIDE_TILES", "GLUON_PREFILL_STREAM_K_ROWS",
           "GLUON_PREFILL_WIDE_STREAM_K_ROWS", "GLUON_PREFILL_STREAM_K_WALK32_ROWS"]

GROUP_SIZE = 32
# token rows a block of gluon_w4a16's mma.sync decode tile holds (n8 fragments in registers)
GLUON_DECODE_ROWS = (8, 16, 32)
# token rows a block of gluon_prefill's tile holds (96: a 64- and a 32-row accumulator; 128:
# one, each step dequantized and issued in two parts, gluon_prefill.k_split_of). A 32-row
# Gluon config is the decode tile with 256-deep steps, the prefill tile with shallower ones
# (W4A16Config.gluon_decode).
GLUON_PREFILL_ROWS = (128, 96, 64, 32)
# the blocks whose tile also has a wide form (512 weight rows a tile: GLUON_PREFILL_WIDE_TILES)
GLUON_PREFILL_WIDE_ROWS = (64, 32)
K_ORDERS = ("natural", "planes", "pairs", "fragments", "subnormal")
# How the weights were converted at load time: "checkpoint" (as written), "fragments" (words in
# chordq.layout.fragment_order), "subnormal" (those words and chordq.layout.subnormal_scales),
# "blocked" (the subnormal weights in chordq.layout.row_blocks: N % 128 == 0, K % 256 == 0).
W_ORDERS = ("checkpoint", "fragments", "subnormal", "blocked")
# the w_orders the subnormal tiles read ("blocked": the same tiles, row-block addressing)
SUBNORMAL_W_ORDERS = ("subnormal", "blocked")
# the k_order that reads each w_order's weights (None: any of the checkpoint-order ones)
K_ORDER_OF = {"checkpoint": None, "fragments": "fragments", "subnormal": "subnormal",
              "blocked": "subnormal"}
# and back: the unblocked w_order a k_order reads ("checkpoint" for the others)
W_ORDER_OF = {"fragments": "fragments", "subnormal": "subnormal"}


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class W4A16Config:
    """One launch config.

    :param block_m: routed rows per tile; for the indexed path also the ``moe_align_block_size``
        block size. Power of two, 16..128 (128 % block_m == 0 keeps grouped-contiguous tiles
        inside one expert's 128-row-aligned segment).
    :param block_n: output features per tile (with ``silu_mul``: per half, so the tile reads
        ``2 * block_n`` weight rows). Power of two >= 16.
    :param block_k: reduction step; power of two >= 32 (whole scale groups) dividing K.
    :param k_order: the order each K tile is visited in (``triton_w4a16._w4a16_tile``):
        ``"natural"``; ``"planes"`` (nibble-plane-major: the dequantized weight goes to the
        tensor cores without a shared-memory round trip, the X tile is permuted instead);
        ``"pairs"`` (planes whose two BF16 halves of a register are nibbles j and j + 4 of one
        word: dequantized two weights per instruction by inline PTX on the GPU);
        ``"fragments"`` (the same dequantization on words converted once by
        ``chordq.layout.fragment_order``, so X is not permuted; needs ``w_order="fragments"``);
        ``"subnormal"`` (fragment words and ``chordq.layout.subnormal_scales``: each BF16 pair
        is masked into subnormal range and finished by one fma, 12 instructions per word
        instead of 15; needs ``w_order`` ``"subnormal"`` or ``"blocked"``, the same weights in
        ``chordq.layout.row_blocks``, read by the same tiles).
    :param split_k: split the K steps over this many programs per output tile (indexed path):
        FP32 partials, then a reduce kernel. For grids too thin to fill the GPU.
    :param max_registers: cap on registers per thread (Triton's ``maxnreg``), to fit more CTAs
        per SM; None lets the compiler choose.
    :param n_tiles: > 1: each program loads its X rows once and loops over this many
        ``block_n`` column tiles, pipelining their weight loads (indexed path, no activation,
        ``block_k == K``: the few-K down projection of TP8, K = 256).
    :param stream_k: > 0: stream-K (indexed path): this many persistent programs per SM (the
        CTAs per SM the tile reaches) take whole tiles for the full waves and share out a thin
        last wave (under 80% full) by K steps; a tile cut between two programs is summed in
        FP32 by the second. Opt-in: on the 16x128x256 decode tile it saves 8-11% where the
        last wave is thin (TP8 T=20 above ~133 experts) and costs 3-6% elsewhere, up to 17% on
        the 4-per-SM R128 tile (plan26, wave_sweep), so the heuristic does not use it.
    :param columns_first: programs walk one row block's column tiles before the next row
        block (one expert's weights at a time) instead of row blocks first (indexed path).
    :param backend: ``"triton"``, or ``"gluon"`` (indexed path, subnormal weights, sm_90
        only) for ``gluon_w4a16``'s 8-row ``mma.sync`` decode tile (``block_m`` 8, ``block_k``
        256, ``num_stages`` the depth of its copy ring; with ``silu_mul`` ``block_n`` counts
        the gate and up rows together) or ``gluon_prefill``'s warp-specialized tile
        (``block_m`` 128, 96 or 64, 256 weight rows: ``block_n`` 256, or 128 per half with
        ``silu_mul``; on 64-row blocks also the wide form, 512 weight rows: ``block_n`` 512, or
        256 with ``silu_mul``, at most 3 stages; ``num_warps`` 4 is its loader, two 4-warp
        consumers come on top; ``stream_k`` 1: its persistent programs share a thin last
        round of tiles by K steps; 2: the same schedule walked in 32 bits).
    :param halve: the Gluon decode tile on 16-row blocks, a block whose last 8 rows are
        padding run as an 8-row one (``gluon_w4a16._w4a16_decode_kernel``'s HALVE; where
        ``gluon_decode_halve_applies``); no split_k, stream_k or n_tiles.
    """

    block_m: int = 16
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    k_order: str = "natural"
    split_k: int = 1
    max_registers: int | None = None
    n_tiles: int = 1
    stream_k: int = 0
    columns_first: bool = False
    backend: str = "triton"
    halve: bool = False

    @property
    def label(self) -> str:
        """``BM,BN,BK,warps,stages`` plus ``,P`` / ``,Q`` / ``,F`` (planes / pairs / fragments),
        ``,S<split_k>``, ``,R<max_registers>``, ``,L<n_tiles>``, ``,K<stream_k>``, ``,C``
        (columns first) and ``,H`` (halve) when set."""
        tag = {"natural": "", "planes": ",P", "pairs": ",Q", "fragments": ",F",
               "subnormal": ",Z"}[self.k_order]
        split = f",S{self.split_k}" if self.split_k > 1 else ""
        regs = f",R{self.max_registers}" if self.max_registers else ""
        loop = f",L{self.n_tiles}" if self.n_tiles > 1 else ""
        stream = f",K{self.stream_k}" if self.stream_k else ""
        cols = ",C" if self.columns_first else ""
        halve = ",H" if self.halve else ""
        gluon = ",G" if self.backend == "gluon" else ""
        return (f"{self.block_m},{self.block_n},{self.block_k},{self.num_warps},"
                f"{self.num_stages}{tag}{split}{regs}{loop}{stream}{cols}{halve}{gluon}")

    @property
    def gluon_decode(self) -> bool:
        """A Gluon config on 8-, 16- or 32-row blocks with 256-deep steps is the decode tile
        (``gluon_w4a16``); the other Gluon configs are the prefill tile (``gluon_prefill``)."""
        return (self.backend == "gluon" and self.block_m in GLUON_DECODE_ROWS
                and self.block_k == 256)

    def __post_init__(self) -> None:
        if self.k_order not in K_ORDERS:
            raise ValueError(f"k_order must be one of {K_ORDERS}, got {self.k_order!r}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if self.n_tiles < 1 or (self.n_tiles > 1 and self.split_k > 1):
            raise ValueError(f"n_tiles must be >= 1 and excludes split_k > 1, got "
                             f"n_tiles={self.n_tiles} split_k={self.split_k}")
        if self.stream_k < 0 or (self.stream_k and (self.split_k > 1 or self.n_tiles > 1)):
            raise ValueError(f"stream_k must be >= 0 and excludes split_k > 1 and n_tiles > 1, "
                             f"got stream_k={self.stream_k} split_k={self.split_k} "
                             f"n_tiles={self.n_tiles}")
        if self.halve and not (self.backend == "gluon" and self.gluon_decode
                               and self.block_m == 16 and self.split_k == 1
                               and not self.stream_k and self.n_tiles == 1):
            raise ValueError(f"halve is the Gluon decode tile on 16-row blocks without split_k, "
                             f"stream_k or n_tiles, got {self}")
        if self.backend == "gluon":
            plain = (self.k_order, self.max_registers,
                     self.columns_first) == ("subnormal", None, False)
            shared = self.stream_k or self.split_k > 1  # programs share a tile's K steps
            prefill_sk = (self.stream_k in (1, 2) and self.split_k == 1 and not self.gluon_decode
                          and self.block_m in GLUON_PREFILL_ROWS)
            decode = (self.gluon_decode
                      and self.block_n >= 64 and (self.n_tiles == 1 or self.num_stages >= 2
                                                  and self.block_m == 8)
                      and (not shared or self.block_m == 8))
            if shared and not decode and not prefill_sk:
                plain = False
            wide = (self.block_n == 512 and self.block_m in GLUON_PREFILL_WIDE_ROWS
                    and self.num_stages <= 3)
            prefill = (not self.gluon_decode and self.block_m in GLUON_PREFILL_ROWS
                       and self.block_k in (64, 128, 256)
                       and (self.block_n in (128, 256) or wide) and self.num_warps == 4
                       and self.n_tiles == 1)
            if not (plain and (decode or prefill)):
                raise ValueError(f"the gluon backend is the decode tile (block_m 8, 16 or 32, "
                                 f"block_k 256, block_n >= 64; n_tiles > 1, stream_k or "
                                 f"split_k: 8 rows; n_tiles: 2+ stages) or the prefill tile "
                                 f"(block_m 128, 96, 64 or 32 (block_k under 256), block_n 128 or "
                                 f"256, or 512 at block_m 64 or 32 and 3 stages at most, 4 "
                                 f"loader warps, no n_tiles or split_k, stream_k 0, 1 or 2), "
                                 f"k_order 'subnormal', no max_registers or columns_first; "
                                 f"got {self}")
            return
        if self.backend != "triton":
            raise ValueError(f"backend must be 'triton' or 'gluon', got {self.backend!r}")
        if not (_is_pow2(self.block_m) and 16 <= self.block_m <= 128):
            raise ValueError(f"block_m must be a power of two in [16, 128], got {self.block_m}")
        if not (_is_pow2(self.block_n) and self.block_n >= 16):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if not (_is_pow2(self.block_k) and self.block_k >= GROUP_SIZE):
            raise ValueError(f"block_k must be a power of two >= {GROUP_SIZE}, got {self.block_k}")


# gluon_w4a16's tile: 4 warps of 32 weight rows, 2-stage copy ring. Picked on the H200
# (scripts/kernel_lab/gluon_decode.py, Humming alongside): 2 stages beat 3 and 4 on 33 of 38
# rows (the loop is a 256-deep K step; one in flight hides the latency); 64 or 256 rows per
# CTA, 8 warps, or 16 token rows (X traffic doubles) were slower.
GLUON_DECODE_TILE = W4A16Config(8, 128, 256, 4, 2, k_order="subnormal", backend="gluon")
# gluon_prefill's tile: 96-row blocks (64 + 32 token rows), 256 weight rows in two ping-pong
# warpgroups that take turns issuing their wgmmas, 128-deep steps, 4-slot ring. Picked on the
# H200 (scripts/kernel_lab/gluon_prefill.py, Humming alongside): against 128 weight rows per
# program (64 per warpgroup) or 64-deep steps, EP8 T=512 down 314 vs 340-363 µs, T=1024
# gate_up 1071 vs 1095-1196 (session 17, 3 slots, no turns); then turns and 4 slots (session
# 18, gluon_prefill.ORDERED): 0.88-0.99 of the 3-slot tile's time (EP8 down T=512-1024:
# 1.00-1.02); 64-deep steps with 6-8 slots lost (1.05-1.39 of this tile's time); 128-row blocks
# run out of registers (ptxas serializes the wgmmas). Launched persistent (session 19,
# gluon_prefill.PERSISTENT: EP8 down 0.89-0.94 of one program per tile).
GLUON_PREFILL_TILE = W4A16Config(96, 256, 128, 4, 4, k_order="subnormal", backend="gluon")
# The same tile on 64-row blocks (one 64-row accumulator), for 33-64 rows per expert where the
# alignment's blocks are 64 rows (gluon_prefill_64_applies). With its words by TMA (session 22,
# variant 35) it beat the Triton 64-row tile it replaces, same process, H200: EP8 T=256 gate_up
# 0.97, down 0.88, TP8 gate_up T=2048 0.96; with cp.async words 1.06-1.11 / 0.95 / 1.06. Five
# slots (it has the shared memory: 217 KB) against four, with 232 consumer registers (session
# 23, same process): gate_up 0.98, fused 0.97, TP8 gate_up 0.99 / 0.98, down 1.01.
GLUON_PREFILL_TILE_64 = dataclasses.replace(GLUON_PREFILL_TILE, block_m=64, num_stages=5)
# Its wide form (variant 55): each consumer owns two 128-row halves, 512 weight rows a tile (with
# silu_mul 256 gate rows and their up rows), so a slot's gathered X rows serve twice the weight
# rows; 3 slots (gluon_prefill.WIDE_STAGES: 56 KB each). H100, same process, of the 256-row
# tile's time (two runs): EP8 gate_up T=256 0.92-0.94 (fused 0.92), TP8 gate_up T=2048
# 0.91-0.92 (fused 0.91), EP8 down T=256 1.03 (half the tiles in 6 rounds of 132 SMs against
# 11: choose_gluon_prefill_wide).
GLUON_PREFILL_TILE_64_WIDE = dataclasses.replace(GLUON_PREFILL_TILE_64, block_n=512,
                                                 num_stages=3)
# The tile on 128-row blocks (variant 58): one 128-row accumulator a consumer, each step
# dequantized and issued in two 64-deep parts (gluon_prefill.k_split_of: a 128-row accumulator
# and a whole step's register A run out of registers); 3 slots (52 KB each; the store's
# 128 x 128 FP32 layout conversion takes 32 KB of scratch beside them). One N = 128 wgmma where
# 96 rows take an N = 64 and an N = 32 one, and each dequantized weight serves 128 rows.
GLUON_PREFILL_TILE_128 = dataclasses.replace(GLUON_PREFILL_TILE, block_m=128, num_stages=3)
# The 64-row tile and its wide form on 32-row blocks (variant 60: one 32-row accumulator), for
# 17-32 rows an expert (gluon_prefill_32_applies). H100, same process, blocked words, of the
# Triton 32-row tile's time, two draws: wide form EP8 gate_up T=128 0.97-0.98 (fused 0.96-0.97),
# TP8 gate_up T=1024 0.94-0.95; the 256-row form EP8 down T=128 1.00-1.03, so
# triton_w4a16.indexed_config takes the tile where choose_gluon_prefill_wide picks the wide form
GLUON_PREFILL_TILE_32 = dataclasses.replace(GLUON_PREFILL_TILE_64, block_m=32)
GLUON_PREFILL_TILE_32_WIDE = dataclasses.replace(GLUON_PREFILL_TILE_64_WIDE, block_m=32)
# The prefill tiles by block rows: the 256-weight-row form, and the wide form where there is one
GLUON_PREFILL_TILES = {128: GLUON_PREFILL_TILE_128, 96: GLUON_PREFILL_TILE,
                       64: GLUON_PREFILL_TILE_64, 32: GLUON_PREFILL_TILE_32}
GLUON_PREFILL_WIDE_TILES = {64: GLUON_PREFILL_TILE_64_WIDE, 32: GLUON_PREFILL_TILE_32_WIDE}
# The blocks whose 256-row Gluon prefill tile the heuristic runs with stream-K (stream_k 1: the
# persistent programs share a last round under 80% full by K steps, decided on the device from
# the draw's tiles). With the handover by a flag (variant 62, H100, same process) the 64-row
# tile took 0.965 of its plain time at EP8 down T=256 (10.2 rounds; 0.98-0.983 in the
# timeline lab), 1.01 with a full last round. Not yet for the 96-row tile (gate_up 0.93-0.97,
# down 1.00-1.01), the 128-row and the wide forms (not measured): performance.md §29.
GLUON_PREFILL_STREAM_K_ROWS: tuple[int, ...] = (64,)
# the same for the wide form (none yet; scripts/bench_kernels.py --wide-stream-k-rows tries them)
GLUON_PREFILL_WIDE_STREAM_K_ROWS: tuple[int, ...] = ()
# The blocks whose stream-K (either form) walks its schedule in 32 bits (stream_k 2, variant 64:
# 320-340 fewer SASS instructions a build, identical pieces). None until measured on a GPU:
# scripts/bench_kernels.py --alt GLUON_PREFILL_STREAM_K_WALK32_ROWS=64 A/Bs it, same process.
GLUON_PREFILL_STREAM_K_WALK32_ROWS: tuple[int, ...] = ()
# A wide tile's time against two 256-row tiles' (variant 55: 0.91-0.94 in equal rounds, and
# 1.03 * 11 / 12 = 0.94 at EP8 down, where the wide grid took 6 rounds against 11)
GLUON_PREFILL_WIDE_PAIR = 0.94


def touched_experts(num_experts: int, num_routes: float) -> float:
    """Experts hit by ``num_routes`` uniform draws among ``num_experts``:
    ``E (1 - exp(-routes / E))``."""
    return num_experts * -math.expm1(-num_routes / num_experts) if num_experts else 0.0


def gluon_decode_applies(rows_per_expert: float, n: int, k: int, num_experts: int,
                         num_sms: int, gated: bool = False) -> bool:
    """Whether ``choose_row_tiles`` takes the Gluon 8-row tile (given an sm_90 GPU and
    subnormal weights): up to 6 rows per expert (one 8-row block for most experts; at 21 rows,
    EP8 T=128, the three blocks re-dequantize the weights: 1.6-2.1x slower), K a multiple of
    256, whole column tiles, and a grid of at least 1.5 programs per SM (TP8 gate_up T=1,
    32 tiles, ran 1.7x slower; EP8 gate_up T=1, 256 tiles, 0.97 of the Triton tile's time).
    Where K is one step (TP8 down, K = 256) the column-looping form runs up to 12 rows: at
    10.7 rows (T=512) it took 0.88 of the 16-row Triton tile's time (H100, variant 48).

    :param n: output features (with ``gated``, ``silu_mul``: per half; a tile then covers 64)
    """
    most = 12 if k == 256 and not gated else 6  # the column-looping form at one K step
    if not (0 < rows_per_expert <= most and _gluon_decode_fits(n, k, gated)
            and num_experts > 0):
        return False
    out_n = GLUON_DECODE_TILE.block_n // (2 if gated else 1)
    touched = touched_experts(num_experts, rows_per_expert * num_experts)
    tiles = touched * max(1, math.ceil(rows_per_expert / 8)) * n / out_n
    return tiles >= 1.5 * num_sms


# rows per expert (pairs of bounds, lo < rpe <= hi) where the decode GEMMs with K > 256 run
# halved 16-row Gluon blocks instead of 8-row ones (variant 63; empty: not yet measured; read at
# each call, so `bench_kernels.py --alt GLUON_DECODE_HALVE_RPE=4.0,6.0` tries it)
GLUON_DECODE_HALVE_RPE: tuple[float, ...] = ()


def gluon_decode_halve_applies(rows_per_expert: float, n: int, k: int,
                               gated: bool = False) -> bool:
    """Whether the decode tile's blocks are halved 16-row ones (``W4A16Config.halve``): K over
    one step (the column-looping form has no halved build), the tile's shape rule, and
    ``rows_per_expert`` in a ``GLUON_DECODE_HALVE_RPE`` range: where a few experts hold 9-16
    rows, their one 16-row block replaces two 8-row ones in the same launch (TP8 gate_up
    T=256: 383 blocks instead of 426, 2.90 rounds of 528 program slots instead of 3.23)."""
    return (k > 256 and _gluon_decode_fits(n, k, gated)
            and any(lo < rows_per_expert <= hi for lo, hi in _bound_pairs(GLUON_DECODE_HALVE_RPE)))


def _bound_pairs(bounds: tuple[float, ...]) -> list[tuple[float, float]]:
    """A flat ``(lo, hi, lo, hi, ..)`` constant (a tuple, so ``bench_kernels.py --alt`` can set
    it) as its ``(lo, hi)`` ranges."""
    return list(zip(bounds[::2], bounds[1::2]))


def _gluon_decode_fits(n: int, k: int, gated: bool) -> bool:
    """The decode tile's shape rule: whole 256-deep steps and whole column tiles."""
    return k % 256 == 0 and n % (GLUON_DECODE_TILE.block_n // (2 if gated else 1)) == 0


def gluon_prefill_applies(rows_per_expert: float, n: int, k: int, gated: bool = False) -> bool:
    """Whether ``choose_row_tiles`` takes the Gluon prefill tile (given an sm_90 GPU and
    subnormal weights): over 64 rows per expert where its blocks (``gluon_prefill_rows``: 96
    or 128) pad at most 5% more rows than the Triton tiles would (``_triton_padded_rows``), and
    ``_gluon_prefill_fits``' shape rule. So 85 rows take one block of 96 instead of 128, 171
    two of 96 as 128 + 64, 97-128 rows one of 128, 341 three of 128, 1365 eleven of 128; 150
    rows for K > N (192 against 128 + 32) and 200 (256 against 128 + 64 + 32) keep the Triton
    tiles. The 128-row Gluon tile against the Triton 128-row tile at equal padding (variant 58,
    H100, same process): EP8 T=2048 gate_up 0.88, down 0.65; T=8192 0.84 / 0.77. The 96-row
    tile against the Triton tiles, measured on the H200, same process
    (scripts/kernel_lab/gluon_prefill.py, session 18, one or two runs), as a fraction of the
    Triton tiles' time: EP8 T=512 (85 rows) gate_up 0.85-0.89, down 0.82-0.84; T=1024 (171)
    0.82-0.92 / 0.93; T=2048 (341) 0.97-1.00 / 0.89-0.99; T=8192 (1365) 0.94 / 0.87; TP8
    gate_up T=8192 (171 rows, N=512) 0.80. At 43 rows (T=256, the Triton tile 64 rows) 96-row
    blocks ran 1.20-1.33; the tile on 64-row blocks runs there (``gluon_prefill_64_applies``).

    :param n: output features (with ``gated``, ``silu_mul``: per half; a tile then covers 128)
    """
    bm = gluon_prefill_rows(rows_per_expert)
    pads_less = (math.ceil(rows_per_expert / bm) * bm
                 <= 1.05 * _triton_padded_rows(rows_per_expert, n, k))
    return rows_per_expert > 64 and pads_less and _gluon_prefill_fits(n, k, gated)


def gluon_prefill_rows(rows_per_expert: float) -> int:
    """The Gluon prefill tile's block rows where ``gluon_prefill_applies``: 128
    (``GLUON_PREFILL_TILE_128``) where 128-row blocks pad no more rows than 96-row ones, else
    96. So 341 rows per expert (EP8 T=2048) take three blocks of 128 for four of 96, 1365
    (T=8192) eleven for fifteen (1408 rows against 1440); 85 (T=512) and 171 (T=1024) keep 96.
    Measured (variant 58, H100, same process, row-blocked words), the 128-row tile as a
    fraction of the 96-row one's time: EP8 T=2048 gate_up 0.91 (fused 0.94), down 0.94; T=8192
    0.96 / 0.93 / 0.95; where it pads more, EP8 T=512 (one block either way) 1.15 / 1.14 / 1.22
    and TP8 gate_up T=8192 (171 rows: 256 against 192) 1.30 / 1.24."""
    big = GLUON_PREFILL_TILE_128.block_m
    bm = GLUON_PREFILL_TILE.block_m
    fewer = math.ceil(rows_per_expert / big) * big <= math.ceil(rows_per_expert / bm) * bm
    return big if fewer else bm


def gluon_prefill_64_applies(rows_per_expert: float, n: int, k: int,
                             gated: bool = False) -> bool:
    """Whether ``choose_config`` takes the Gluon tile on 64-row blocks
    (``GLUON_PREFILL_TILE_64``; given an sm_90 GPU and subnormal weights): 33-64 rows per
    expert (EP8 T=256 and TP8 T=2048: 43) and the 96-row tile's shape rule. Fused
    SiLU-and-mul ran 1.18-1.24x the Triton 64-row tile's time there while the scales went by
    ``cp.async`` (session 22), 0.90 since they go by TMA (session 23, same process, EP8
    gate_up T=256 and TP8 gate_up T=2048)."""
    return 32 < rows_per_expert <= 64 and _gluon_prefill_fits(n, k, gated)


def gluon_prefill_32_applies(rows_per_expert: float, n: int, k: int,
                             gated: bool = False) -> bool:
    """Whether ``choose_config`` takes the Gluon tile on 32-row blocks
    (``GLUON_PREFILL_TILE_32``; given an sm_90 GPU and subnormal weights): 17-32 rows per
    expert (EP8 T=128 and TP8 T=1024: 21), where the alignment's blocks are 32 rows, and the
    prefill tile's shape rule (TP8 down, K = 256, keeps the column-looping Triton tile).
    ``triton_w4a16.indexed_config`` then keeps it only in its wide form
    (``choose_gluon_prefill_wide``: gate_up at 21 rows), where it won (variant 60)."""
    return 16 < rows_per_expert <= 32 and _gluon_prefill_fits(n, k, gated)


def choose_gluon_prefill_wide(blocks: int, n: int, gated: bool, num_sms: int) -> bool:
    """Whether the 64-row Gluon tile runs in its wide form (``GLUON_PREFILL_TILE_64_WIDE``):
    where its half as many tiles, each ``GLUON_PREFILL_WIDE_PAIR`` of two 256-row tiles' time,
    finish sooner in rounds of ``num_sms`` (the launch is persistent and the tiles equal):
    ``2 ceil(t / 2 S) x 0.94 < ceil(t / S)`` for ``t = blocks x N / out_n`` 256-row tiles. At
    43 rows per expert (48 blocks at EP8, 384 at TP8, 132 SMs): gate_up (16 tiles a block; TP8:
    2) 3 rounds against 6, wide; EP8 down (28) 6 against 11, not."""
    out_n = _gluon_prefill_out_n(gated)
    if n % (2 * out_n):
        return False
    tiles = max(1, blocks) * (n // out_n)
    narrow = math.ceil(tiles / num_sms)
    wide = math.ceil(tiles / (2 * num_sms))
    return 2 * wide * GLUON_PREFILL_WIDE_PAIR < narrow


def _gluon_prefill_out_n(gated: bool) -> int:
    """Output columns of a Gluon prefill tile: 256 weight rows, with ``silu_mul`` 128 per half."""
    return GLUON_PREFILL_TILE.block_n // (2 if gated else 1)


def _gluon_prefill_fits(n: int, k: int, gated: bool) -> bool:
    """The Gluon prefill tile's shape rule, at either block size: N in whole tiles
    (``_gluon_prefill_out_n``) of at least 512 weight rows (gated: gate and up rows; TP8's
    fused gate_up, 256 + 256, took 0.79 of the Triton fused tiles' time at T=8192, session 23),
    K at least 2048 in whole pairs of 128-deep steps (the scales go by TMA two steps at a time,
    and TMA needs 16-byte aligned row strides: K/32 BF16 scales a row)."""
    weight_rows = 2 * n if gated else n
    return (weight_rows >= 512 and n % _gluon_prefill_out_n(gated) == 0 and k >= 2048
            and k % (2 * GLUON_PREFILL_TILE.block_k) == 0)


def _triton_padded_rows(rows_per_expert: float, n: int, k: int) -> int:
    """Rows an expert of ``rows_per_expert`` rows computes in ``_triton_row_tiles``' blocks:
    ``align.mixed_tiles`` covers the rows by halving sizes, so the rows round up to the
    smallest size."""
    small = min(_triton_row_tiles(rows_per_expert, n, k))
    return small * math.ceil(rows_per_expert / small)


def _block_m_for(rows_per_expert: float) -> int:
    for bm in (16, 32, 64):
        if rows_per_expert <= bm:
            return bm
    return 128


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _largest_dividing(k: int, preferred: int) -> int:
    bk = preferred
    while k % bk:
        bk //= 2
    return bk


def choose_config(
    rows_per_expert: float,
    n: int,
    k: int,
    *,
    gated: bool = False,
    block_m: int | None = None,
    w_order: str = "checkpoint",
    interpret: bool = False,
    gluon: bool = False,
) -> W4A16Config:
    """Pick a config from the problem shape.

    :param rows_per_expert: routed rows / local experts (e.g. ``M * top_k / E``)
    :param n: output features (``I`` for gate_up with ``silu_mul``, ``H`` for down)
    :param k: reduction size, a multiple of 32
    :param gated: the tile computes gate and up halves (a ``2 block_n``-row weight tile)
    :param block_m: force the row tile (e.g. to reuse one ``moe_align_block_size`` result)
    :param w_order: ``"checkpoint"`` (words as written), ``"fragments"``
        (``chordq.layout.fragment_order``), ``"subnormal"`` (those words and
        ``chordq.layout.subnormal_scales``) or ``"blocked"`` (those in
        ``chordq.layout.row_blocks``, the fastest); decides ``k_order``
    :param interpret: for Triton's CPU interpreter (CPU tensors), which pays per operation
        more than per element: big tiles, one stage
    :param gluon: the Gluon tiles can run (an sm_90 GPU: ``gluon_w4a16.gluon_ready``); with
        subnormal weights, 64-row blocks then take ``GLUON_PREFILL_TILE_64`` where
        ``gluon_prefill_64_applies``, 32-row blocks ``GLUON_PREFILL_TILE_32`` where
        ``gluon_prefill_32_applies``, and 128-row blocks ``GLUON_PREFILL_TILE_128`` where
        ``gluon_prefill_applies`` and ``gluon_prefill_rows`` picks them

    Decode (few rows per expert) is weight-bandwidth bound and, on the H200, close to
    instruction-issue bound: the smallest row tile, 256-deep K steps (128-byte weight rows per
    load), 3 stages, and enough CTAs per SM (a register cap where it fits 4). Prefill is compute
    bound: 128-row tiles, which amortize the dequantization over the most tokens.
    """
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    if w_order not in W_ORDERS:
        raise ValueError(f"w_order must be one of {W_ORDERS}, got {w_order!r}")
    if block_m in (8, 96):  # the Gluon tiles' blocks (choose_row_tiles with gluon_experts)
        if interpret or w_order not in SUBNORMAL_W_ORDERS:
            raise ValueError(f"{block_m}-row blocks are a Gluon tile's: it needs an sm_90 GPU "
                             f"and w_order 'subnormal' or 'blocked' weights")
        if block_m == 8:
            return GLUON_DECODE_TILE
        return dataclasses.replace(GLUON_PREFILL_TILE, block_n=_gluon_prefill_out_n(gated))
    if (gluon and block_m == 16 and w_order in SUBNORMAL_W_ORDERS and not interpret
            and gluon_decode_halve_applies(rows_per_expert, n, k, gated)):
        return dataclasses.replace(GLUON_DECODE_TILE, block_m=16, halve=True)
    if (gluon and block_m == 64 and w_order in SUBNORMAL_W_ORDERS and not interpret
            and gluon_prefill_64_applies(rows_per_expert, n, k, gated)):
        return dataclasses.replace(GLUON_PREFILL_TILE_64, block_n=_gluon_prefill_out_n(gated))
    if (gluon and block_m == 32 and w_order in SUBNORMAL_W_ORDERS and not interpret
            and gluon_prefill_32_applies(rows_per_expert, n, k, gated)):
        return dataclasses.replace(GLUON_PREFILL_TILE_32, block_n=_gluon_prefill_out_n(gated))
    if (gluon and block_m == 128 and w_order in SUBNORMAL_W_ORDERS and not interpret
            and gluon_prefill_applies(rows_per_expert, n, k, gated)
            and gluon_prefill_rows(rows_per_expert) == 128):
        return dataclasses.replace(GLUON_PREFILL_TILE_128, block_n=_gluon_prefill_out_n(gated))
    cfg = _choose(rows_per_expert, n, k, gated, block_m, w_order != "checkpoint",
                  w_order in SUBNORMAL_W_ORDERS, interpret)
    # the subnormal tiles are the fragment tiles with the cheaper dequantization (same loads)
    if w_order in SUBNORMAL_W_ORDERS:
        cfg = dataclasses.replace(cfg, k_order="subnormal")
    return cfg


def _choose(rows_per_expert: float, n: int, k: int, gated: bool, block_m: int | None,
            fragments: bool, subnormal: bool, interpret: bool) -> W4A16Config:
    bm = _block_m_for(rows_per_expert) if block_m is None else block_m
    max_bn = max(16, _next_pow2(n))
    if interpret:
        bk = _largest_dividing(k, 512)
        order = "fragments" if fragments else ("pairs" if bk >= 64 else "natural")
        return W4A16Config(bm, min(256, max_bn), bk, 4, 1, k_order=order)
    # Tiles below were picked from sweeps on the H200 (2026-12-02/03, docs/kernel_notes.md).
    if fragments and not gated and k <= 512 and _is_pow2(k):
        # One K step (TP8 down, K = 256): programs loop over column tiles (plan9-11: T=128
        # 237.6 µs as one 256-deep step per tile, 145.0 as 64-deep steps, 133.0 looping;
        # T=2048 311.9 -> 244.2). n_tiles is refined per grid by choose_n_tiles.
        return W4A16Config(bm, min(64, max_bn), k, 4, 4 if bm == 16 else 3, k_order="fragments",
                           n_tiles=14)
    if bm <= 32:
        order = "fragments" if fragments else "pairs"
        bk = _largest_dividing(k, 256)
        # 16-row tiles walk one expert's column tiles first: 0.957-0.986 of rows-first on every
        # draw of plan23 (EP8 gate_up T=8/20, down T=8/20, TP8 gate_up T=20/32/128, fused);
        # EP8's 16x128 gate_up tile lost once (T=32: 0.975 / 1.040) and keeps rows first
        cols = bm == 16
        if gated:  # one 128 x 256 weight tile per step (plan13: T=1 40.9 µs with 4 stages,
            # 45.5 with 3, 111.0 as 256 x 256; T=20 226.7, 232.6, 455.3)
            return W4A16Config(bm, min(64, max_bn), bk, 4, 4 if bm == 16 else 3, k_order=order,
                               columns_first=cols)
        if bm == 32:
            return W4A16Config(bm, min(128, max_bn), bk, 4, 3, k_order=order)
        # (TP8 from 2 to 4 rows per expert, T=128, the R128 tile below: 0.958-0.969, plan20)
        wide = (n <= 1024 and rows_per_expert >= 0.1 and not 2 <= rows_per_expert <= 4
                or k > n and rows_per_expert > 4)
        if fragments and wide:
            # TP8 gate_up (N = 512): T=8 44.4 -> 40.2 µs (plan6); at T=1 (0.02 rows per
            # expert, split-K) the 64-wide tile below gives twice the programs: 11.4 vs 13.1 µs.
            # EP8 gate_up from ~5 rows per expert (T=32): 0.975-0.981 of the R128 tile's time
            # (plan18-19, two draws); a tie at 3.3 rows (T=20), 1.04-1.06 at 1.3 (T=8).
            return W4A16Config(bm, min(128, max_bn), bk, 4, 4, k_order=order,
                               columns_first=n <= 1024)
        if fragments:  # 128 registers: 4 CTAs per SM instead of 3
            return W4A16Config(bm, min(64, max_bn), bk, 4, 3, k_order=order, max_registers=128,
                               columns_first=cols)
        return W4A16Config(bm, min(64, max_bn), bk, 4, 4, k_order=order, columns_first=cols)
    if not fragments:
        bn = min(64 if gated else 128, max_bn)
        if bm == 64 or gated:
            return W4A16Config(bm, bn, _largest_dividing(k, 64), num_warps=4, num_stages=4)
        return W4A16Config(bm, bn, _largest_dividing(k, 64), num_warps=8, num_stages=3)
    if gated:  # fused gate + up (one stacked weight tile): as the unfused gate_up tiles
        if bm == 64:  # plan4: T=256 480 vs 505 µs
            return W4A16Config(bm, min(128, max_bn), _largest_dividing(k, 64), 8, 3,
                               k_order="fragments")
        # 64-deep steps keep a wgmma group in flight (sm_90 SASS, scripts/kernel_lab/sass.py);
        # 128-deep steps wait for every wgmma
        if k % 512:
            # Wrong on the H200 at K = 2304 (NaN in most rows, as fragments and with small
            # scales alike; right at K = 2048, right as 128 x 128 x 64 or 128-deep x 3 stages,
            # and right under the interpreter): cause not found (session 19), so the 128-deep
            # steps that were right there
            return W4A16Config(bm, min(64, max_bn), _largest_dividing(k, 128), 4, 3,
                               k_order="fragments")
        return W4A16Config(bm, min(64, max_bn), _largest_dividing(k, 64), 4, 4,
                           k_order="fragments")
    if bm == 64 and k > n:
        # 64 x 256 x 64, 3 stages: 0.945 / 0.961 of 64 x 128 x 64 x 4 stages at TP8 gate_up
        # T=2048, 0.984-0.992 at EP8 T=256 (plan19, subnormal; 0.960-0.982 as fragments, plan17)
        return W4A16Config(bm, min(256, max_bn), _largest_dividing(k, 64), 4, 3,
                           k_order="fragments")
    if bm == 64 or k > n or subnormal and rows_per_expert <= 512:
        # 128 x 128 x 64, 4 warps, 4 stages won for gate_up (K = 7168 > N): 2046 vs 2070 µs at
        # T = 2048, 667 vs 699 at T = 512; for down (K = 2048 < N) too once the dequantization
        # is subnormal, up to a few hundred rows per expert (plan20, 3 draws: T=512 0.94-0.99
        # of the wide tile's time, T=1024 0.90-0.92, T=2048 0.935-0.938; T=8192, 1365 rows,
        # 1.04-1.05); as fragments the wide tile below won for down.
        return W4A16Config(bm, min(128, max_bn), _largest_dividing(k, 64), 4, 4,
                           k_order="fragments")
    return W4A16Config(bm, min(256, max_bn), _largest_dividing(k, 128), 8, 3, k_order="fragments")


def choose_row_tiles(rows_per_expert: float, n: int, k: int, *, interpret: bool = False,
                     gluon_experts: int = 0, num_sms: int = 132, gated: bool = False,
                     down: tuple[int, int] | None = None) -> tuple[int, ...]:
    """Row-tile sizes for ``align.moe_align_mixed``: ``(8,)``, the Gluon decode tile, where
    ``gluon_decode_applies``; ``(96,)``, the Gluon prefill tile, where
    ``gluon_prefill_applies`` (``(96, 32)`` for K > N up to 96 rows per expert: a remainder of
    up to 32 rows goes to the 32-row Triton tile; ``(128,)`` where ``gluon_prefill_rows``);
    ``(128, 64, 32)`` for K > N, ``(128, 64)`` otherwise, at 128-256 rows per expert; elsewhere
    the one ``choose_config`` block (64-row blocks then run the Gluon tile where
    ``gluon_prefill_64_applies``: ``choose_config``'s ``gluon``).

    :param gluon_experts: the local expert count when the Gluon tiles can run (an sm_90 GPU and
        subnormal weights: ``gluon_w4a16.gluon_ready``), else 0
    :param num_sms: the GPU's SM count (for the Gluon tile's grid rule)
    :param gated: the blocks serve a ``silu_mul`` GEMM (n: output features per half)
    :param down: ``(N, K)`` of a second GEMM on the same blocks (``fused_moe``'s down
        projection): a Gluon tile is taken only where it applies to that one too

    There two 128-row blocks hold 129-256 rows, up to half of them padding; a 64- (or 32-) row
    block for the remainder runs less padding, in one more launch. Measured on the H200
    (scripts/kernel_lab/mixed_tiles.py, 170 rows per expert): EP8 down T=1024 684.6 -> 618.7 µs
    (128 + 64), TP8 gate_up T=8192 1384.7 -> 1197.1 (128 + 64 + 32), EP8 gate_up T=1024 1297.3
    -> 1242.9; at 85 rows (64 + 32 instead of 128) and 341 rows it lost or tied, the smaller
    tiles costing more per row than the padding they save.

    At 85 rows per expert (EP8 T=512) a tenth of the experts hold more than 96 rows, a few
    more each, and their second 96-row block costs as much as a full one (the Gluon tile's time
    is mostly dequantization and weight reads, not wgmmas); a 32-row Triton block for those
    rows instead (one more launch, on a few experts): gate_up 0.92-0.93 of ``(96,)``'s time
    (fused 0.95-0.96), down 1.01-1.03 (its K = 2048 gives the extra launch less to hide
    behind), 171 rows (T=1024) 1.00-1.04 (scripts/kernel_lab/gluon_prefill.py
    ``PREFILL_MIXED``, session 19). Hence K > N and at most 96 rows per expert only.
    """
    if gluon_experts and not interpret:
        if (gluon_decode_applies(rows_per_expert, n, k, gluon_experts, num_sms, gated)
                and (down is None or _gluon_decode_fits(*down, False))):
            halve = (gluon_decode_halve_applies(rows_per_expert, n, k, gated)
                     and (down is None or gluon_decode_halve_applies(rows_per_expert, *down)))
            return (16,) if halve else (8,)
        if (gluon_prefill_applies(rows_per_expert, n, k, gated)
                and (down is None or gluon_prefill_applies(rows_per_expert, *down))):
            if k > n and rows_per_expert <= 96:
                return (96, 32)
            return (gluon_prefill_rows(rows_per_expert),)
    return _triton_row_tiles(rows_per_expert, n, k, interpret)


def _triton_row_tiles(rows_per_expert: float, n: int, k: int,
                      interpret: bool = False) -> tuple[int, ...]:
    """``choose_row_tiles`` without the Gluon tiles."""
    if interpret or not 128 < rows_per_expert <= 256:
        return (_block_m_for(rows_per_expert),)
    return (128, 64, 32) if k > n else (128, 64)


def choose_n_tiles(cfg: W4A16Config, blocks: int, n: int, num_sms: int) -> int:
    """Column tiles per program for the column-looping kernel: 14 for 16-row tiles, 28 for
    larger ones, fewer (a smaller divisor of the column tiles, at least 2) while the grid would
    hold under 1.5 programs per SM.

    Measured on TP8 down (plan9-12, 112 column tiles of 64): 16 rows: 14 beat 28 at T=8 (26.2
    vs 33.3 µs), T=20 (58.7 vs 71.3), T=32 (71.7 vs 79.7) and tied at T=128; 32-128 rows: 28
    beat 14 (T=1024 166 vs 173, T=2048 244 vs 255, T=8192 816 vs 853); 56 lost everywhere; at
    T=1 (8 blocks) 2-4 tiles (5.6-5.7 µs) against 14 (9.8).
    """
    tiles = -(-n // cfg.block_n)
    divisors = [d for d in range(2, tiles + 1) if tiles % d == 0]
    if not divisors:
        return 1
    want = 14 if cfg.block_m <= 16 else 28
    fitting = [d for d in divisors if d <= want] or divisors[:1]
    for per in reversed(fitting):
        if max(1, blocks) * (tiles // per) >= 1.5 * num_sms:
            return per
    return fitting[0]


def choose_gluon_n_tiles(blocks: int, rows_per_expert: float, n: int, k: int,
                         num_sms: int) -> int:
    """Column tiles per program for the Gluon 8-row tile (``n_tiles``) where K is one
    256-deep step (TP8 down): 2 while most experts hold one 8-row block, 7 where they hold
    two (their programs share the weights in L2), fewer only if that leaves under 1.5
    programs per SM; 1 (the K-looping tile) elsewhere.

    Measured on the H100 (variant 48, scripts/kernel_lab/decode_cols.py, same process), of
    the K-looping tile's time: 2 tiles 0.98 (T=1), 0.95 (T=8), 0.96 (T=20, 32), 0.95 (T=128),
    0.92 (T=256); 4, 7 and 14 tiles and 3-slot rings between 0.92 and 1.3. At 10.7 rows
    (T=512, two blocks an expert) 7 tiles 165.5 µs against 188.0 for 2 and 169.2 for 14.
    """
    tiles = n // GLUON_DECODE_TILE.block_n
    if k != 256 or tiles < 2:
        return 1
    want = 2 if rows_per_expert <= 8 else 7
    for per in range(min(want, tiles), 1, -1):
        if tiles % per == 0 and max(1, blocks) * (tiles // per) >= 1.5 * num_sms:
            return per
    return 1


# programs an SM of the stream-K Gluon decode tile: its register cap (128) fits 4, as the plain
# tile's 102 registers do
GLUON_STREAM_K_PER_SM = 4
# the expected grids (in waves of those slots) the 8-row tile runs stream-K at: pairs of
# bounds, lo, hi, lo, hi, .. (read at each call: `bench_kernels.py --alt` tries others)
GLUON_STREAM_K_WAVES = (0.9, 1.25)


def gluon_decode_waves(blocks: int, n: int, gated: bool, num_sms: int) -> float:
    """The 8-row Gluon tile's expected grid (``blocks`` busy 8-row blocks times column tiles)
    in waves of ``GLUON_STREAM_K_PER_SM`` programs an SM."""
    tiles = max(1, blocks) * n // (GLUON_DECODE_TILE.block_n // (2 if gated else 1))
    return tiles / (GLUON_STREAM_K_PER_SM * num_sms)


def choose_gluon_stream_k(blocks: int, n: int, k: int, gated: bool, num_sms: int) -> int:
    """``stream_k`` for the K-looping Gluon 8-row tile: ``GLUON_STREAM_K_PER_SM`` where the
    expected grid (``blocks`` busy 8-row blocks times column tiles) lies at the one-wave step,
    0.9 to 1.25 waves of program slots (``GLUON_STREAM_K_WAVES``); else 0 (one program a
    tile). There a draw that touches a few more experts than the mean leaves a few tiles to
    run alone in a second wave;
    the stream-K tile shares that thin wave out by K steps, and on a draw that fits one wave it
    runs one tile a program as the plain tile does.

    Measured (variants 50-51, ``scripts/kernel_lab/decode_split.py``, same process), TP8
    gate_up T=20 (~131 experts x 4 tiles against 528 slots): on a draw that spilled, the plain
    tile 91.3 µs against Humming's 74.1 (H200) and 115.5 against 98.1 (H100), stream-K 103.4
    (H100: 0.90 of plain); on one that fit, 92.3 plain, 93.4 stream-K, 90.5 Humming (H100).
    Further from the step it does not pay: TP8 T=32 (1.4 waves) 137.4 against 137.1 µs, EP8
    gate_up and down T=8-32 (2-4 waves) 0.97-1.07 of the plain tile's time (H100).
    """
    waves = gluon_decode_waves(blocks, n, gated, num_sms)
    step = k > 256 and any(lo <= waves <= hi for lo, hi in _bound_pairs(GLUON_STREAM_K_WAVES))
    return GLUON_STREAM_K_PER_SM if step else 0


def choose_gluon_split_k(blocks: int, n: int, k: int, gated: bool, num_sms: int) -> int:
    """``split_k`` for the K-looping Gluon 8-row tile: 2 where the expected grid is 1.25 to 1.6
    waves of program slots (past ``choose_gluon_stream_k``'s step) and K has 8+ steps, else 1.
    For the Kimi shapes that is TP8 gate_up at T=32 (~187 experts x 4 tiles, 1.4 waves).

    Measured on the H200 (variant 50, two draws, same process): 98.3 and 99.0 µs against the
    plain tile's 112.7 and 112.8 (0.87-0.88), Humming 100.3 and 100.1; 3 splits 0.89, 4 0.88.
    On the H100 3 splits took 0.98 of the plain tile's time on two draws, stream-K 1.00.
    EP8's grids (2+ waves) lost 1-10% to splits.
    """
    waves = gluon_decode_waves(blocks, n, gated, num_sms)
    return 2 if k >= 8 * 256 and 1.25 < waves <= 1.6 else 1


def choose_split_k(cfg: W4A16Config, tiles: int, k: int, num_sms: int) -> int:
    """Split-K factor for a grid of about ``tiles`` output tiles: none unless the grid leaves
    SMs idle (fewer tiles than SMs), then enough programs for about three per SM (decode tiles
    run 2-4 CTAs per SM), at least two K steps per split, at most 16.

    Splitting a grid of 1.8 tiles per SM (TP8 gate_up T=8: 236 tiles) cost 40.2 -> 59.2 µs
    (docs/performance.md §6); at 0.25 per SM (TP8 T=1: 32 tiles) it wins 12.0 -> 11.4 µs.
    """
    target = 3 * num_sms
    if tiles <= 0 or tiles >= num_sms:
        return 1
    steps = k // cfg.block_k
    split = 1
    while split < 16 and tiles * split < target and steps // (2 * split) >= 2:
        split *= 2
    return split
