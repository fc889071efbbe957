"""The Gluon prefill tile (chordq.kernels.gluon_prefill) on 128-, 96-, 64- and 32-row blocks:
its configs and heuristics, its sm_90 build (compiled on the CPU: warp-specialized, wgmma
with 64- and 32-row accumulators, words by TMA and the rest by cp.async into an mbarrier ring,
no spills), and on an sm_90 GPU its results against the PyTorch reference (``gpu``-marked)."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from chordq.kernels import moe_align_block_size
from chordq.kernels.triton_config import (GLUON_PREFILL_TILE, GLUON_PREFILL_TILE_32,
                                          GLUON_PREFILL_TILE_32_WIDE, GLUON_PREFILL_TILE_64,
                                          GLUON_PREFILL_TILE_64_WIDE, GLUON_PREFILL_TILE_128,
                                          GLUON_PREFILL_TILES, GLUON_PREFILL_WIDE_TILES,
                                          W4A16Config,
                                          choose_config, choose_gluon_prefill_wide,
                                          choose_row_tiles, gluon_prefill_32_applies,
                                          gluon_prefill_rows, gluon_prefill_64_applies,
                                          gluon_prefill_applies)
from test_kernels_gluon import (_problem, _sass, check_fused_moe_tile, check_graph_capture,
                                check_indexed_tile, fast_weights, needs_sm90)

SMEM_PER_BLOCK = 232448  # sm_90: the most shared memory one block can take

# ----------------------------------------------------------------------------- config


def test_prefill_tile_config_and_label():
    assert GLUON_PREFILL_TILE.label == "96,256,128,4,4,Z,G"
    assert choose_config(85.3, 4096, 7168, block_m=96, w_order="subnormal") == GLUON_PREFILL_TILE
    fused = choose_config(85.3, 2048, 7168, block_m=96, gated=True, w_order="subnormal")
    assert fused.block_n == 128  # output columns per half: still 256 weight rows
    for bad in ((96, 512, 128, 4, 3, "subnormal"), (96, 256, 128, 4, 3, "fragments"),
                (96, 256, 128, 8, 3, "subnormal"), (48, 256, 128, 4, 3, "subnormal")):
        with pytest.raises(ValueError, match="the prefill tile"):
            W4A16Config(*bad[:5], k_order=bad[5], backend="gluon")
    with pytest.raises(ValueError, match="block_m"):
        W4A16Config(96, 256, 128, 4, 3, k_order="subnormal")  # not a Triton tile
    with pytest.raises(ValueError, match="sm_90"):
        choose_config(85.3, 4096, 7168, block_m=96, w_order="subnormal", interpret=True)


def check_blocks_take_the_gluon_tile(rows, block_m, tile, shapes):
    """``choose_config`` on ``block_m``-row blocks at ``rows`` per expert: ``tile`` for each
    ``(N, K)`` of ``shapes`` given an sm_90 GPU and subnormal (or row-blocked) weights, fused
    SiLU-and-mul too (128 output columns a half); the Triton tile without such a GPU, on
    fragment-order weights or under the interpreter."""
    for (n, k), w_order in zip(shapes, itertools.cycle(("blocked", "subnormal"))):
        assert choose_config(rows, n, k, block_m=block_m, w_order=w_order,
                             gluon=True) == tile
    fused = choose_config(rows, 2048, 7168, block_m=block_m, gated=True, w_order="subnormal",
                          gluon=True)
    assert fused == dataclasses.replace(tile, block_n=128)
    for kw in ({"gluon": False}, {"w_order": "fragments"}, {"interpret": True}):
        args = {"block_m": block_m, "w_order": "subnormal", "gluon": True, **kw}
        assert choose_config(rows, 4096, 7168, **args).backend == "triton", kw


def test_128_row_tile_where_it_pads_no_more_rows():
    """128-row blocks take the Gluon tile (``GLUON_PREFILL_TILE_128``) where the Gluon tile
    applies and they pad no more rows than 96-row ones (``gluon_prefill_rows``); elsewhere
    (or without an sm_90 GPU, or on fragment weights) 128-row blocks are the Triton tile's."""
    assert GLUON_PREFILL_TILE_128.label == "128,256,128,4,3,Z,G"
    assert [gluon_prefill_rows(r) for r in (85.3, 100, 170.7, 250, 341.3, 1365.3)] == [
        96, 128, 96, 128, 128, 128]
    check_blocks_take_the_gluon_tile(341.3, 128, GLUON_PREFILL_TILE_128,
                                     ((4096, 7168), (7168, 2048)))
    assert choose_config(110.0, 4096, 7168, block_m=128, w_order="subnormal",
                         gluon=True) == GLUON_PREFILL_TILE_128  # 128 rows against 192
    # 170 rows pad 256 in 128-row blocks, 192 in 96-row ones; 150 rows (K > N) keep the
    # Triton tiles (128 + 32 rows against 192), 200 too (128 + 64 + 32 against 256): their
    # 128-row pieces stay Triton
    for rows in (170.7, 150.0, 200.0):
        assert choose_config(rows, 4096, 7168, block_m=128, w_order="subnormal",
                             gluon=True).backend == "triton"


