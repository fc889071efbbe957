"""The Gluon 8-row decode tile (chordq.kernels.gluon_w4a16): its config and heuristic, its sm_90
build (compiled on the CPU, no GPU: mma.sync, ldmatrix, cp.async, no wgmma, no spills), and on
an sm_90 GPU its results against the PyTorch reference (``gpu``-marked)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

from chordq.kernels import moe_align_block_size, moe_gemm_indexed_reference
from chordq.kernels.reference import cos_diff
from chordq.kernels.triton_config import (GLUON_DECODE_TILE, W4A16Config, choose_config,
                                          choose_row_tiles, gluon_decode_applies)
from chordq.layout import fragment_order, pack_codes, row_blocks, subnormal_scales

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
MAX_COS_DIFF = 1e-5  # FP32 accumulation of the reference's exact BF16 weights; ~1e-8 seen


# ----------------------------------------------------------------------------- config


def test_gluon_tile_config_and_label():
    assert GLUON_DECODE_TILE.label == "8,128,256,4,2,Z,G"
    with pytest.raises(ValueError, match="the decode tile"):
        W4A16Config(8, 128, 128, 4, 2, k_order="subnormal", backend="gluon")
    with pytest.raises(ValueError, match="the decode tile"):
        W4A16Config(8, 128, 256, 4, 2, k_order="fragments", backend="gluon")
    with pytest.raises(ValueError, match="block_m"):
        W4A16Config(8, 128, 256, 4, 2, k_order="subnormal")  # triton tiles start at 16
    with pytest.raises(ValueError, match="backend"):
        W4A16Config(backend="cuda")
    cols = W4A16Config(8, 128, 256, 4, 3, k_order="subnormal", n_tiles=7, backend="gluon")
    assert cols.label == "8,128,256,4,3,Z,L7,G"
    with pytest.raises(ValueError, match="2\\+ stages"):
        W4A16Config(8, 128, 256, 4, 1, k_order="subnormal", n_tiles=7, backend="gluon")
    with pytest.raises(ValueError, match="no n_tiles"):
        W4A16Config(96, 256, 128, 4, 4, k_order="subnormal", n_tiles=2, backend="gluon")
    assert choose_config(0.2, 4096, 7168, block_m=8, w_order="subnormal") == GLUON_DECODE_TILE
    with pytest.raises(ValueError, match="sm_90"):
        choose_config(0.2, 4096, 7168, block_m=8, w_order="fragments")
    with pytest.raises(ValueError, match="sm_90"):
        choose_config(0.2, 4096, 7168, block_m=8, w_order="subnormal", interpret=True)


@pytest.mark.parametrize("row, rows_per_expert, n, k, experts, gated, want", [
    ("EP8 gate_up T=1", 8 / 48, 4096, 7168, 48, False, (8,)),
    ("EP8 gate_up T=32", 256 / 48, 4096, 7168, 48, False, (8,)),
    ("EP8 down T=20", 160 / 48, 7168, 2048, 48, False, (8,)),
    ("EP8 gate_up T=128: 21 rows, 3 blocks", 1024 / 48, 4096, 7168, 48, False, (32,)),
    ("TP8 gate_up T=1: 32 tiles", 8 / 384, 512, 7168, 384, False, (16,)),
    ("TP8 gate_up T=8", 64 / 384, 512, 7168, 384, False, (8,)),
    ("TP8 gate_up T=512: 10.7 rows", 4096 / 384, 512, 7168, 384, False, (16,)),
    ("TP8 down T=1", 8 / 384, 7168, 256, 384, False, (8,)),
    ("TP8 down T=512: one K step, 10.7 rows", 4096 / 384, 7168, 256, 384, False, (8,)),
    ("TP8 down T=1024: 21 rows", 8192 / 384, 7168, 256, 384, False, (32,)),
    ("fused EP8 T=1: 64-column tiles", 8 / 48, 2048, 7168, 48, True, (8,)),
    ("fused TP8 T=1", 8 / 384, 256, 7168, 384, True, (16,)),
    ("K not a multiple of 256", 0.5, 4096, 7168 + 32, 48, False, (16,)),
])
def test_choose_row_tiles_takes_the_gluon_tile_where_it_won(row, rows_per_expert, n, k, experts,
                                                            gated, want):
    assert choose_row_tiles(rows_per_expert, n, k, gluon_experts=experts, gated=gated) == want
    # without an sm_90 GPU (gluon_experts=0) or under the interpreter: the Triton tiles
    assert choose_row_tiles(rows_per_expert, n, k, gated=gated) != (8,)
    assert choose_row_tiles(rows_per_expert, n, k, interpret=True, gluon_experts=experts) != (8,)


def test_halved_16_row_blocks_config_and_heuristic(monkeypatch):
    """``W4A16Config.halve`` (variant 63) is the Gluon decode tile on 16-row blocks only; the
    heuristic takes it where ``GLUON_DECODE_HALVE_RPE`` (empty: off) holds the rows per
    expert, for K over one step and for both GEMMs of ``fused_moe``'s blocks."""
    from chordq.kernels import triton_config

    halved = W4A16Config(16, 128, 256, 4, 2, k_order="subnormal", backend="gluon", halve=True)
    assert halved.label == "16,128,256,4,2,Z,H,G" and halved.gluon_decode
    for bad in ({"block_m": 8}, {"split_k": 2}, {"backend": "triton", "block_m": 16}):
        kw = {"block_m": 16, "k_order": "subnormal", "backend": "gluon", "halve": True, **bad}
        with pytest.raises(ValueError, match="halve"):
            W4A16Config(block_n=128, block_k=256, num_warps=4, num_stages=2, **kw)
    tp8_t256, tp8_t128 = 2048 / 384, 1024 / 384
    gate_up, down, tp8_down = (512, 7168), (7168, 2048), (7168, 256)
    assert choose_row_tiles(tp8_t256, *gate_up, gluon_experts=384) == (8,)  # off by default
    assert choose_config(tp8_t256, *gate_up, block_m=16, w_order="subnormal",
                         gluon=True).backend == "triton"
    monkeypatch.setattr(triton_config, "GLUON_DECODE_HALVE_RPE", (4.0, 6.0))
    assert choose_row_tiles(tp8_t256, *gate_up, gluon_experts=384) == (16,)
    assert choose_row_tiles(tp8_t128, *gate_up, gluon_experts=384) == (8,)  # out of range
    assert choose_row_tiles(tp8_t256, *tp8_down, gluon_experts=384) == (8,)  # one K step
    assert choose_row_tiles(tp8_t256, 256, 7168, gluon_experts=384, gated=True,
                            down=tp8_down) == (8,)  # fused TP8: its down GEMM has one step
    assert choose_row_tiles(256 / 48, 2048, 7168, gluon_experts=48, gated=True,
                            down=down) == (16,)  # fused EP8 T=32
    assert choose_config(tp8_t256, *gate_up, block_m=16, w_order="subnormal",
                         gluon=True) == halved
    assert choose_config(tp8_t256, *gate_up, block_m=16, w_order="subnormal").backend == "triton"
    assert choose_config(tp8_t256, *gate_up, block_m=16, w_order="subnormal", gluon=True,
                         interpret=True).backend == "triton"


