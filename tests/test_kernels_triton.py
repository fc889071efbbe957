"""Triton W4A16 kernels vs their PyTorch twins (chordq.kernels.reference).

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before
Triton is imported; the kernels then compute in FP32, keeping the BF16 rounding of the
dequantized weight). With CUDA the same checks run on the GPU with BF16 tensor cores
(``gpu``-marked parameters). Real Kimi shapes (K=7168 / N=4096 and N=7168 / K=2048) use few
experts and tokens so the interpreted file stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from chordq.kernels import (  # noqa: E402
    W4A16Config,
    choose_config,
    choose_n_tiles,
    choose_row_tiles,
    choose_split_k,
    cos_diff,
    fused_moe,
    fused_moe_reference,
    grouped_gemm_contiguous_reference,
    grouped_gemm_contiguous_triton,
    grouped_gemm_masked_reference,
    grouped_gemm_masked_triton,
    moe_align_block_size,
    moe_align_mixed,
    moe_gemm_indexed_reference,
    moe_gemm_indexed_triton,
    moe_gemm_mixed_triton,
    moe_sum_reference,
    moe_sum_triton,
    prepare_weights,
    route,
    triton_w4a16,
)
from chordq.layout import fragment_order, pack_codes, row_blocks, subnormal_scales  # noqa: E402

# Chord's grouped-path limit (format.md §4.1); the interpreter lands near 1e-11.
MAX_COS_DIFF = 1e-3
INTERPRET = triton_w4a16._INTERPRETED  # how the kernels were built, not just the env

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and no interpreter)")]),
]
# Tile shapes the GPU heuristic uses (decode / gated / prefill), exercised on small problems.
GPU_CONFIGS = [
    W4A16Config(16, 128, 128, 4, 4, k_order="planes"),
    W4A16Config(16, 64, 128, 4, 4, k_order="planes"),
    W4A16Config(32, 128, 64, 4, 4, k_order="planes"),
    W4A16Config(16, 128, 128, 4, 4, k_order="natural"),
    W4A16Config(64, 128, 64, 4, 4),
    W4A16Config(128, 64, 64, 8, 3),
    W4A16Config(16, 128, 128, 4, 4, k_order="pairs"),
    W4A16Config(64, 128, 64, 8, 3, k_order="pairs"),
    W4A16Config(16, 64, 256, 4, 4, k_order="fragments"),
    W4A16Config(128, 128, 64, 8, 3, k_order="fragments"),
    W4A16Config(16, 64, 256, 4, 4, k_order="subnormal"),
    W4A16Config(128, 128, 64, 8, 3, k_order="subnormal"),
    W4A16Config(64, 256, 64, 4, 3, k_order="subnormal"),
    W4A16Config(128, 128, 64, 4, 4, k_order="subnormal"),
]
# Split-K (indexed path only): FP32 partials + the reduce kernel; 2 and 3 splits of 4 K steps
# (3 becomes 2 non-empty splits of 2 steps).
SPLIT_CONFIGS = [
    W4A16Config(16, 64, 64, 4, 3, k_order="pairs", split_k=2),
    W4A16Config(16, 128, 64, 4, 3, k_order="planes", split_k=3),
    W4A16Config(32, 64, 64, 4, 3, split_k=4),
    W4A16Config(16, 64, 64, 4, 3, k_order="fragments", split_k=2),
    W4A16Config(16, 64, 64, 4, 3, k_order="subnormal", split_k=2),
]


def kernel_weights(w: torch.Tensor, s: torch.Tensor, cfg: W4A16Config | None) -> dict:
    """The words and scales a config reads (fragment order for k_order "fragments", also
    subnormal scales for "subnormal") and their w_order."""
    if cfg is not None and cfg.k_order == "fragments":
        return {"w_packed": fragment_order(w), "w_scale": s, "w_order": "fragments"}
    if cfg is not None and cfg.k_order == "subnormal":
        return {"w_packed": fragment_order(w), "w_scale": subnormal_scales(s),
                "w_order": "subnormal"}
    return {"w_packed": w, "w_scale": s}
SENTINEL = 7.0  # written into `out` beforehand: rows a kernel does not own must keep it


def random_weights(e: int, n: int, k: int, device: str, seed: int = 0):
    """Packed int32 ``[E, N, K/8]`` over all 16 code levels and BF16 scales ``[E, N, K/32]``."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (e, n, k), generator=g)
    scale = (0.02 * torch.exp2(torch.randn(e, n, k // 32, generator=g))).to(torch.bfloat16)
    return pack_codes(codes).to(device), scale.to(device)


def randn_bf16(*shape: int, device: str, seed: int = 1) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x.to(torch.bfloat16).to(device)


def random_topk(m: int, top_k: int, num_experts: int, used: int | None = None, drop: float = 0.0,
                seed: int = 2) -> torch.Tensor:
    """int32 ``[m, top_k]`` distinct experts per token drawn from the first ``used`` experts."""
    g = torch.Generator().manual_seed(seed)
    used = num_experts if used is None else used
    ids = torch.stack([torch.randperm(used, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
    ids[torch.rand(m, top_k, generator=g) < drop] = -1
    return ids


def check_rows(got: torch.Tensor, want: torch.Tensor, owned: torch.Tensor) -> None:
    """Owned rows match the reference; the others still hold SENTINEL (left unwritten)."""
    owned = owned.to(got.device)
    assert cos_diff(got[owned].cpu(), want[owned].cpu()) <= MAX_COS_DIFF
    assert (got[~owned] == SENTINEL).all()


# ----------------------------------------------------------------------------- indexed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,top_k,e,used,n,k,gated", [
    (1, 1, 4, 4, 64, 64, False),
    (3, 2, 8, 8, 96, 128, True),  # N not a multiple of the tile
    (5, 8, 64, 20, 128, 64, False),  # 44 of 64 experts get no rows
    (33, 8, 64, 64, 64, 128, True),
    (3, 2, 2, 2, 4096, 7168, True),  # Kimi gate_up (w13: 2I=4096 rows, K=H=7168)
    (2, 2, 2, 2, 7168, 2048, False),  # Kimi down (N=H=7168, K=I=2048)
])
def test_indexed_matches_reference(device, m, top_k, e, used, n, k, gated):
    w, s = random_weights(e, n, k, device)
    x = randn_bf16(m, k, device=device)
    topk_ids = random_topk(m, top_k, e, used, drop=0.15)
    expert_map = torch.arange(e, dtype=torch.int32)
    expert_map[1] = -1  # expert 1 lives on another rank
    activation = "silu_mul" if gated else None
    # Small problems: small tiles (several K steps); real sizes: the heuristic's tiles.
    cfg = W4A16Config(16, 64, 64 if k % 64 == 0 else 32, 4, 1) if k < 1024 else None
    bm = 16 if cfg is None else cfg.block_m
    aligned = moe_align_block_size(topk_ids, bm, e, expert_map)
    sorted_ids, expert_ids, ntp = (t.to(device) for t in aligned)
    n_out = n // 2 if gated else n
    out = torch.full((m * top_k, n_out), SENTINEL, dtype=torch.bfloat16, device=device)
    got = moe_gemm_indexed_triton(x, w, s, sorted_ids, expert_ids, ntp, top_k, bm,
                                  activation=activation, config=cfg, out=out)
    assert got is out
    want = moe_gemm_indexed_reference(x, w, s, sorted_ids, expert_ids, ntp, top_k, bm,
                                      activation=activation)
    flat = topk_ids.reshape(-1)
    check_rows(got, want, (flat >= 0) & (flat != 1))


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("w_order", ["checkpoint", "fragments"])
@pytest.mark.parametrize("k", [2048, 2304])
def test_indexed_heuristic_gated_128_row_tile(device, w_order, k):
    """The heuristic's fused gate_up tile for 128-row blocks (as at 120 rows per expert) at K = 2048
    and at K = 2304, where the fragment tile's 64-deep 4-stage form gave NaN on the H200
    (triton_config)."""
    cfg = choose_config(120, 2048, k, gated=True, block_m=128, w_order=w_order)
    if w_order == "fragments":
        assert cfg.block_k == (64 if k == 2048 else 128)
    check_indexed_with_remote_expert(device, cfg, 60, 4, 8, 4096, k, remote=3,
                                     activation="silu_mul")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=str)
def test_indexed_gpu_tile_shapes(device, cfg):
    m, top_k, e, n, k = 21, 4, 6, 256, 256
    w, s = random_weights(e, n, k, device)
    x = randn_bf16(m, k, device=device)
    topk_ids = random_topk(m, top_k, e)
    aligned = moe_align_block_size(topk_ids, cfg.block_m, e)
    sorted_ids, expert_ids, ntp = (t.to(device) for t in aligned)
    for activation, n_out in ((None, n), ("silu_mul", n // 2)):
        out = torch.full((m * top_k, n_out), SENTINEL, dtype=torch.bfloat16, device=device)
        got = moe_gemm_indexed_triton(x, sorted_token_ids=sorted_ids,
                                      expert_ids=expert_ids, num_tokens_post_padded=ntp,
                                      top_k=top_k, block_m=cfg.block_m, activation=activation,
                                      config=cfg, out=out, **kernel_weights(w, s, cfg))
        want = moe_gemm_indexed_reference(x, w, s, sorted_ids, expert_ids, ntp, top_k,
                                          cfg.block_m, activation=activation)
        check_rows(got, want, torch.ones(m * top_k, dtype=torch.bool))


def check_indexed_with_remote_expert(device, cfg, m, top_k, e, n, k, remote, activation=None):
    """The indexed kernel under ``cfg`` against the reference, 15% of routes dropped and expert
    ``remote`` on another rank: owned rows match, the rest keep SENTINEL."""
    w, s = random_weights(e, n, k, device)
    x = randn_bf16(m, k, device=device)
    topk_ids = random_topk(m, top_k, e, drop=0.15)
    expert_map = torch.arange(e, dtype=torch.int32)
    expert_map[remote] = -1
    aligned = moe_align_block_size(topk_ids, cfg.block_m, e, expert_map)
    sorted_ids, expert_ids, ntp = (t.to(device) for t in aligned)
    out = torch.full((m * top_k, n // 2 if activation else n), SENTINEL, dtype=torch.bfloat16,
                     device=device)
    got = moe_gemm_indexed_triton(x, sorted_token_ids=sorted_ids,
                                  expert_ids=expert_ids, num_tokens_post_padded=ntp, top_k=top_k,
                                  block_m=cfg.block_m, activation=activation, config=cfg, out=out,
                                  **kernel_weights(w, s, cfg))
    want = moe_gemm_indexed_reference(x, w, s, sorted_ids, expert_ids, ntp, top_k, cfg.block_m,
                                      activation=activation)
    flat = topk_ids.reshape(-1)
    check_rows(got, want, (flat >= 0) & (flat != remote))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_indexed_split_k(device, cfg, gated):
    """Split-K writes exactly the rows the unsplit kernel owns (sentinels, dropped routes and
    experts on another rank stay unwritten) with the same values."""
    check_indexed_with_remote_expert(device, cfg, 9, 4, 8, 128, 256, remote=2,
                                     activation="silu_mul" if gated else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [False, True])
def test_indexed_split_k_on_a_few_blocks(device, gated):
    """Split-K on a grid of fewer slots than routes (a piece of a mixed alignment: its first
    two blocks here) keeps its partials by slot, and writes exactly those blocks' rows."""
    cfg = W4A16Config(16, 64, 64, 4, 3, k_order="subnormal", split_k=2)
    m, top_k, e, n, k = 9, 4, 8, 128, 256
    w, s = random_weights(e, n, k, device)
    x = randn_bf16(m, k, device=device)
    sorted_ids, expert_ids, _ = moe_align_block_size(random_topk(m, top_k, e), 16, e)
    piece = (sorted_ids[:32].to(device), expert_ids[:2].to(device),
             torch.tensor([32], dtype=torch.int32, device=device))
    assert triton_w4a16.split_k_partial_rows(2, 16, m * top_k) == (32, True)
    n_out = n // 2 if gated else n
    act = "silu_mul" if gated else None
    out = torch.full((m * top_k, n_out), SENTINEL, dtype=torch.bfloat16, device=device)
    got = moe_gemm_indexed_triton(x, sorted_token_ids=piece[0], expert_ids=piece[1],
                                  num_tokens_post_padded=piece[2], top_k=top_k, block_m=16,
                                  activation=act, config=cfg, out=out,
                                  **kernel_weights(w, s, cfg))
    want = moe_gemm_indexed_reference(x, w, s, *piece, top_k, 16, activation=act)
    owned = torch.zeros(m * top_k, dtype=torch.bool)
    slots = piece[0].cpu()
    owned[slots[slots < m * top_k].long()] = True
    check_rows(got, want, owned)


def test_split_k_partials_take_the_fewer_rows():
    assert triton_w4a16.split_k_partial_rows(5, 32, 4096) == (160, True)  # a remainder piece
    assert triton_w4a16.split_k_partial_rows(45, 16, 8) == (8, False)  # TP8 T=1: 8 routes


# Stream-K with _num_sms() = 1, so stream_k is the program count. The 16x32 tiles make 32 live
# tiles (8 row blocks, one of them an expert on another rank), the 32x64 ones 16; K = 256 is 4
# steps of 64. 3 and 5 programs: whole tiles for the full waves, the last two waves cut between
# programs; 20 programs: every tile shared out by K steps (the last wave is 12 of 20); 64:
# more programs than tiles, one whole tile each.
STREAM_K_CONFIGS = [
    W4A16Config(16, 32, 64, 4, 2, k_order="subnormal", stream_k=3),
    W4A16Config(16, 32, 64, 4, 2, k_order="fragments", stream_k=5, columns_first=True),
    W4A16Config(32, 64, 64, 4, 3, stream_k=64),
    W4A16Config(16, 32, 64, 4, 2, k_order="pairs", stream_k=20),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", STREAM_K_CONFIGS, ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_indexed_stream_k(device, cfg, gated, monkeypatch):
    """Stream-K writes the rows the one-program-per-tile kernel owns, with the reference's
    values, also where a tile is summed from two programs, and leaves its buffers zero."""
    monkeypatch.setattr(triton_w4a16, "_num_sms", lambda device: 1)
    check_indexed_with_remote_expert(device, cfg, 9, 4, 8, 128, 256, remote=2,
                                     activation="silu_mul" if gated else None)
    assert triton_w4a16._stream_k_buffers_left_zero()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [False, True])
def test_indexed_columns_first(device, gated):
    """Programs walking one row block's column tiles first cover the same tiles."""
    cfg = W4A16Config(16, 32, 64, 4, 2, k_order="subnormal", columns_first=True)
    check_indexed_with_remote_expert(device, cfg, 9, 4, 8, 128, 256, remote=2,
                                     activation="silu_mul" if gated else None)


def test_stream_k_rejects_what_it_cannot_run():
    for fields in ({"stream_k": -1}, {"stream_k": 2, "split_k": 2},
                   {"stream_k": 2, "n_tiles": 2}):
        with pytest.raises(ValueError, match="stream_k"):
            W4A16Config(16, 32, 128, **fields)
    device = "cpu" if INTERPRET else "cuda"  # CPU tensors need the interpreter
    if device == "cuda" and not torch.cuda.is_available():
        return
    w, s = random_weights(2, 64, 256, device)
    with pytest.raises(ValueError, match="stream_k"):
        grouped_gemm_contiguous_triton(randn_bf16(2, 256, device=device), w, s,
                                       torch.zeros(2, dtype=torch.int32, device=device),
                                       config=W4A16Config(16, 32, 128, stream_k=2))


# Column-looping programs for a one-step K (TP8 down, K = 256): N = 7 * 32 is covered by
# 4-tile programs with a partial last program (masked columns) and by 7-tile programs exactly.
WIDE_CONFIGS = [
    W4A16Config(16, 32, 256, 4, 2, k_order="fragments", n_tiles=4),
    W4A16Config(32, 32, 256, 4, 3, k_order="fragments", n_tiles=7),
    W4A16Config(16, 32, 256, 4, 2, k_order="pairs", n_tiles=2),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", WIDE_CONFIGS, ids=str)
def test_indexed_column_loop(device, cfg):
    check_indexed_with_remote_expert(device, cfg, 13, 2, 6, 7 * 32, 256, remote=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", [(64, 32, 16), (32, 16)])
@pytest.mark.parametrize("gated", [False, True])
def test_mixed_row_tiles(device, sizes, gated):
    """One launch per row-tile size (align.moe_align_mixed) writes the rows one alignment
    would, with the same values; dropped routes and a remote expert's rows stay unwritten."""
    m, top_k, e, n, k, remote = 100, 3, 5, 64, 128, 3
    w, s = random_weights(e, n, k, device)
    x = randn_bf16(m, k, device=device)
    g = torch.Generator().manual_seed(6)
    probs = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.2])  # ~10..100 rows per expert: every size
    topk_ids = torch.stack([torch.multinomial(probs, top_k, generator=g) for _ in range(m)])
    topk_ids = topk_ids.to(torch.int32)
    topk_ids[torch.rand(m, top_k, generator=g) < 0.1] = -1
    expert_map = torch.arange(e, dtype=torch.int32)
    expert_map[remote] = -1
    pieces = [(bs, tuple(t.to(device) for t in aligned))
              for bs, aligned in moe_align_mixed(topk_ids, sizes, e, expert_map)]
    assert [bs for bs, _ in pieces] == list(sizes)
    activation = "silu_mul" if gated else None
    out = torch.full((m * top_k, n // 2 if gated else n), SENTINEL, dtype=torch.bfloat16,
                     device=device)
    got = moe_gemm_mixed_triton(x, w, s, pieces, top_k, activation=activation, out=out)
    assert got is out
    aligned = moe_align_block_size(topk_ids, 16, e, expert_map)
    want = moe_gemm_indexed_reference(x, w, s, *(t.to(device) for t in aligned), top_k, 16,
                                      activation=activation)
    flat = topk_ids.reshape(-1)
    check_rows(got, want, (flat >= 0) & (flat != remote))


def test_column_loop_rejects_what_it_cannot_run():
    w, s = random_weights(2, 64, 256, "cpu")
    x = randn_bf16(2, 256, device="cpu")
    for cfg, act in ((W4A16Config(16, 32, 128, n_tiles=2), None),  # block_k != K
                     (W4A16Config(16, 32, 256, n_tiles=2), "silu_mul")):
        with pytest.raises(ValueError, match="n_tiles"):
            triton_w4a16.indexed_config(2, 2, 64, 256, 16, activation=act, config=cfg,
                                        device="cpu")
    with pytest.raises(ValueError, match="n_tiles"):
        W4A16Config(16, 32, 256, split_k=2, n_tiles=2)
    with pytest.raises(ValueError, match="n_tiles"):
        grouped_gemm_contiguous_triton(x, w, s, torch.zeros(2, dtype=torch.int32),
                                       config=W4A16Config(16, 32, 256, n_tiles=2))


def test_column_loop_heuristic():
    decode, prefill = W4A16Config(16, 64, 256), W4A16Config(64, 64, 256)
    assert choose_n_tiles(decode, blocks=187, n=7168, num_sms=132) == 14  # TP8 down T=32
    assert choose_n_tiles(prefill, blocks=384, n=7168, num_sms=132) == 28  # T=2048
    assert choose_n_tiles(decode, blocks=8, n=7168, num_sms=132) == 4  # T=1: fill the SMs
    assert choose_n_tiles(decode, blocks=3, n=7 * 64, num_sms=132) == 7  # only divisor
    assert choose_n_tiles(decode, blocks=3, n=64, num_sms=132) == 1  # one column tile


def test_gpu_tile_table():
    """The shipped GPU tiles at Kimi shapes (EP8 gate_up N=4096 K=7168, down N=7168 K=2048;
    TP8 gate_up N=512), as measured in docs/kernel_notes.md: a change here is a tuning change."""
    want = {
        (0.17, 4096, 7168): "16,64,256,4,3,Z,R128,C",  # EP8 decode
        (5.3, 4096, 7168): "16,128,256,4,4,Z",  # EP8 T=32 gate_up
        (5.3, 7168, 2048): "16,64,256,4,3,Z,R128,C",
        (21.3, 4096, 7168): "32,128,256,4,3,Z",
        (42.7, 4096, 7168): "64,256,64,4,3,Z",
        (42.7, 7168, 2048): "64,128,64,4,4,Z",
        (341.3, 4096, 7168): "128,128,64,4,4,Z",
        (341.3, 7168, 2048): "128,128,64,4,4,Z",
        (1365.3, 7168, 2048): "128,256,128,8,3,Z",
        (0.42, 512, 7168): "16,128,256,4,4,Z,C",  # TP8 decode
        (2.67, 512, 7168): "16,64,256,4,3,Z,R128,C",  # TP8 T=128
        (0.42, 7168, 256): "16,64,256,4,4,Z,L14",  # TP8 down: column loop
    }
    got = {key: choose_config(*key, w_order="subnormal").label for key in want}
    assert got == want
    # as fragments the tiles are the same but for the 128-row down tile
    assert choose_config(341.3, 7168, 2048, w_order="fragments").label == "128,256,128,8,3,F"
    assert choose_config(42.7, 4096, 7168, w_order="fragments").label == "64,256,64,4,3,F"
    assert choose_config(3.3, 2048, 7168, gated=True, w_order="subnormal").label == (
        "16,64,256,4,4,Z,C")  # fused gate_up decode


def test_row_tiles_heuristic():
    assert choose_row_tiles(170.7, 4096, 7168) == (128, 64, 32)  # EP8 gate_up T=1024
    assert choose_row_tiles(170.7, 7168, 2048) == (128, 64)  # EP8 down T=1024
    assert choose_row_tiles(170.7, 512, 7168) == (128, 64, 32)  # TP8 gate_up T=8192
    assert choose_row_tiles(85.3, 4096, 7168) == (128,)  # T=512: smaller tiles lost
    assert choose_row_tiles(341.3, 4096, 7168) == (128,)  # T=2048: tie
    assert choose_row_tiles(0.2, 4096, 7168) == (16,)
    assert choose_row_tiles(170.7, 4096, 7168, interpret=True) == (128,)


def test_split_k_heuristic_fills_thin_grids_only():
    cfg = W4A16Config(16, 128, 256)
    assert choose_split_k(cfg, tiles=7 * 16, k=7168, num_sms=132) == 4  # EP8 T=1 fused gate_up
    assert choose_split_k(cfg, tiles=8 * 4, k=7168, num_sms=132) == 8  # TP8 T=1: K steps cap
    assert choose_split_k(cfg, tiles=59 * 4, k=7168, num_sms=132) == 1  # TP8 T=8: 1.8 per SM
    assert choose_split_k(cfg, tiles=45 * 32, k=7168, num_sms=132) == 1  # T=20: full grid
    assert choose_split_k(W4A16Config(16, 128, 128), tiles=8 * 56, k=256, num_sms=132) == 1


def test_remainder_pieces_are_not_split():
    # 8 routes over 48 experts: ~8 one-block experts, a thin grid that the heuristic splits;
    # an alignment trimmed to fewer blocks than that (a mixed alignment's remainder) is not
    def split(live_blocks):
        return triton_w4a16.indexed_config(8, 48, 4096, 7168, 32, w_order="subnormal",
                                           device="cpu", live_blocks=live_blocks).split_k

    assert split(None) > 1 and split(1000) == split(None)
    assert split(1) == 1


# ----------------------------------------------------------------------------- grouped


def contiguous_layout(counts: list[int], align: int = 128) -> torch.Tensor:
    """m_indices: each expert's rows, then -1 padding up to a multiple of ``align``."""
    return torch.cat([torch.tensor([e] * c + [-1] * (-c % align), dtype=torch.int32)
                      for e, c in enumerate(counts)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [GPU_CONFIGS[0], GPU_CONFIGS[4], GPU_CONFIGS[5]], ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_contiguous_matches_reference(device, cfg, gated):
    e, n, k = 4, 128, 128
    w, s = random_weights(e, n, k, device)
    m_indices = contiguous_layout([3, 0, 130, 1])
    x = randn_bf16(m_indices.numel(), k, device=device)
    x[m_indices.to(device) < 0] = 0  # padding rows are zeroed by the producer
    activation = "silu_mul" if gated else None
    out = torch.full((x.shape[0], n // 2 if gated else n), SENTINEL, dtype=torch.bfloat16,
                     device=device)
    got = grouped_gemm_contiguous_triton(x, m_indices=m_indices.to(device),
                                         activation=activation, config=cfg, out=out,
                                         **kernel_weights(w, s, cfg))
    want = grouped_gemm_contiguous_reference(x, w, s, m_indices.to(device), activation=activation)
    check_rows(got, want, m_indices >= 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [None, GPU_CONFIGS[0], GPU_CONFIGS[4]], ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_masked_matches_reference(device, cfg, gated):
    g, max_m, n, k = 4, 40, 128, 128
    w, s = random_weights(g, n, k, device)
    x = randn_bf16(g, max_m, k, device=device)
    masked_m = torch.tensor([0, 5, 40, 17], dtype=torch.int32)
    activation = "silu_mul" if gated else None
    out = torch.full((g * max_m, n // 2 if gated else n), SENTINEL, dtype=torch.bfloat16,
                     device=device)
    got = grouped_gemm_masked_triton(x, w, s, masked_m.to(device), expected_m=16,
                                     activation=activation, config=cfg, out=out)
    want = grouped_gemm_masked_reference(x, w, s, masked_m.to(device), activation=activation)
    owned = (torch.arange(max_m)[None, :] < masked_m[:, None]).reshape(-1)
    check_rows(got, want, owned)


# ----------------------------------------------------------------------------- top-k sum and MoE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,top_k,h", [(1, 1, 64), (5, 8, 7168), (33, 2, 100)])
def test_moe_sum_matches_reference(device, m, top_k, h):
    y = randn_bf16(m * top_k, h, device=device)
    topk_ids = random_topk(m, top_k, 16, drop=0.2)
    y[topk_ids.reshape(-1).to(device) < 0] = float("nan")  # unwritten rows: never read
    weights = torch.rand(m, top_k)
    got = moe_sum_triton(y, weights.to(device), topk_ids.to(device))
    want = moe_sum_reference(y, weights.to(device), topk_ids.to(device))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,h,i,e,top_k,used", [
    (1, 128, 64, 4, 1, 4),
    (3, 256, 128, 8, 2, 8),
    (5, 128, 64, 64, 8, 24),  # many experts, 40 of them unrouted
    (33, 64, 32, 16, 8, 16),
    (3, 7168, 2048, 2, 1, 1),  # Kimi K2 expert shapes; one routed expert keeps it quick
])
def test_fused_moe_matches_reference(device, m, h, i, e, top_k, used):
    w13, s13 = random_weights(e, 2 * i, h, device, seed=3)
    w2, s2 = random_weights(e, h, i, device, seed=4)
    x = randn_bf16(m, h, device=device)
    logits = torch.randn(m, e)
    logits[:, used:] = -1e4  # keep the tail experts unrouted
    topk_weights, topk_ids = route(logits, torch.zeros(e), top_k, 2.827)
    topk_ids[0, -1] = -1  # an expert on another rank
    args = (x, w13, s13, w2, s2, topk_weights.to(device), topk_ids.to(device))
    got = fused_moe(*args, impl="triton")
    want = fused_moe_reference(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    assert cos_diff(got.cpu(), want.cpu()) <= MAX_COS_DIFF


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_mixed_row_tiles(device, monkeypatch):
    """fused_moe with the mixed alignment (the heuristic's choice at 128-256 rows per expert,
    forced here at a size the interpreter runs quickly) equals the reference."""
    from chordq.kernels import triton_config

    m, h, i, e, top_k = 24, 128, 64, 3, 2
    w13, s13 = random_weights(e, 2 * i, h, device, seed=3)
    w2, s2 = random_weights(e, h, i, device, seed=4)
    x = randn_bf16(m, h, device=device)
    topk_weights, topk_ids = route(torch.randn(m, e), torch.zeros(e), top_k, 1.0)
    args = (x, w13, s13, w2, s2, topk_weights.to(device), topk_ids.to(device))
    calls = []
    monkeypatch.setattr(triton_config, "choose_row_tiles",
                        lambda *a, **kw: calls.append(a) or (32, 16))
    got = fused_moe(*args, impl="triton")
    assert calls  # the mixed path ran
    assert cos_diff(got.cpu(), fused_moe_reference(*args).cpu()) <= MAX_COS_DIFF


def small_moe(device: str):
    """A 9-token, 8-expert MoE (H=256, I=128, top-2): its input, checkpoint weights, routing
    and the reference output."""
    m, h, i, e, top_k = 9, 256, 128, 8, 2
    w13, s13 = random_weights(e, 2 * i, h, device, seed=3)
    w2, s2 = random_weights(e, h, i, device, seed=4)
    x = randn_bf16(m, h, device=device)
    topk_weights, topk_ids = route(torch.randn(m, e), torch.zeros(e), top_k, 1.0)
    routing = (topk_weights.to(device), topk_ids.to(device))
    want = fused_moe_reference(x, w13, s13, w2, s2, *routing)
    return x, w13, s13, w2, s2, routing, want


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_fragment_order(device):
    """The fast path: weights converted once to fragment order give the same MoE."""
    x, w13, s13, w2, s2, routing, want = small_moe(device)
    frag = (x, fragment_order(w13), s13, fragment_order(w2), s2, *routing)
    got = fused_moe(*frag, impl="triton", w_order="fragments")
    assert cos_diff(got.cpu(), want.cpu()) <= MAX_COS_DIFF
    assert torch.equal(fused_moe(*frag, impl="reference", w_order="fragments"), want)
    with pytest.raises(ValueError, match="w_order"):
        fused_moe(*frag, w_order="marlin")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_subnormal_weights(device):
    """prepare_weights: fragment words and subnormal scales give the same MoE; a scale too
    large for them falls back to fragment words with the scales unchanged."""
    x, w13, s13, w2, s2, routing, want = small_moe(device)
    w13p, s13p, w2p, s2p, order = prepare_weights(w13, s13, w2, s2)
    assert order == "subnormal"  # I = 128: the down GEMM's K is not a multiple of 256
    sub = (x, w13p, s13p, w2p, s2p, *routing)
    got = fused_moe(*sub, impl="triton", w_order="subnormal")
    assert torch.equal(got, fused_moe(x, w13p, s13, w2p, s2, *routing, impl="triton",
                                      w_order="fragments"))
    assert cos_diff(got.cpu(), want.cpu()) <= MAX_COS_DIFF
    assert torch.equal(fused_moe(*sub, impl="reference", w_order="subnormal"), want)
    big = s2.clone()
    big[0, 0, 0] = 0.5
    w13f, s13f, w2f, s2f, order = prepare_weights(w13, s13, w2, big)
    assert order == "fragments" and s13f is s13 and s2f is big
    assert torch.equal(w13f, w13p) and torch.equal(w2f, w2p)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_blocked_weights(device):
    """prepare_weights puts the subnormal weights in row blocks where both GEMMs allow (here
    H = 256, I = 256): the same MoE, bit for bit, and the reference converts them back."""
    m, h, i, e, top_k = 9, 256, 256, 8, 2
    w13, s13 = random_weights(e, 2 * i, h, device, seed=3)
    w2, s2 = random_weights(e, h, i, device, seed=4)
    x = randn_bf16(m, h, device=device)
    routing = [t.to(device) for t in route(torch.randn(m, e), torch.zeros(e), top_k, 1.0)]
    want = fused_moe_reference(x, w13, s13, w2, s2, *routing)
    *blocked, order = prepare_weights(w13, s13, w2, s2)
    assert order == "blocked"
    sub = (fragment_order(w13), subnormal_scales(s13), fragment_order(w2), subnormal_scales(s2))
    got = fused_moe(x, *blocked, *routing, impl="triton", w_order="blocked")
    assert torch.equal(got, fused_moe(x, *sub, *routing, impl="triton", w_order="subnormal"))
    assert cos_diff(got.cpu(), want.cpu()) <= MAX_COS_DIFF
    assert torch.equal(fused_moe(x, *blocked, *routing, impl="reference", w_order="blocked"),
                       want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", [(16, 64, 128, 4, 3), (64, 128, 64, 4, 4)], ids=str)
def test_subnormal_dequant_is_bit_identical(device, tile):
    """The subnormal dequantization gives the fragment path's bits, also for zero, negative,
    subnormal (2**-133) and the largest (0.498) scales."""
    m, top_k, e, n, k = 13, 2, 4, 128, 256
    w, s = random_weights(e, n, k, device, seed=5)
    sign = torch.where(torch.rand(s.shape, generator=torch.Generator().manual_seed(6)) < 0.5,
                       1.0, -1.0).to(device)
    s = (s.float() * sign).to(torch.bfloat16)
    s.view(-1)[:7] = torch.tensor([0.0, -0.0, 2**-133, -2**-133, 0.498, -0.498, 2**-127])
    x = randn_bf16(m, k, device=device)
    aligned = moe_align_block_size(random_topk(m, top_k, e), tile[0], e)
    names = ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")
    aligned = {name: t.to(device) for name, t in zip(names, aligned)}
    for activation in (None, "silu_mul"):
        got = {}
        for order in ("fragments", "subnormal"):
            cfg = W4A16Config(*tile, k_order=order)
            got[order] = moe_gemm_indexed_triton(x, **aligned, top_k=top_k, block_m=tile[0],
                                                 activation=activation, config=cfg,
                                                 **kernel_weights(w, s, cfg))
        assert torch.equal(got["fragments"], got["subnormal"])


def blocked_weights(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The subnormal weights in row blocks (``w_order="blocked"``)."""
    k = 8 * w.shape[-1]
    return row_blocks(fragment_order(w), k), row_blocks(subnormal_scales(s), k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [
    W4A16Config(16, 64, 256, 4, 3, k_order="subnormal"),  # one piece a step
    W4A16Config(32, 128, 128, 4, 3, k_order="subnormal"),  # two steps a piece
    W4A16Config(16, 256, 64, 4, 3, k_order="subnormal"),  # a tile over two row blocks
    W4A16Config(16, 64, 64, 4, 3, k_order="subnormal", split_k=3),
    W4A16Config(16, 64, 128, 4, 2, k_order="subnormal", stream_k=2),
], ids=str)
def test_blocked_weights_give_the_subnormal_bits(device, cfg):
    """Row blocks (``chordq.layout.row_blocks``) change where each word lies, not what the
    tiles compute: the indexed GEMM (split-K and stream-K too), plain and fused, and the
    grouped GEMMs give the bits of the unblocked subnormal weights; K = 768 spans three
    pieces a row block, N = 256 two row blocks."""
    m, top_k, e, n, k = 11, 2, 4, 256, 768
    w, s = random_weights(e, n, k, device, seed=7)
    sub = fragment_order(w), subnormal_scales(s)
    wb, sb = blocked_weights(w, s)
    x = randn_bf16(m, k, device=device)
    aligned = [t.to(device) for t in moe_align_block_size(random_topk(m, top_k, e), cfg.block_m,
                                                          e)]
    for activation in (None, "silu_mul"):
        want = moe_gemm_indexed_triton(x, *sub, *aligned, top_k, cfg.block_m,
                                       activation=activation, config=cfg, w_order="subnormal")
        got = moe_gemm_indexed_triton(x, wb, sb, *aligned, top_k, cfg.block_m,
                                      activation=activation, config=cfg, w_order="blocked")
        assert torch.equal(got, want)
    if cfg.split_k == 1 and not cfg.stream_k:
        ids = torch.tensor([0] * 32 + [2] * 32, dtype=torch.int32, device=device)
        xs = randn_bf16(64, k, device=device)
        assert torch.equal(
            grouped_gemm_contiguous_triton(xs, wb, sb, ids, config=cfg, w_order="blocked"),
            grouped_gemm_contiguous_triton(xs, *sub, ids, config=cfg, w_order="subnormal"))
        xm, masked = randn_bf16(e, 8, k, device=device), torch.tensor([3, 0, 8, 1]).int()
        outs = [torch.zeros(8 * e, n, dtype=torch.bfloat16, device=device) for _ in range(2)]
        grouped_gemm_masked_triton(xm, wb, sb, masked.to(device), config=cfg, out=outs[0],
                                   w_order="blocked")
        grouped_gemm_masked_triton(xm, *sub, masked.to(device), config=cfg, out=outs[1],
                                   w_order="subnormal")
        assert torch.equal(*outs)


@pytest.mark.parametrize("device", DEVICES)
def test_blocked_weights_column_loop_and_checks(device):
    """The column-loop tile (K = 256: one piece a row block) reads row blocks too; blocked
    weights need N % 128 == 0 and K % 256 == 0, and steps inside one piece."""
    m, e, n, k = 9, 4, 256, 256
    w, s = random_weights(e, n, k, device, seed=8)
    wb, sb = blocked_weights(w, s)
    x = randn_bf16(m, k, device=device)
    aligned = [t.to(device) for t in moe_align_block_size(random_topk(m, 1, e), 16, e)]
    cfg = W4A16Config(16, 32, 256, 4, 2, k_order="subnormal", n_tiles=4)
    want = moe_gemm_indexed_reference(x, w, s, *aligned, 1, 16)
    got = moe_gemm_indexed_triton(x, wb, sb, *aligned, 1, 16, config=cfg, w_order="blocked")
    assert cos_diff(got.cpu(), want.cpu()) <= MAX_COS_DIFF
    with pytest.raises(ValueError, match="N % 128 == 0 and K % 256 == 0"):
        moe_gemm_indexed_triton(x[:, :128].contiguous(), wb[:, :, :16].contiguous(),
                                sb[:, :, :4].contiguous(), *aligned, 1, 16, w_order="blocked")
    xk = randn_bf16(m, 512, device=device)
    wk, sk = blocked_weights(*random_weights(e, n, 512, device, seed=9))
    with pytest.raises(ValueError, match="block_k to divide 256"):
        moe_gemm_indexed_triton(xk, wk, sk, *aligned, 1, 16, w_order="blocked",
                                config=W4A16Config(16, 64, 512, 4, 2, k_order="subnormal"))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", [None, W4A16Config(16, 64, 128, 4, 3, stream_k=2)], ids=str)
def test_indexed_is_cuda_graph_capturable(cfg):
    """Captured and eager runs agree; stream-K's buffers made during the first capture serve
    the second."""
    m, top_k, e, n, k = 8, 8, 48, 512, 1024
    w, s = random_weights(e, n, k, "cuda")
    x = randn_bf16(m, k, device="cuda")
    topk_ids = random_topk(m, top_k, e).cuda()
    sorted_ids, expert_ids, ntp = moe_align_block_size(topk_ids, 16, e)
    def run() -> torch.Tensor:
        return moe_gemm_indexed_triton(x, w, s, sorted_ids, expert_ids, ntp, top_k, 16,
                                       config=cfg)

    triton_w4a16._STREAM_K_BUFFERS.clear()
    eager = run()
    graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph in graphs:
        with torch.cuda.graph(graph):
            outs.append(run())
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], eager) and torch.equal(outs[1], eager)


# ----------------------------------------------------------------------------- errors


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_w4a16, "_INTERPRETED", False)
    w, s = random_weights(2, 64, 64, "cpu")
    x = randn_bf16(2, 64, device="cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        grouped_gemm_contiguous_triton(x, w, s, torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_wrapper_rejects_bad_operands(device):
    w, s = random_weights(2, 64, 64, device)
    x = randn_bf16(2, 64, device=device)
    ids = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="x must be"):
        grouped_gemm_contiguous_triton(x.float(), w, s, ids)
    with pytest.raises(ValueError, match="w_scale"):
        grouped_gemm_contiguous_triton(x, w, s[:, :, :1], ids)
    with pytest.raises(ValueError, match="block_k"):
        grouped_gemm_contiguous_triton(x, w, s, ids, config=W4A16Config(16, 64, 128))
    with pytest.raises(ValueError, match="activation"):
        grouped_gemm_contiguous_triton(x, w, s, ids, activation="gelu")
    with pytest.raises(ValueError, match="block_m"):
        W4A16Config(block_m=8)
    with pytest.raises(ValueError, match="k_order"):
        W4A16Config(k_order="zigzag")
    with pytest.raises(ValueError, match="w_order"):
        grouped_gemm_contiguous_triton(x, w, s, ids,
                                       config=W4A16Config(16, 64, 64, k_order="fragments"))
    with pytest.raises(ValueError, match="indexed path only"):
        grouped_gemm_contiguous_triton(x, w, s, ids, config=W4A16Config(16, 64, 64, split_k=2))