def test_64_row_tile_where_it_won():
    """43 rows per expert (EP8 T=256, TP8 gate_up T=2048) on 64-row blocks: the Gluon tile
    given an sm_90 GPU (``gluon``) and subnormal weights, fused SiLU-and-mul too."""
    assert GLUON_PREFILL_TILE_64.label == "64,256,128,4,5,Z,G"
    check_blocks_take_the_gluon_tile(42.7, 64, GLUON_PREFILL_TILE_64,
                                     ((4096, 7168), (7168, 2048), (512, 7168)))
    assert choose_config(42.7, 4096, 7168, block_m=32, w_order="subnormal",
                         gluon=True).backend == "triton"
    # a 64-row remainder piece at 150 rows per expert keeps the Triton tile
    assert choose_config(150.0, 4096, 7168, block_m=64, w_order="subnormal",
                         gluon=True).backend == "triton"


def test_32_row_tile_where_the_32_row_triton_tile_ran():
    """17-32 rows per expert (EP8 T=128, TP8 gate_up T=1024: 21) on 32-row blocks: the Gluon
    prefill tile given an sm_90 GPU and subnormal weights, fused SiLU-and-mul too; TP8 down
    (K = 256) keeps the Triton tile. A Gluon 32-row config with 256-deep steps is the decode
    tile, with shallower ones the prefill tile (``W4A16Config.gluon_decode``)."""
    assert GLUON_PREFILL_TILE_32.label == "32,256,128,4,5,Z,G"
    assert GLUON_PREFILL_TILE_32_WIDE.label == "32,512,128,4,3,Z,G"
    assert not GLUON_PREFILL_TILE_32.gluon_decode
    assert W4A16Config(32, 128, 256, 4, 2, k_order="subnormal", backend="gluon").gluon_decode
    check_blocks_take_the_gluon_tile(21.3, 32, GLUON_PREFILL_TILE_32,
                                     ((4096, 7168), (7168, 2048), (512, 7168)))
    assert choose_config(21.3, 7168, 256, block_m=32, w_order="subnormal",
                         gluon=True).backend == "triton"  # TP8 down
    # a 32-row remainder piece under the 96-row tile (85 rows per expert) stays Triton
    assert choose_config(85.3, 4096, 7168, block_m=32, w_order="subnormal",
                         gluon=True).backend == "triton"
    assert gluon_prefill_32_applies(32.0, 4096, 7168)
    assert not gluon_prefill_32_applies(16.0, 4096, 7168)  # the 16-row Triton tile's rows
    assert not gluon_prefill_32_applies(21.3, 4096 + 128, 7168)
    assert choose_row_tiles(21.3, 4096, 7168, gluon_experts=48) == (32,)


def test_32_row_blocks_take_the_gluon_tile_in_its_wide_form_only(monkeypatch):
    """``indexed_config`` on an sm_90 GPU of 132 SMs (faked: host arithmetic only): 21 rows an
    expert take the wide Gluon 32-row tile for gate_up (EP8: 48 blocks x 16 column tiles, 3
    rounds against 6; TP8: 384 x 2), fused or not, and the Triton 32-row tile for EP8 down
    (48 x 28: 6 wide rounds against 11, so the 256-row form, which did not beat Triton)."""
    from chordq.kernels import triton_w4a16

    monkeypatch.setattr(triton_w4a16, "_gluon_usable", lambda device, w_order: True)
    monkeypatch.setattr(triton_w4a16, "_num_sms", lambda device: 132)

    def config(routes, e, n, k, **kw):
        return triton_w4a16.indexed_config(routes, e, n, k, 32, w_order="blocked",
                                           device="cuda", **kw)

    assert config(1024, 48, 4096, 7168) == GLUON_PREFILL_TILE_32_WIDE
    assert config(8192, 384, 512, 7168) == GLUON_PREFILL_TILE_32_WIDE
    assert config(1024, 48, 2048, 7168, activation="silu_mul") == dataclasses.replace(
        GLUON_PREFILL_TILE_32_WIDE, block_n=256)
    down = config(1024, 48, 7168, 2048)
    assert down == choose_config(21.3, 7168, 2048, block_m=32, w_order="blocked")
    assert down.backend == "triton"


def test_64_row_blocks_take_stream_k_in_the_256_row_form(monkeypatch):
    """``indexed_config`` on an sm_90 GPU of 132 SMs (faked: host arithmetic only) at 43 rows
    an expert: EP8 down takes the 256-row 64-row tile with stream-K (1344 tiles, 10.2 rounds:
    the device shares the last round), gate_up the wide form without it (not yet measured);
    a config given is launched as given."""
    from chordq.kernels import triton_config, triton_w4a16

    monkeypatch.setattr(triton_w4a16, "_gluon_usable", lambda device, w_order: True)
    monkeypatch.setattr(triton_w4a16, "_num_sms", lambda device: 132)

    def config(routes, e, n, k, **kw):
        return triton_w4a16.indexed_config(routes, e, n, k, 64, w_order="blocked",
                                           device="cuda", **kw)

    down = config(2048, 48, 7168, 2048)
    assert down == dataclasses.replace(GLUON_PREFILL_TILE_64, stream_k=1)
    assert down.label == "64,256,128,4,5,Z,K1,G"
    # the 32-bit walk (variant 64) where GLUON_PREFILL_STREAM_K_WALK32_ROWS holds the rows
    monkeypatch.setattr(triton_config, "GLUON_PREFILL_STREAM_K_WALK32_ROWS", (64,))
    assert config(2048, 48, 7168, 2048).label == "64,256,128,4,5,Z,K2,G"
    assert config(2048, 48, 4096, 7168) == GLUON_PREFILL_TILE_64_WIDE  # no stream-K: no walk
    monkeypatch.setattr(triton_config, "GLUON_PREFILL_STREAM_K_WALK32_ROWS", ())
    assert config(2048, 48, 4096, 7168) == GLUON_PREFILL_TILE_64_WIDE
    assert config(2048, 48, 7168, 2048, config=GLUON_PREFILL_TILE_64) == GLUON_PREFILL_TILE_64
    # the rows the heuristic reads at each call (scripts/bench_kernels.py --stream-k-rows)
    monkeypatch.setattr(triton_config, "GLUON_PREFILL_STREAM_K_ROWS", ())
    monkeypatch.setattr(triton_config, "GLUON_PREFILL_WIDE_STREAM_K_ROWS", (64,))
    assert config(2048, 48, 7168, 2048) == GLUON_PREFILL_TILE_64
    assert config(2048, 48, 4096, 7168) == dataclasses.replace(GLUON_PREFILL_TILE_64_WIDE,
                                                                stream_k=1)