@pytest.mark.parametrize("blocks, rows, n, k, want", [
    (360, 2.7, 7168, 256, 2),  # TP8 down T=128: one block an expert
    (8, 0.02, 7168, 256, 2),  # T=1: 8 blocks x 28 programs, 1.7 per SM
    (768, 10.7, 7168, 256, 7),  # T=512: two blocks an expert
    (1, 0.02, 7168, 256, 1),  # one block: 56 programs, under 1.5 per SM even at 1
    (360, 2.7, 7168, 2048, 1),  # K-looping shapes keep the K loop
])
def test_choose_gluon_n_tiles(blocks, rows, n, k, want):
    from chordq.kernels.triton_config import choose_gluon_n_tiles

    assert choose_gluon_n_tiles(blocks, rows, n, k, 132) == want


@pytest.mark.parametrize("blocks, n, k, gated, want", [
    (59, 512, 7168, False, 0),  # TP8 gate_up T=8: 236 tiles, under a wave of 528 slots
    (131, 512, 7168, False, 4),  # T=20: 524 tiles, at the step
    (131, 256, 7168, True, 4),  # fused: 64 output columns a tile, the same grid
    (187, 512, 7168, False, 0),  # T=32: 748 tiles, 1.4 waves
    (35, 7168, 2048, False, 0),  # EP8 down T=8: 1960 tiles, 3.7 waves
    (7, 4096, 7168, False, 0),  # EP8 gate_up T=1: 224 tiles
    (131, 7168, 256, False, 0),  # one K step: the column-looping tile's
])
def test_choose_gluon_stream_k(blocks, n, k, gated, want):
    from chordq.kernels.triton_config import choose_gluon_stream_k

    assert choose_gluon_stream_k(blocks, n, k, gated, 132) == want