def test_wide_64_row_tile_config():
    """The wide form (512 weight rows, 3 slots) is a 64- or 32-row tile only, and its stage
    count is the kernel's ring (``gluon_prefill.WIDE_STAGES``)."""
    assert GLUON_PREFILL_TILE_64_WIDE.label == "64,512,128,4,3,Z,G"
    W4A16Config(32, 512, 128, 4, 3, k_order="subnormal", backend="gluon")
    for bad in ((96, 512, 128, 4, 3), (64, 512, 128, 4, 4), (64, 1024, 128, 4, 3)):
        with pytest.raises(ValueError, match="the prefill tile"):
            W4A16Config(*bad, k_order="subnormal", backend="gluon")


def test_wide_form_where_it_takes_fewer_rounds():
    """``choose_gluon_prefill_wide`` at 43 rows per expert on 132 SMs: gate_up (EP8: 48
    blocks x 16 tiles; TP8: 384 x 2), plain or fused, in 3 rounds of wide tiles against 6;
    EP8 down (48 x 28 tiles) stays 256 rows (6 rounds against 11); N not in whole wide tiles
    stays too."""
    assert choose_gluon_prefill_wide(48, 4096, False, 132)
    assert choose_gluon_prefill_wide(48, 2048, True, 132)
    assert choose_gluon_prefill_wide(384, 512, False, 132)
    assert choose_gluon_prefill_wide(384, 256, True, 132)
    assert not choose_gluon_prefill_wide(48, 7168, False, 132)
    assert not choose_gluon_prefill_wide(48, 4096 + 256, False, 132)
    assert not choose_gluon_prefill_wide(48, 2048 + 128, True, 132)
    # one round either way: the wide tiles' 0.94 of two is 1.88 rounds' time
    assert not choose_gluon_prefill_wide(4, 4096, False, 132)


def test_stream_k_schedule_covers_each_tile_once_in_at_most_two_pieces():
    """The stream-K schedule (its host twin, ``gluon_prefill.stream_k_pieces``): every tile's
    K steps exactly once; whole tiles for the full rounds; a thin last round (under 80% full)
    and the round before it shared, each cut tile in two pieces at an even step (the scales'
    box covers a step pair) whose boundary slot both compute alike (``_consume_piece``), one
    cut tile a slot; no more pieces a program than its whole tiles and two. The piece with a
    cut tile's last steps is the first piece its program shares, the one with its first steps
    the last piece of its program: the second waits on the first's flag, and a first piece
    waits on nothing, so no program waits on one that waits."""
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels.gluon_prefill import stream_k_pieces

    shared_seen = 0
    for tiles in (1, 2, 3, 5, 7, 16, 129, 131, 133, 264, 300, 672, 768, 928, 1344):
        for programs in (1, 3, 7, 132):
            for steps in (2, 16, 56):
                plan = stream_k_pieces(tiles, programs, steps)
                covered = {t: [] for t in range(tiles)}
                for pid, pieces in enumerate(plan):
                    cuts = [p for p in pieces if p[2] < steps]
                    assert len(cuts) <= 2
                    for piece in cuts:
                        assert piece == (cuts[0] if piece[1] > 0 else pieces[-1])
                    for t, first, num in pieces:
                        assert first % 2 == 0 and num % 2 == 0 and num > 0
                        slot = pid if first > 0 else pid + 1
                        covered[t].append((first, num, slot))
                slots = []
                for t, parts in covered.items():
                    parts.sort()
                    assert sum(n for _, n, _ in parts) == steps, (tiles, programs, steps, t)
                    assert [f for f, _, _ in parts] == [0] + [f + n for f, n, _ in parts[:-1]]
                    assert len(parts) <= 2
                    if len(parts) == 2:  # cut: both pieces name the same boundary slot
                        assert parts[0][2] == parts[1][2]
                        slots.append(parts[0][2])
                        shared_seen += 1
                assert len(slots) == len(set(slots))  # one cut tile a boundary slot
                working = min(programs, tiles)
                if tiles % working and (tiles % working) * 5 < working * 4:
                    assert max(len(p) for p in plan) <= tiles // working + 2
                else:  # a full last round (or one): whole tiles only
                    assert all(n == steps for p in plan for _, _, n in p)
    assert shared_seen > 100


def test_gluon_prefill_64_applies():
    assert gluon_prefill_64_applies(42.7, 4096, 7168)
    assert gluon_prefill_64_applies(64.0, 7168, 2048)
    assert not gluon_prefill_64_applies(32.0, 4096, 7168)  # the 32-row tile's rows
    assert not gluon_prefill_64_applies(64.5, 4096, 7168)
    assert gluon_prefill_64_applies(42.7, 2048, 7168, gated=True)  # 128 outputs a tile
    assert gluon_prefill_64_applies(42.7, 256, 7168, gated=True)  # TP8: 512 weight rows
    assert not gluon_prefill_64_applies(42.7, 128, 7168, gated=True)
    assert not gluon_prefill_64_applies(42.7, 2048 + 64, 7168, gated=True)
    assert not gluon_prefill_64_applies(42.7, 4096 + 128, 7168)  # half a 256-row tile
    assert not gluon_prefill_64_applies(42.7, 7168, 256)  # TP8 down: K < 2048
    assert not gluon_prefill_64_applies(42.7, 4096, 7168 + 64)
    assert not gluon_prefill_64_applies(43, 4096, 7168 + 128)  # scales by TMA, two steps a box


def test_split_rows():
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels.gluon_prefill import split_rows

    assert split_rows(96) == (64, 32)
    assert split_rows(48) == (32, 16)
    assert split_rows(128) == (128, 0)
    for bad in (100, 112, 8):  # not a multiple of 16; three powers of two; too small
        with pytest.raises(ValueError):
            split_rows(bad)


@pytest.mark.parametrize("row, rows_per_expert, n, k, gated, down, want", [
    ("EP8 gate_up T=512: a 32-row remainder tile", 85.3, 4096, 7168, False, None, (96, 32)),
    ("EP8 down T=512", 85.3, 7168, 2048, False, None, (96,)),
    ("EP8 gate_up T=1024", 170.7, 4096, 7168, False, None, (96,)),
    ("fused EP8 T=512", 85.3, 2048, 7168, True, (7168, 2048), (96, 32)),
    ("EP8 T=256: 43 rows, lost", 42.7, 4096, 7168, False, None, (64,)),
    ("110 rows: one 128-row Gluon block", 110.0, 4096, 7168, False, None, (128,)),
    ("150 rows: 192 against 128 + 32", 150.0, 4096, 7168, False, None, (128, 64, 32)),
    ("150 rows, down: 192 against 128 + 64", 150.0, 7168, 2048, False, None, (96,)),
    ("200 rows: 288 against 224", 200.0, 4096, 7168, False, None, (128, 64, 32)),
    ("EP8 T=2048: 341 rows, 128-row blocks", 341.3, 4096, 7168, False, None, (128,)),
    ("fused EP8 T=2048", 341.3, 2048, 7168, True, (7168, 2048), (128,)),
    ("EP8 down T=8192: 1408 against 1440 rows", 1365.3, 7168, 2048, False, None, (128,)),
    ("EP8 T=3072: 512 rows, 4 x 128 against 6 x 96", 512.0, 4096, 7168, False, None, (128,)),
    ("300 rows: 384 against 384", 300.0, 7168, 2048, False, None, (128,)),
    ("270 rows: 384 against 288", 270.0, 7168, 2048, False, None, (96,)),
    ("TP8 gate_up T=8192: N=512", 170.7, 512, 7168, False, None, (96,)),
    ("TP8 gate_up T=2048: 43 rows", 42.7, 512, 7168, False, None, (64,)),
    ("fused TP8 T=8192: down K=256", 170.7, 256, 7168, True, (7168, 256), (128, 64, 32)),
])
def test_choose_row_tiles_takes_the_prefill_tile_where_it_won(row, rows_per_expert, n, k, gated,
                                                              down, want):
    assert choose_row_tiles(rows_per_expert, n, k, gluon_experts=48, gated=gated,
                            down=down) == want
    # without an sm_90 GPU (gluon_experts=0) or under the interpreter: the Triton tiles
    assert choose_row_tiles(rows_per_expert, n, k, gated=gated) != (96,)
    assert choose_row_tiles(rows_per_expert, n, k, interpret=True, gluon_experts=48) != (96,)


def test_gluon_prefill_applies_needs_whole_tiles_and_deep_k():
    assert gluon_prefill_applies(85.3, 4096, 7168)
    assert not gluon_prefill_applies(85.3, 4096 + 128, 7168)  # half a 256-row tile
    assert not gluon_prefill_applies(85.3, 256, 7168)  # N < 512
    assert gluon_prefill_applies(170.7, 256, 7168, gated=True)  # TP8 T=8192: 512 weight rows
    assert gluon_prefill_applies(85.3, 2048 + 128, 7168, gated=True)  # 128 per half
    assert not gluon_prefill_applies(85.3, 4096, 1024)  # K < 2048
    assert not gluon_prefill_applies(85.3, 4096, 7168 + 64)  # not whole 128-deep steps
    assert not gluon_prefill_applies(85.3, 4096, 7168 + 128)  # scales by TMA, two steps a box


# ----------------------------------------------------------------------------- sm_90 build