def test_gluon_stream_k_waves_are_read_at_each_call(monkeypatch):
    """``GLUON_STREAM_K_WAVES``: pairs of bounds (``bench_kernels.py --alt`` sets others)."""
    from chordq.kernels import triton_config

    ep8_t8 = (41, 4096, 7168, False, 132)  # 1312 tiles: 2.48 waves
    assert triton_config.choose_gluon_stream_k(*ep8_t8) == 0
    monkeypatch.setattr(triton_config, "GLUON_STREAM_K_WAVES", (0.9, 1.25, 2.3, 2.6))
    assert triton_config.choose_gluon_stream_k(*ep8_t8) == 4
    assert triton_config.choose_gluon_stream_k(131, 512, 7168, False, 132) == 4  # still
    monkeypatch.setattr(triton_config, "GLUON_STREAM_K_WAVES", ())
    assert triton_config.choose_gluon_stream_k(131, 512, 7168, False, 132) == 0


@pytest.mark.parametrize("blocks, n, k, gated, want", [
    (187, 512, 7168, False, 2),  # TP8 gate_up T=32: 748 tiles, 1.4 waves
    (187, 256, 7168, True, 2),  # fused
    (131, 512, 7168, False, 1),  # T=20: the stream-K step
    (360, 512, 7168, False, 1),  # T=128: 2.7 waves
    (187, 512, 1024, False, 1),  # 4 K steps: too few to share
])
def test_choose_gluon_split_k(blocks, n, k, gated, want):
    from chordq.kernels.triton_config import choose_gluon_split_k

    assert choose_gluon_split_k(blocks, n, k, gated, 132) == want


def test_gluon_decode_applies_needs_a_full_grid():
    assert gluon_decode_applies(1 / 6, 4096, 7168, 48, 132)  # 8 experts x 32 tiles = 256
    assert not gluon_decode_applies(1 / 6, 4096, 7168, 48, 264)  # same grid, twice the SMs
    assert not gluon_decode_applies(0.0, 4096, 7168, 48, 132)


# ----------------------------------------------------------------------------- sm_90 build


def _compile_sm90(gated: bool, **kw):
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels import gluon_w4a16

    return gluon_w4a16.compile_sm90(gated=gated, **kw)


def _sass(kernel) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    if not os.path.exists(tool):
        pytest.skip("this Triton wheel ships no nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


@pytest.mark.usefixtures("real_triton_compile")
@pytest.mark.parametrize("block_m", [8, 16, 32])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "silu_mul"])
def test_sm90_build_is_an_mma_sync_loop_without_spills(gated, block_m):
    """What makes the tile fast, checked in its SASS: per 256-deep K step and warp 32
    ``HMMA.16816`` per 8 token rows (2 m16 slices x 16 k16 slices), ldmatrix reads from shared
    memory, cp.async copies; no wgmma, and no local-memory spills."""
    sass = _sass(_compile_sm90(gated, block_m=block_m))
    assert sass.count("HMMA.16816.F32.BF16") == 32 * block_m // 8
    assert "LDSM" in sass and "LDGSTS" in sass
    assert "WARPGROUP" not in sass and "HGMMA" not in sass
    assert "STL" not in sass and "LDL" not in sass


@pytest.mark.usefixtures("real_triton_compile")
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "silu_mul"])
def test_sm90_build_of_the_stream_k_tile(gated):
    """The stream-K form under the cap for 4 programs an SM (128 registers): the K loop twice
    (whole tiles, then the shared wave: 64 ``HMMA.16816``), atomics for cut tiles, no spills."""
    sass = _sass(_compile_sm90(gated, stream_k=4))
    assert sass.count("HMMA.16816.F32.BF16") == 64
    assert "RED" in sass or "ATOM" in sass
    assert "STL" not in sass and "LDL" not in sass


@pytest.mark.usefixtures("real_triton_compile")
def test_sm90_build_of_the_column_looping_tile():
    """The column-looping form (K = 256): one tile's 32 ``HMMA.16816`` per loop trip, X read
    from shared memory once (before the loop), no spills."""
    sass = _sass(_compile_sm90(False, n_tiles=7, num_stages=3))
    assert sass.count("HMMA.16816.F32.BF16") == 32
    assert "LDGSTS" in sass and "WARPGROUP" not in sass
    assert "STL" not in sass and "LDL" not in sass


@pytest.mark.usefixtures("real_triton_compile")
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "silu_mul"])
def test_sm90_build_of_the_halved_16_row_tile(gated):
    """``halve``: the 16-row K loop (64 ``HMMA.16816``) and the 8-row one (32) in one build,
    no spills."""
    sass = _sass(_compile_sm90(gated, block_m=16, halve=True))
    assert sass.count("HMMA.16816.F32.BF16") == 64 + 32
    assert "STL" not in sass and "LDL" not in sass


def test_halve_needs_16_row_blocks_without_split_or_stream_k():
    pytest.importorskip("triton.experimental.gluon")
    from chordq.kernels.gluon_w4a16 import moe_gemm_indexed_gluon

    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(1, 128, 32, dtype=torch.int32)
    for kw in ({"block_m": 8}, {"block_m": 16, "split_k": 2}, {"block_m": 16, "stream_k": 4}):
        with pytest.raises(ValueError, match="halve runs 16-row blocks"):
            moe_gemm_indexed_gluon(x, w, None, None, None, None, 1, None, num_routes=1,
                                   grid_m=1, block_n=128, num_warps=4, num_stages=2,
                                   gated=False, halve=True, **kw)