@pytest.mark.usefixtures("real_triton_compile")
@pytest.mark.parametrize("block_m, gated, accumulators, halves", [
    (96, False, {"64", "32"}, 1), (96, True, {"64", "32"}, 1), (64, False, {"64"}, 1),
    (64, True, {"64"}, 1), (64, False, {"64"}, 2), (64, True, {"64"}, 2),
    (128, False, {"128"}, 1), (128, True, {"128"}, 1), (32, False, {"32"}, 2),
    (32, True, {"32"}, 2)],
    ids=["96-plain", "96-silu_mul", "64-plain", "64-silu_mul", "wide-plain", "wide-silu_mul",
         "128-plain", "128-silu_mul", "32-wide-plain", "32-wide-silu_mul"])
def test_sm90_build_is_warp_specialized_wgmma_without_spills(block_m, gated, accumulators,
                                                             halves):
    """What the tile is, checked in its SASS: register reallocation between the loader and
    the consumer warpgroups (``setmaxnreg``), wgmmas on register A with 64- and 32-row
    accumulators (96-row blocks: ``HGMMA.64x64x16``, ``HGMMA.64x32x16``) or one 32-, 64- or
    128-row one (128 rows: a step in two parts, as many wgmmas as one 64-row accumulator),
    the words and scales by TMA (``UTMALDG``) and the X rows by cp.async, all signalling
    mbarriers, ldmatrix reads, and no local-memory spills. (Whether ptxas keeps a step's 32
    wgmmas in one group depends on the Triton: 3.6, on the H200, does; 3.9's build serializes
    them, C7511.)"""
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels import gluon_prefill

    tile = (GLUON_PREFILL_WIDE_TILES if halves == 2 else GLUON_PREFILL_TILES)[block_m]
    kernel = gluon_prefill.compile_sm90(block_m=block_m, gated=gated,
                                        num_stages=tile.num_stages, halves=halves)
    assert kernel.metadata.shared <= SMEM_PER_BLOCK
    sass = _sass(kernel)
    # a step's wgmmas: 2 x 8 k16 slices of 64 rows, per consumer half
    assert sass.count("HGMMA") == 2 * 16 * halves * len(accumulators)
    assert "USETMAXREG" in sass
    shapes = set(re.findall(r"HGMMA\.64x(\d+)x16\.F32\.BF16 R\d+, R\d+", sass))
    assert shapes == accumulators
    assert "UTMALDG" in sass
    assert "LDGSTS" in sass and "ARRIVES.LDGSTSBAR" in sass and "SYNCS" in sass
    assert "LDSM" in sass
    assert "STL" not in sass and "LDL" not in sass


@pytest.mark.usefixtures("real_triton_compile")
def test_wide_ring_is_as_deep_as_shared_memory_allows():
    """The wide form's slots hold twice the words and scales (56 KB at 128-deep steps): its
    3 slots fit an SM's shared memory and a fourth would not, so the launch refuses it."""
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels import gluon_prefill

    stages = gluon_prefill.WIDE_STAGES
    assert stages == GLUON_PREFILL_TILE_64_WIDE.num_stages == 3
    shared = gluon_prefill.compile_sm90(block_m=64, num_stages=stages, halves=2).metadata.shared
    assert shared <= SMEM_PER_BLOCK < shared * (stages + 1) // stages
    for block_m, more in ((64, stages + 1), (96, stages)):
        with pytest.raises(ValueError, match="wide"):
            gluon_prefill.compile_sm90(block_m=block_m, num_stages=more, halves=2)


@pytest.mark.usefixtures("real_triton_compile")
def test_128_row_ring_fits_shared_memory():
    """The 128-row form's 3 slots and its store's scratch fit an SM's shared memory; a
    fourth slot would not, so the launch refuses it with a one-line error."""
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels import gluon_prefill

    stages = gluon_prefill.ROWS128_STAGES
    assert stages == GLUON_PREFILL_TILE_128.num_stages == 3
    shared = gluon_prefill.compile_sm90(block_m=128, num_stages=stages).metadata.shared
    assert shared <= SMEM_PER_BLOCK < shared + 52 * 1024  # one more slot's words, scales, X
    with pytest.raises(ValueError, match="128-row"):
        gluon_prefill.compile_sm90(block_m=128, num_stages=stages + 1)


@pytest.mark.usefixtures("real_triton_compile")
@pytest.mark.parametrize("block_m, halves", [(64, 1), (64, 2), (128, 1)],
                         ids=["64", "wide", "128"])
def test_sm90_build_of_the_32_bit_stream_k_walk(block_m, halves):
    """``stream_k=2`` (variant 64) walks the schedule in 32 bits: no 64-bit division is left
    in its SASS (``I2F.U64``, ``F2I.U64``: the emulated one's first and last steps), where
    the 64-bit walk has them, and it is over 250 instructions shorter. The 256-row forms
    spill with neither walk; the wide form's stream-K build spills (Triton 3.6: 36 stores,
    3.9: 61), the 32-bit walk's less (12, 4)."""
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels import gluon_prefill

    tile = (GLUON_PREFILL_WIDE_TILES if halves == 2 else GLUON_PREFILL_TILES)[block_m]
    walk64, walk32 = (_sass(gluon_prefill.compile_sm90(
        block_m=block_m, num_stages=tile.num_stages, halves=halves, stream_k=sk))
        for sk in (1, 2))
    assert "I2F.U64" in walk64 and "F2I.U64" in walk64
    assert "I2F.U64" not in walk32 and "F2I.U64" not in walk32
    assert walk32.count("\n") < walk64.count("\n") - 250
    if halves == 1:
        assert "STL" not in walk32 and "LDL" not in walk32
    assert walk32.count("STL") < walk64.count("STL") or "STL" not in walk64