def test_gluon_backend_is_refused_off_the_gpu():
    from chordq.kernels import moe_gemm_indexed_triton

    e, n, k = 2, 128, 256
    w = pack_codes(torch.randint(0, 16, (e, n, k)))
    s = torch.full((e, n, k // 32), 0.01, dtype=torch.bfloat16)
    x = torch.randn(3, k).to(torch.bfloat16)
    ids, experts, ntp = moe_align_block_size(torch.tensor([[0], [1], [0]]), 8, e)
    with pytest.raises(ValueError, match="sm_90 GPU"):
        moe_gemm_indexed_triton(x, fragment_order(w), subnormal_scales(s), ids, experts, ntp, 1,
                                8, config=GLUON_DECODE_TILE, w_order="subnormal")


# ----------------------------------------------------------------------------- on the GPU

def needs_sm90(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")(fn))


def _problem(e, n, k, m, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = pack_codes(torch.randint(0, 16, (e, n, k), generator=g))
    s = (0.02 * torch.exp2(torch.randn(e, n, k // 32, generator=g))).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)]).int()
    return w.cuda(), s.cuda(), x.cuda(), topk.cuda()


def fast_weights(w, s, k, w_order):
    """Checkpoint words and scales of a ``k``-deep weight -> ``w_order`` ``"subnormal"`` or
    ``"blocked"`` (the same in ``chordq.layout.row_blocks``)."""
    wf, sf = fragment_order(w), subnormal_scales(s)
    if w_order == "blocked":
        return row_blocks(wf, k), row_blocks(sf, k)
    return wf, sf


def check_indexed_tile(block, e, n, k, m, top_k, local, activation, config=None,
                       w_order="blocked", launch=None):
    """The indexed GEMM on ``block``-row blocks (``config``, or the heuristic's for that block;
    or ``launch(x, w, s, aligned, out)`` with the ``w_order`` weights) against the reference
    on the rows it owns; the rows it does not own stay as they were.
    ``local``: only the first ``local`` experts are on this GPU (the others: expert id -1)."""
    from chordq.kernels import moe_gemm_indexed_triton

    w, s, x, topk = _problem(e, n, k, m, top_k)
    expert_map = None
    if local is not None:
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[:local] = torch.arange(local, dtype=torch.int32)
        expert_map = expert_map.cuda()
    aligned = moe_align_block_size(topk, block, e, expert_map)
    rows = m * top_k
    n_out = n // 2 if activation else n
    if local is not None:  # the local experts' weights only
        w, s = w[:local], s[:local]
    want = moe_gemm_indexed_reference(x, w, s, *aligned, top_k, block, activation=activation)
    out = torch.full((rows, n_out), 7.0, dtype=torch.bfloat16, device="cuda")
    if launch is None:
        got = moe_gemm_indexed_triton(x, *fast_weights(w, s, k, w_order), *aligned, top_k,
                                      block, activation=activation, out=out, config=config,
                                      w_order=w_order)
    else:
        got = launch(x, *fast_weights(w, s, k, w_order), aligned, out)
    owned = (aligned[0][: int(aligned[2])] < rows) & (
        aligned[1][: int(aligned[2]) // block].repeat_interleave(block) >= 0)
    owned_rows = aligned[0][: int(aligned[2])][owned].long()
    mask = torch.zeros(rows, dtype=torch.bool, device="cuda")
    mask[owned_rows] = True
    assert cos_diff(got[mask], want[mask]) < MAX_COS_DIFF
    assert bool((got[~mask] == 7.0).all())  # rows the tile does not own are left as they were


def check_fused_moe_tile(e, h, i, m, seed, tiles):
    """``fused_moe`` on a problem whose row tiles are ``tiles`` (asserted, as ``fused_moe``
    asks for them) against the reference. Scales small enough for
    the subnormal weights (asserted), which the Gluon tiles need: with larger ones
    ``prepare_weights`` falls back to fragment order and the Triton tiles."""
    from chordq.kernels import fused_moe, fused_moe_reference, prepare_weights, route
    from chordq.kernels.triton_w4a16 import row_tiles

    g = torch.Generator().manual_seed(seed)
    w13 = pack_codes(torch.randint(0, 16, (e, 2 * i, h), generator=g)).cuda()
    s13 = (0.005 * torch.exp2(torch.randn(e, 2 * i, h // 32, generator=g))).bfloat16().cuda()
    w2 = pack_codes(torch.randint(0, 16, (e, h, i), generator=g)).cuda()
    s2 = (0.005 * torch.exp2(torch.randn(e, h, i // 32, generator=g))).bfloat16().cuda()
    x = torch.randn(m, h, generator=g).bfloat16().cuda()
    logits = torch.randn(m, e, generator=g).cuda()
    topk_w, topk_ids = route(logits, torch.zeros(e, device="cuda"), 8, 2.5)
    assert row_tiles(m * 8 / e, i, h, e, x.device, "blocked", gated=True,
                     down=(h, i)) == tiles
    want = fused_moe_reference(x, w13, s13, w2, s2, topk_w, topk_ids)
    *weights, w_order = prepare_weights(w13, s13, w2, s2)
    assert w_order == "blocked"
    got = fused_moe(x, *weights, topk_w, topk_ids, w_order=w_order)
    assert cos_diff(got, want) < MAX_COS_DIFF


def check_graph_capture(run):
    """``run()`` captured in a CUDA graph and replayed gives what it gives eagerly."""
    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("w_order", ["blocked", "subnormal"])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize("e, n, k, m, top_k, local", [
    (6, 256, 512, 5, 4, None),  # two K steps, two column tiles, 1-3 rows per expert
    (8, 384, 256, 20, 8, None),  # one K step (TP8 down's K), blocks of 8 full and partial
    (6, 256, 768, 7, 4, 4),  # expert_map: two remote experts (expert id -1), their rows untouched
], ids=["2-steps", "1-step", "remote"])
@needs_sm90
def test_gluon_tile_matches_the_reference(e, n, k, m, top_k, local, activation, w_order):
    check_indexed_tile(8, e, n, k, m, top_k, local, activation, w_order=w_order)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize("e, n, k, m, top_k, local", [
    (4, 256, 512, 40, 4, None),  # 40 rows an expert: 16-row blocks full and partial
    (6, 256, 768, 30, 4, 4),  # remote experts: their rows untouched
], ids=["2-steps", "remote"])
@needs_sm90
def test_gluon_tile_on_16_and_32_row_blocks(e, n, k, m, top_k, local, activation, block_m):
    """Token rows past 8 are further n8 fragments of the same dequantized weights."""
    config = W4A16Config(block_m, 128, 256, 4, 2, k_order="subnormal", backend="gluon")
    check_indexed_tile(block_m, e, n, k, m, top_k, local, activation, config=config)


@pytest.mark.parametrize("split_k, max_registers", [(2, None), (3, None), (1, 96)])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@needs_sm90
def test_gluon_tile_split_k_and_register_cap(split_k, max_registers, activation):
    """Split K (FP32 partials, the Triton reduce kernel finishes) and a register cap give the
    reference's results; with remote experts, whose rows stay untouched."""
    from chordq.kernels.gluon_w4a16 import moe_gemm_indexed_gluon

    def launch(x, w, s, aligned, out):
        return moe_gemm_indexed_gluon(
            x, w, s, *aligned, 4, out, num_routes=out.shape[0], grid_m=int(aligned[2]) // 8,
            block_n=128, num_warps=4, num_stages=2, gated=activation is not None, blocked=True,
            split_k=split_k, max_registers=max_registers)

    # 7 K steps: splits of 4 + 3 and 3 + 3 + 1
    check_indexed_tile(8, 6, 256, 1792, 9, 4, 4, activation, launch=launch)


@pytest.mark.parametrize("activation", [None, "silu_mul"])
@needs_sm90
def test_gluon_tile_halved_16_row_blocks(activation):
    """``halve``: 16-row blocks of up to 8 routes run as 8-row ones, fuller ones as 16; both
    give the reference's results, and remote experts' rows stay untouched."""
    from chordq.kernels.gluon_w4a16 import moe_gemm_indexed_gluon

    def launch(x, w, s, aligned, out):
        ids, experts, ntp = aligned
        valid = (ids[: int(ntp)].view(-1, 16) < out.shape[0]).sum(1)[experts[: int(ntp) // 16] >= 0]
        assert bool((valid <= 8).any()) and bool((valid > 8).any())  # both paths run
        return moe_gemm_indexed_gluon(
            x, w, s, *aligned, 4, out, num_routes=out.shape[0], grid_m=int(ntp) // 16,
            block_n=128, num_warps=4, num_stages=2, gated=activation is not None, blocked=True,
            block_m=16, halve=True)

    # 12 tokens of top-4 over 6 experts, 4 of them local: 6, 10, 7 and 9 routes
    check_indexed_tile(16, 6, 256, 1792, 12, 4, 4, activation, launch=launch)


@pytest.mark.parametrize("activation", [None, "silu_mul"])
@needs_sm90
def test_halved_config_through_the_indexed_entry(activation):
    """``moe_gemm_indexed_triton`` hands ``halve`` to the tile (16-row blocks, both paths)."""
    config = W4A16Config(16, 128, 256, 4, 2, k_order="subnormal", backend="gluon", halve=True)
    check_indexed_tile(16, 6, 256, 1792, 12, 4, 4, activation, config=config)


@pytest.mark.parametrize("shared", [{"split_k": 2}, {"stream_k": 4}], ids=["S2", "K4"])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@needs_sm90
def test_gluon_configs_sharing_k_through_the_indexed_entry(shared, activation):
    """``moe_gemm_indexed_triton`` hands a gluon config's split_k / stream_k to the tile."""
    config = W4A16Config(8, 128, 256, 4, 2, k_order="subnormal", backend="gluon", **shared)
    check_indexed_tile(8, 6, 256, 1792, 9, 4, 4, activation, config=config)


# _num_sms() = 1, so stream_k is the program count: 9 routes of top-4 over 4 local experts of
# 6 make 5-9 live 8-row blocks, 10-18 tiles of 2 columns, 7 K steps; 3 and 5 programs cut tiles
# (a thin last wave), 4 may not, 64 takes every tile whole
@pytest.mark.parametrize("programs", [3, 4, 5, 64])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@needs_sm90
def test_gluon_tile_stream_k(programs, activation, monkeypatch):
    """Stream-K gives the reference's results, leaves its partials and counts zero for the
    next launch, and replays the same from a CUDA graph."""
    from chordq.kernels import triton_w4a16
    from chordq.kernels.gluon_w4a16 import moe_gemm_indexed_gluon

    monkeypatch.setattr(triton_w4a16, "_num_sms", lambda device: 1)

    def launch(x, w, s, aligned, out):
        run = lambda: moe_gemm_indexed_gluon(  # noqa: E731
            x, w, s, *aligned, 4, out.clone(), num_routes=out.shape[0],
            grid_m=aligned[1].numel(), block_n=128, num_warps=4, num_stages=2,
            gated=activation is not None, blocked=True, stream_k=programs)
        check_graph_capture(run)
        return run()

    check_indexed_tile(8, 6, 256, 1792, 9, 4, 4, activation, launch=launch)
    assert triton_w4a16._stream_k_buffers_left_zero()


@pytest.mark.parametrize("w_order", ["blocked", "subnormal"])
@pytest.mark.parametrize("n_tiles, stages, e, m, local", [
    (2, 2, 8, 20, None),  # 4 column tiles: 2 programs a block
    (3, 3, 8, 20, None),  # 6 column tiles, a 3-slot ring that wraps
    (4, 3, 6, 7, 4),  # remote experts: their rows untouched
], ids=["L2s2", "L3s3", "remote"])
@needs_sm90
def test_column_looping_gluon_tile_matches_the_reference(n_tiles, stages, e, m, local, w_order):
    from chordq.kernels import moe_gemm_indexed_triton

    cfg = W4A16Config(8, 128, 256, 4, stages, k_order="subnormal", n_tiles=n_tiles,
                      backend="gluon")
    n = 256 * n_tiles
    check_indexed_tile(8, e, n, 256, m, 8 if local is None else 4, local, None, config=cfg,
                       w_order=w_order)
    # the same bits as the shipped tile's (one tile per program): the same MMAs from zero
    w, s, x, topk = _problem(e, n, 256, m, 4)
    aligned = moe_align_block_size(topk, 8, e)
    wf, sf = fast_weights(w, s, 256, w_order)
    one = moe_gemm_indexed_triton(x, wf, sf, *aligned, 4, 8, config=GLUON_DECODE_TILE,
                                  w_order=w_order)
    looped = moe_gemm_indexed_triton(x, wf, sf, *aligned, 4, 8, config=cfg, w_order=w_order)
    assert torch.equal(one, looped)


@needs_sm90
def test_fused_moe_decode_takes_the_gluon_tile():
    check_fused_moe_tile(48, 1024, 1024, 4, 3, (8,))  # 23 experts x 16 gated tiles: a full grid


@needs_sm90
def test_gluon_tile_is_cuda_graph_capturable():
    from chordq.kernels import moe_gemm_indexed_triton

    w, s, x, topk = _problem(16, 256, 512, 6, 8)
    aligned = moe_align_block_size(topk, 8, 16)
    wf, sf = fast_weights(w, s, 512, "blocked")
    check_graph_capture(lambda: moe_gemm_indexed_triton(x, wf, sf, *aligned, 8, 8,
                                                        w_order="blocked"))