def test_32_bit_walk_bound():
    """``walk_fits_32_bits``: ``programs`` x (under two rounds of tiles x step pairs) under
    2^31, so it holds where the schedule shares under two rounds (``stream_k_shared``); every
    Kimi launch fits by 2^10. Where a launch would not, the launcher takes the 64-bit walk."""
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels.gluon_prefill import walk_fits_32_bits
    from chordq.kernels.triton_w4a16 import stream_k_shared

    assert walk_fits_32_bits(132, 7168 // 128) and 2 * 132 * 132 * 28 * 2**10 < 2**31
    assert walk_fits_32_bits(2**14, 2) and not walk_fits_32_bits(2**14, 16)
    for tiles in range(1, 800, 7):
        for programs in (1, 3, 132):
            working = min(programs, tiles)
            assert stream_k_shared(tiles, working) < 2 * working, (tiles, programs)


@pytest.mark.usefixtures("real_triton_compile")
def test_sm90_build_takes_turns_at_the_tensor_cores():
    """The shipped build (``gluon_prefill.ORDERED``) has each consumer wait for its turn
    before its wgmmas and hand the turn on after them: one more mbarrier wait and one more
    arrive per consumer than the build without turns (on Triton 3.6 the arrive sits between
    the last HGMMA and the wait for it; 3.9's serialized build waits first)."""
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels import gluon_prefill

    assert gluon_prefill.ORDERED
    turns = _sass(gluon_prefill.compile_sm90())
    plain = _sass(gluon_prefill.compile_sm90(order=False))

    def arrives(sass):
        return len(re.findall(r"SYNCS\.ARRIVE\.TRANS64\.A1T0", sass))

    def waits(sass):
        return len(re.findall(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT", sass))

    assert arrives(turns) == arrives(plain) + 2
    assert waits(turns) > waits(plain)


# ----------------------------------------------------------------------------- on the GPU


@pytest.mark.parametrize("w_order", ["blocked", "subnormal"])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize("e, n, k, m, top_k, local", [
    (4, 512, 2048, 100, 2, None),  # 16 K steps; 50 rows per expert: one partial 96-row block
    (3, 256, 256, 150, 2, None),  # 2 K steps (under the ring's 4 slots); 2 blocks, 1 partial
    (4, 512, 1024, 60, 4, 3),  # expert_map: a remote expert (id -1), its rows untouched
], ids=["16-steps", "2-steps", "remote"])
@needs_sm90
def test_prefill_tile_matches_the_reference(e, n, k, m, top_k, local, activation, w_order):
    cfg = choose_config(m * top_k / e, n // 2 if activation else n, k, block_m=96,
                        gated=activation is not None, w_order=w_order)
    check_indexed_tile(96, e, n, k, m, top_k, local, activation, config=cfg, w_order=w_order)


@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize("e, n, k, m, top_k, local", [
    (4, 512, 2048, 300, 2, None),  # 150 rows per expert: 8 blocks x 2 tiles over 3 programs
    (4, 512, 768, 300, 2, None),  # 6 K steps a tile: the ring wraps inside a tile
    (4, 512, 1024, 200, 4, 3),  # a remote expert's blocks skipped in the middle of the walk
], ids=["16-steps", "6-steps", "remote"])
@needs_sm90
def test_prefill_tile_walks_more_tiles_than_programs(monkeypatch, e, n, k, m, top_k, local,
                                                     activation):
    """The persistent launch (``gluon_prefill.PERSISTENT``) with 3 programs, as on a GPU with
    3 SMs: each walks several tiles, the ring's slots and the turns' phases carry across them."""
    from chordq.kernels import gluon_prefill

    monkeypatch.setattr(gluon_prefill, "_num_sms", lambda device: 3)
    assert gluon_prefill.PERSISTENT
    cfg = choose_config(m * top_k / e, n // 2 if activation else n, k, block_m=96,
                        gated=activation is not None, w_order="blocked")
    check_indexed_tile(96, e, n, k, m, top_k, local, activation, config=cfg)


@pytest.mark.parametrize("wide", [False, True], ids=["256-rows", "wide"])
@pytest.mark.parametrize("w_order", ["blocked", "subnormal"])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize("e, n, k, m, top_k, local", [
    (4, 1024, 2048, 100, 2, None),  # 16 K steps; 50 rows per expert: one partial 64-row block
    (3, 512, 256, 80, 2, None),  # 2 K steps (under the ring's slots); 53 rows per expert
    (4, 512, 2048, 60, 3, 3),  # expert_map: a remote expert (id -1), its rows untouched
], ids=["16-steps", "2-steps", "remote"])
@needs_sm90
def test_64_row_tile_matches_the_reference(monkeypatch, e, n, k, m, top_k, local, activation,
                                           w_order, wide):
    """The 64-row form (one accumulator, ``GLUON_PREFILL_TILE_64``) and its wide form (512
    weight rows, ``GLUON_PREFILL_TILE_64_WIDE``), persistent over 3 programs as on a GPU with
    3 SMs, so programs walk several tiles."""
    from chordq.kernels import gluon_prefill

    monkeypatch.setattr(gluon_prefill, "_num_sms", lambda device: 3)
    tile = GLUON_PREFILL_TILE_64_WIDE if wide else GLUON_PREFILL_TILE_64
    cfg = dataclasses.replace(tile, block_n=tile.block_n // (2 if activation else 1))
    check_indexed_tile(64, e, n, k, m, top_k, local, activation, config=cfg, w_order=w_order)


@pytest.mark.parametrize("w_order", ["blocked", "subnormal"])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize("block_m, e, n, k, m, top_k, local", [
    (128, 4, 1024, 2048, 200, 2, None),  # 16 K steps; 100 rows per expert: a partial block
    (128, 3, 512, 256, 400, 2, None),  # 2 K steps (under the ring's slots); 2 blocks an expert
    (128, 4, 512, 2048, 150, 3, 3),  # expert_map: a remote expert (id -1), its rows untouched
    (96, 4, 1024, 2048, 200, 2, None),  # 96 rows issued in two parts (the lab's k_split 2)
], ids=["128-16-steps", "128-2-steps", "128-remote", "96-two-parts"])
@needs_sm90
def test_k_split_tile_matches_the_reference(monkeypatch, block_m, e, n, k, m, top_k, local,
                                            activation, w_order):
    """The 128-row tile (``GLUON_PREFILL_TILE_128``: one 128-row accumulator, each step
    dequantized and issued in two 64-deep parts, ``gluon_prefill.k_split_of``), and the
    96-row tile issued in two parts, persistent over 3 programs as on a GPU with 3 SMs."""
    from chordq.kernels import gluon_prefill

    monkeypatch.setattr(gluon_prefill, "_num_sms", lambda device: 3)
    monkeypatch.setattr(gluon_prefill, "k_split_of", lambda block_m: 2)
    tile = GLUON_PREFILL_TILE_128 if block_m == 128 else GLUON_PREFILL_TILE
    cfg = dataclasses.replace(tile, block_n=tile.block_n // (2 if activation else 1))
    check_indexed_tile(block_m, e, n, k, m, top_k, local, activation, config=cfg,
                       w_order=w_order)


@pytest.mark.parametrize("walk", ["64", "32", "32-unfit"])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize("block_m, wide", [(96, False), (64, False), (64, True), (128, False)],
                         ids=["96", "64", "wide", "128"])
@needs_sm90
def test_stream_k_tile_matches_the_reference(monkeypatch, block_m, wide, activation, walk):
    """The stream-K schedule (``stream_k=1``) over 3 programs, as on a GPU with 3 SMs (the
    128-row form: each step in two parts, not yet run on a GPU when written): 4
    blocks x 4 column tiles (wide: 2) leave a last round of 1 (2) tile, so the last 4 (5)
    tiles are shared by K steps (16 steps, cut at pairs) and most of them cut in two, summed
    handed over through the stream-K buffers; twice, as the flags must be left zero (the next
    launch waits on them), and so must the buffers the stream's other stream-K kernels add
    into. ``walk`` "32": ``stream_k=2``, the schedule walked in 32 bits (variant 64, not yet
    run on a GPU when written); "32-unfit": the launcher's fallback to the 64-bit walk."""
    from chordq.kernels import gluon_prefill, triton_w4a16

    monkeypatch.setattr(gluon_prefill, "_num_sms", lambda device: 3)
    if walk == "32-unfit":
        monkeypatch.setattr(gluon_prefill, "walk_fits_32_bits", lambda programs, steps: False)
    tile = (GLUON_PREFILL_WIDE_TILES if wide else GLUON_PREFILL_TILES)[block_m]
    sk = 1 if walk == "64" else 2
    cfg = dataclasses.replace(tile, block_n=tile.block_n // (2 if activation else 1),
                              stream_k=sk)
    assert cfg.label.endswith(f",K{sk},G")
    for _ in range(2):
        check_indexed_tile(block_m, 4, 1024, 2048, 100, 2, None, activation, config=cfg,
                           w_order="blocked")
    assert triton_w4a16._stream_k_buffers_left_zero()
    assert any(use == "handover" for _, _, use in triton_w4a16._STREAM_K_BUFFERS)


@pytest.mark.parametrize("activation", [None, "silu_mul"])
@needs_sm90
def test_column_ranges_add_up_to_the_whole_gemm(monkeypatch, activation):
    """Two launches over column ranges (``columns``, not yet run on a GPU when written): the
    wide 64-row form over the first half of the output columns and the 256-row form over the
    rest make the whole GEMM (the descriptors and ``out`` start at the range), each persistent
    over 3 programs as on a GPU with 3 SMs."""
    from chordq.kernels import gluon_prefill

    monkeypatch.setattr(gluon_prefill, "_num_sms", lambda device: 3)
    gated = activation is not None
    n_w, top_k, m = 1024, 2, 100  # (2048 rows draw a scale of 0.51: not subnormal-safe)
    n_out = n_w // 2 if gated else n_w
    wide_n, narrow_n = (256, 128) if gated else (512, 256)  # output columns a tile

    def launch(x, w, s, aligned, out):
        grid_m = min(aligned[1].numel(), m * top_k)
        for lo, hi, block_n, stages in ((0, n_out // 2, wide_n, 3),
                                        (n_out // 2, n_out, narrow_n, 5)):
            gluon_prefill.moe_gemm_indexed_gluon_prefill(
                x, w, s, *aligned, top_k, out, num_routes=m * top_k, grid_m=grid_m,
                block_m=64, block_n=block_n, block_k=128, num_stages=stages, gated=gated,
                blocked=True, columns=(lo, hi))
        return out

    check_indexed_tile(64, 4, n_w, 2048, m, top_k, None, activation, w_order="blocked",
                       launch=launch)


@pytest.mark.parametrize("wide", [False, True], ids=["256-rows", "wide"])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@needs_sm90
def test_prefill_tile_on_32_row_blocks_matches_the_reference(monkeypatch, activation, wide):
    """The prefill tile on 32-row blocks (``GLUON_PREFILL_TILE_32`` and its wide form, variant
    60: at 17-32 rows an expert, where the 32-row Triton tile ran; not yet run on a GPU when
    written), through ``moe_gemm_indexed_triton``'s dispatch (a 32-row Gluon config with
    128-deep steps is the prefill tile), persistent over 3 programs: 20 rows an expert, one
    partial 32-row block each."""
    from chordq.kernels import gluon_prefill

    monkeypatch.setattr(gluon_prefill, "_num_sms", lambda device: 3)
    tile = GLUON_PREFILL_TILE_32_WIDE if wide else GLUON_PREFILL_TILE_32
    cfg = dataclasses.replace(tile, block_n=tile.block_n // (2 if activation else 1))
    check_indexed_tile(32, 4, 1024, 2048, 40, 2, None, activation, config=cfg,
                       w_order="blocked")


@needs_sm90
def test_indexed_heuristic_takes_the_64_row_tile_on_sm90():
    from chordq.kernels.triton_w4a16 import indexed_config

    assert indexed_config(2048, 48, 7168, 2048, 64, w_order="subnormal",
                          device="cuda") == dataclasses.replace(GLUON_PREFILL_TILE_64,
                                                                stream_k=1)  # EP8 down T=256
    # gate_up, fused or not: the wide form (16 column tiles of 48 blocks: 3 rounds, not 6)
    assert indexed_config(2048, 48, 2048, 7168, 64, activation="silu_mul", w_order="subnormal",
                          device="cuda") == dataclasses.replace(GLUON_PREFILL_TILE_64_WIDE,
                                                                block_n=256)
    assert indexed_config(2048, 48, 4096, 7168, 64, w_order="blocked",
                          device="cuda") == GLUON_PREFILL_TILE_64_WIDE
    assert indexed_config(2048, 48, 7168, 2048, 64, w_order="fragments",
                          device="cuda").backend == "triton"


@needs_sm90
def test_indexed_heuristic_takes_the_32_row_tile_on_sm90():
    from chordq.kernels.triton_w4a16 import indexed_config

    # 21 rows an expert: EP8 down T=128 (28 column tiles of 48 blocks: 11 rounds, wide 6)
    # keeps the Triton tile, which the 256-row form did not beat
    assert indexed_config(1024, 48, 7168, 2048, 32, w_order="blocked",
                          device="cuda").backend == "triton"
    # gate_up, EP8 and TP8: the wide form (3 rounds, not 6)
    assert indexed_config(1024, 48, 4096, 7168, 32, w_order="blocked",
                          device="cuda") == GLUON_PREFILL_TILE_32_WIDE
    assert indexed_config(8192, 384, 512, 7168, 32, w_order="blocked",
                          device="cuda") == GLUON_PREFILL_TILE_32_WIDE
    assert indexed_config(8192, 384, 7168, 256, 32, w_order="blocked",
                          device="cuda").backend == "triton"  # TP8 down


@needs_sm90
def test_fused_moe_at_21_rows_takes_the_32_row_tiles():
    # 21 rows per expert: gate_up (fused SiLU-and-mul) in the wide Gluon 32-row tile, down
    # (8 column tiles of 16 blocks: one round either way) in the Triton one
    check_fused_moe_tile(16, 2048, 2048, 42, 3, (32,))


@needs_sm90
def test_fused_moe_at_43_rows_takes_both_64_row_tiles():
    # 43 rows per expert: gate_up (fused SiLU-and-mul) and down in the Gluon 64-row tile
    check_fused_moe_tile(16, 2048, 2048, 86, 3, (64,))


@needs_sm90
def test_fused_moe_prefill_takes_the_prefill_tile():
    check_fused_moe_tile(8, 2048, 2048, 85, 5, (96,))  # 85 rows per expert, as EP8 T=512


@needs_sm90
def test_fused_moe_prefill_takes_a_remainder_tile_where_k_exceeds_n():
    # 85 rows per expert on average, one expert 103 (seed 2): 96 in the Gluon tile, 7 in a
    # 32-row Triton block, for both GEMMs
    check_fused_moe_tile(16, 2304, 2048, 170, 2, (96, 32))


@needs_sm90
def test_prefill_tile_is_cuda_graph_capturable():
    from chordq.kernels import moe_gemm_indexed_triton

    w, s, x, topk = _problem(4, 512, 2048, 100, 2)
    aligned = moe_align_block_size(topk, 96, 4)
    wf, sf = fast_weights(w, s, 2048, "blocked")
    cfg = choose_config(50, 512, 2048, block_m=96, w_order="blocked")
    check_graph_capture(lambda: moe_gemm_indexed_triton(x, wf, sf, *aligned, 2, 96, config=cfg,
                                                        w_order="blocked"))
