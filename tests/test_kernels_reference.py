"""chordq.kernels in plain PyTorch: the reference vs float64 dense math, routing, alignment.

Everything here runs on CPU without Triton. Weights are fresh random codes over all 16 levels
packed with chordq.layout, plus random BF16 scales spanning several binades.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from chordq.kernels import (
    cos_diff,
    dequantize,
    fused_moe,
    fused_moe_reference,
    grouped_gemm_contiguous_reference,
    grouped_gemm_masked_reference,
    moe_align_block_size,
    moe_align_mixed,
    moe_gemm_indexed_reference,
    moe_sum_reference,
    route,
)

from chordq.kernels.align import mixed_tiles
from chordq.layout import pack_codes

# Reference (BF16 weights and intermediates, FP32 accumulation) vs exact float64 math.
REF_VS_FLOAT64_MAX_COS_DIFF = 1e-4


def random_weights(
    e: int, n: int, k: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int64 [E, N, K] in 0..15, packed int32 [E, N, K/8], scales BF16 [E, N, K/32])."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (e, n, k), generator=g)
    scale = (0.02 * torch.exp2(torch.randn(e, n, k // 32, generator=g))).to(torch.bfloat16)
    return codes, pack_codes(codes), scale


def dense64(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact float64 weights ``(code - 8) * scale`` ``[..., N, K]``."""
    return (codes.double() - 8) * scale.double().repeat_interleave(32, dim=-1)


def randn_bf16(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# ----------------------------------------------------------------------------- numerics


def test_cos_diff():
    x = torch.randn(100)
    assert cos_diff(x, x) == pytest.approx(0.0, abs=1e-12)
    assert cos_diff(x, -x) == pytest.approx(2.0)
    assert cos_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    y = x + 0.01 * torch.randn(100)
    expected = 1 - 2 * (x.double() * y.double()).sum() / (x.double() ** 2 + y.double() ** 2).sum()
    assert cos_diff(x, y) == pytest.approx(float(expected), rel=1e-9)


@pytest.mark.parametrize("shape", [(1, 8, 32), (3, 16, 64), (2, 5, 96)])
def test_dequantize_is_the_bf16_product(shape):
    codes, packed, scale = random_weights(*shape)
    got = dequantize(packed, scale)
    assert got.dtype == torch.bfloat16 and got.shape == codes.shape
    # (code - 8) * scale is exact in float64; the reference rounds it once to BF16.
    assert torch.equal(got, dense64(codes, scale).to(torch.bfloat16))


# ----------------------------------------------------------------------------- routing


def route_loop(logits, bias, top_k, scaling, n_group=1, topk_group=1, renormalize=True):
    """Per-token, per-expert Python loop of noaux_tc routing."""
    m, e = logits.shape
    per_group = e // n_group
    ids, weights = [], []
    for t in range(m):
        scores = [1.0 / (1.0 + math.exp(-float(v))) for v in logits[t].float()]
        choice = [s + float(b) for s, b in zip(scores, bias.float(), strict=True)]
        group_score = []
        for grp in range(n_group):
            best = sorted(choice[grp * per_group:(grp + 1) * per_group], reverse=True)
            group_score.append(best[0] + best[1])
        groups = sorted(range(n_group), key=lambda gi: -group_score[gi])[:topk_group]
        eligible = [x for x in range(e) if x // per_group in groups]
        chosen = sorted(eligible, key=lambda x: -choice[x])[:top_k]
        w = [scores[x] for x in chosen]
        if renormalize:
            total = sum(w)
            w = [v / total for v in w]
        ids.append(chosen)
        weights.append([v * scaling for v in w])
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


@pytest.mark.parametrize("m,e,top_k,n_group,topk_group,renormalize", [
    (5, 384, 8, 1, 1, True),  # Kimi K2
    (7, 64, 6, 8, 3, True),  # DeepSeek-V3-like grouping
    (4, 16, 2, 4, 2, False),
    (1, 8, 1, 1, 1, True),
])
def test_route_matches_loop(m, e, top_k, n_group, topk_group, renormalize):
    g = torch.Generator().manual_seed(m * e)
    logits = torch.randn(m, e, generator=g).to(torch.bfloat16)
    bias = 0.1 * torch.randn(e, generator=g)
    weights, ids = route(logits, bias, top_k, 2.827, n_group, topk_group, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (m, top_k)
    want_w, want_ids = route_loop(logits, bias, top_k, 2.827, n_group, topk_group, renormalize)
    assert torch.equal(ids.long(), want_ids)  # both in descending biased-score order
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.full((m,), 2.827), rtol=1e-5, atol=0)


def test_route_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[0.0, 0.0, 3.0, -3.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 chosen only thanks to its bias
    weights, ids = route(logits, bias, 2, 1.0, renormalize=False)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-3.0, 3.0]])))


# ----------------------------------------------------------------------------- alignment


def align_loop(topk_ids, block_size, num_experts, expert_map=None):
    """Straightforward per-expert loop of vLLM's contract (route ids ascending per expert)."""
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    sorted_ids, experts = [], []
    for e in range(num_experts):
        routes = [r for r, x in enumerate(flat) if x == e]
        if not routes:
            continue
        padded = -(-len(routes) // block_size) * block_size
        sorted_ids += routes + [sentinel] * (padded - len(routes))
        local = e if expert_map is None else int(expert_map[e])
        experts += [local] * (padded // block_size)
    return sorted_ids, experts


@pytest.mark.parametrize("m,top_k,e,block_size", [
    (1, 1, 4, 16), (3, 2, 8, 16), (5, 8, 64, 16), (33, 8, 64, 32), (128, 8, 48, 64), (7, 3, 5, 128),
])
@pytest.mark.parametrize("with_map", [False, True])
def test_align_matches_loop_and_invariants(m, top_k, e, block_size, with_map):
    g = torch.Generator().manual_seed(m + e)
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)])
    topk_ids = topk_ids.to(torch.int32)
    topk_ids[torch.rand(m, top_k, generator=g) < 0.1] = -1  # dropped routes
    expert_map = None
    if with_map:  # every other expert is local, renumbered 0, 1, ...
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[::2] = torch.arange((e + 1) // 2, dtype=torch.int32)
    sorted_ids, expert_ids, ntp = moe_align_block_size(topk_ids, block_size, e, expert_map)

    capacity = m * top_k + e * (block_size - 1)
    assert sorted_ids.dtype == expert_ids.dtype == ntp.dtype == torch.int32
    assert sorted_ids.shape == (capacity,) and ntp.shape == (1,)
    assert expert_ids.shape == (-(-capacity // block_size),)
    n = int(ntp[0])
    assert n % block_size == 0 and n <= capacity
    want_ids, want_experts = align_loop(topk_ids, block_size, e, expert_map)
    assert sorted_ids[:n].tolist() == want_ids
    assert expert_ids[: n // block_size].tolist() == want_experts
    assert (sorted_ids[n:] == m * top_k).all() and (expert_ids[n // block_size:] == 0).all()
    # Every kept route appears exactly once; within a block, valid ids come first.
    valid = sorted_ids[sorted_ids < m * top_k]
    assert sorted(valid.tolist()) == (topk_ids.reshape(-1) >= 0).nonzero().squeeze(-1).tolist()
    blocks = sorted_ids[:n].view(-1, block_size) < m * top_k
    assert (blocks.int().diff(dim=1) <= 0).all()


def test_mixed_tiles_cover_each_expert_with_least_padding():
    counts = torch.tensor([0, 1, 32, 33, 64, 85, 96, 97, 128, 170, 200, 255])
    rows = mixed_tiles(counts, (128, 64, 32))
    assert rows.tolist() == [
        [0, 0, 0, 0, 0, 0, 0, 128, 128, 128, 128, 256],  # 97+: one more 128 is no worse
        [0, 0, 0, 64, 64, 64, 64, 0, 0, 64, 64, 0],
        [0, 32, 32, 0, 0, 32, 32, 0, 0, 0, 32, 0],
    ]
    assert (rows.sum(0) >= counts).all() and (rows.sum(0) - counts < 32).all()
    assert mixed_tiles(counts, (64,)).tolist() == [(-(-counts // 64) * 64).tolist()]
    for bad in ((64, 64), (32, 64), (96, 64), (96, 32, 8)):
        with pytest.raises(ValueError, match="halving"):
            mixed_tiles(counts, bad)


def test_mixed_tiles_take_a_small_remainder_tile_under_the_gluon_96():
    """(96, 32): a remainder of up to 32 rows takes a 32-row tile, a larger one another 96."""
    counts = torch.tensor([0, 1, 32, 33, 85, 96, 97, 128, 129, 200, 300])
    rows = mixed_tiles(counts, (96, 32))
    assert rows.tolist() == [
        [0, 0, 0, 96, 96, 96, 96, 96, 192, 192, 288],
        [0, 32, 32, 0, 0, 0, 32, 32, 0, 32, 32],
    ]
    assert (rows.sum(0) >= counts).all()
    assert mixed_tiles(counts, (96, 32, 16))[1:].sum(0).max() <= 48


@pytest.mark.parametrize("sizes", [(64, 32, 16), (32, 16), (16,)])
@pytest.mark.parametrize("with_map", [False, True])
def test_align_mixed_pieces(sizes, with_map):
    """Every kept route lands in exactly one block of one size; each piece is a valid
    moe_align_block_size result trimmed to its live blocks; an expert's rows of each size are
    those mixed_tiles gives it."""
    m, top_k, e = 90, 4, 6
    g = torch.Generator().manual_seed(5)
    # skewed routing: experts get 1..~140 rows, so every size is used
    probs = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.05])
    topk_ids = torch.stack([torch.multinomial(probs, top_k, generator=g) for _ in range(m)])
    topk_ids = topk_ids.to(torch.int32)
    topk_ids[torch.rand(m, top_k, generator=g) < 0.1] = -1
    expert_map = None
    if with_map:
        expert_map = torch.arange(e, dtype=torch.int32)
        expert_map[2] = -1
    pieces = moe_align_mixed(topk_ids, sizes, e, expert_map)
    flat = topk_ids.reshape(-1)
    counts = torch.bincount(flat[flat >= 0].long(), minlength=e)
    want_rows = mixed_tiles(counts, sizes)
    seen = []
    assert [bs for bs, _ in pieces] == [bs for bs, r in zip(sizes, want_rows) if r.sum() > 0]
    for bs, (sorted_ids, expert_ids, ntp) in pieces:
        i = sizes.index(bs)
        assert sorted_ids.numel() == int(ntp[0]) == expert_ids.numel() * bs
        blocks = sorted_ids.view(-1, bs)
        assert ((blocks < m * top_k).int().diff(dim=1) <= 0).all()  # valid ids first
        per_expert = torch.zeros(e, dtype=torch.long)
        for b, ex in enumerate(expert_ids.tolist()):
            owner = flat[blocks[b][blocks[b] < m * top_k].long()].long()
            assert owner.numel() > 0 and (owner == owner[0]).all()  # one expert per block
            want_ex = int(owner[0]) if expert_map is None else int(expert_map[owner[0]])
            assert ex == want_ex
            per_expert[owner[0]] += bs
        assert per_expert.tolist() == want_rows[i].tolist()
        seen += sorted_ids[sorted_ids < m * top_k].tolist()
    assert sorted(seen) == (flat >= 0).nonzero().squeeze(-1).tolist()


def test_align_empty_and_all_dropped():
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    sorted_ids, expert_ids, ntp = moe_align_block_size(ids, 16, 4)
    assert int(ntp[0]) == 0 and (sorted_ids == 6).all()


# ----------------------------------------------------------------------------- grouped GEMMs


def test_indexed_reference_vs_float64():
    m, top_k, e, n, k, bm = 6, 2, 5, 64, 96, 16
    codes, packed, scale = random_weights(e, n, k)
    x = randn_bf16(m, k)
    topk_ids = torch.tensor([[0, 1], [1, 2], [4, 0], [0, -1], [2, 1], [4, 3]], dtype=torch.int32)
    expert_map = torch.tensor([0, 1, 2, -1, 4], dtype=torch.int32)  # expert 3 is remote
    sorted_ids, expert_ids, ntp = moe_align_block_size(topk_ids, bm, e, expert_map)
    got = moe_gemm_indexed_reference(x, packed, scale, sorted_ids, expert_ids, ntp, top_k, bm)
    w = dense64(codes, scale)
    for r, ex in enumerate(topk_ids.reshape(-1).tolist()):
        if ex in (-1, 3):
            assert (got[r] == 0).all()
        else:
            want = w[ex] @ x[r // top_k].double()
            assert cos_diff(got[r], want) < REF_VS_FLOAT64_MAX_COS_DIFF
    # down: top_k = 1 reads row r itself
    y = randn_bf16(m * top_k, k, seed=2)
    got = moe_gemm_indexed_reference(y, packed, scale, sorted_ids, expert_ids, ntp, 1, bm)
    assert cos_diff(got[2], w[1] @ y[2].double()) < REF_VS_FLOAT64_MAX_COS_DIFF


def silu_mul64(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_contiguous_and_masked_reference_vs_float64():
    e, n, k = 3, 64, 64
    codes, packed, scale = random_weights(e, n, k)
    w = dense64(codes, scale)
    counts = [5, 0, 130]
    m_indices = torch.cat([torch.tensor([ex] * c + [-1] * (-c % 128), dtype=torch.int32)
                           for ex, c in enumerate(counts)])
    x = randn_bf16(m_indices.numel(), k)
    got = grouped_gemm_contiguous_reference(x, packed, scale, m_indices, activation="silu_mul")
    assert got.shape == (m_indices.numel(), n // 2)
    for ex in range(e):
        rows = (m_indices == ex).nonzero().squeeze(-1)
        if rows.numel():
            want = silu_mul64(x[rows].double() @ w[ex].T)
            assert cos_diff(got[rows], want) < REF_VS_FLOAT64_MAX_COS_DIFF
    assert (got[m_indices < 0] == 0).all()

    max_m = 40
    masked_m = torch.tensor([3, 0, 40], dtype=torch.int32)
    xm = randn_bf16(e, max_m, k)
    got = grouped_gemm_masked_reference(xm, packed, scale, masked_m).view(e, max_m, n)
    for g in range(e):
        c = int(masked_m[g])
        if c:
            assert cos_diff(got[g, :c], xm[g, :c].double() @ w[g].T) < REF_VS_FLOAT64_MAX_COS_DIFF
        assert (got[g, c:] == 0).all()


def test_moe_sum_reference_skips_unrouted_rows():
    y = randn_bf16(6, 8)
    y[1] = float("nan")  # route (0, 1) is unrouted: its row was never written
    weights = torch.tensor([[0.5, 2.0], [1.0, 0.25], [0.0, 3.0]])
    ids = torch.tensor([[0, -1], [3, 1], [2, 2]], dtype=torch.int32)
    got = moe_sum_reference(y, weights, ids)
    want = torch.stack([0.5 * y[0].float(), y[2].float() + 0.25 * y[3].float(), 3.0 * y[5].float()])
    torch.testing.assert_close(got, want.to(torch.bfloat16))


# ----------------------------------------------------------------------------- MoE forward


def moe_float64(x, codes13, s13, codes2, s2, topk_weights, topk_ids):
    w13, w2 = dense64(codes13, s13), dense64(codes2, s2)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, ex in enumerate(topk_ids[t].tolist()):
            if ex >= 0:
                h = silu_mul64(w13[ex] @ x[t].double())
                out[t] += float(topk_weights[t, j]) * (w2[ex] @ h)
    return out


@pytest.mark.parametrize("m,h,i,e,top_k", [
    (1, 64, 32, 4, 1),
    (5, 128, 64, 8, 2),
    (3, 7168, 2048, 2, 2),  # Kimi K2 expert size, two experts
])
def test_fused_moe_reference_vs_float64(m, h, i, e, top_k):
    codes13, w13, s13 = random_weights(e, 2 * i, h, seed=3)
    codes2, w2, s2 = random_weights(e, h, i, seed=4)
    x = randn_bf16(m, h)
    topk_weights, topk_ids = route(torch.randn(m, e), torch.zeros(e), top_k, 2.5)
    topk_ids[0, -1] = -1  # an expert on another rank
    got = fused_moe(x, w13, s13, w2, s2, topk_weights, topk_ids)  # CPU: the reference
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    assert torch.equal(got, fused_moe_reference(x, w13, s13, w2, s2, topk_weights, topk_ids))
    want = moe_float64(x, codes13, s13, codes2, s2, topk_weights, topk_ids)
    assert cos_diff(got, want) < REF_VS_FLOAT64_MAX_COS_DIFF


def test_fused_moe_rejects_bad_inputs():
    _, w13, s13 = random_weights(2, 64, 64)
    _, w2, s2 = random_weights(2, 64, 32)
    x = randn_bf16(3, 64)
    ids = torch.zeros(3, 1, dtype=torch.int32)
    weights = torch.ones(3, 1)
    with pytest.raises(ValueError, match="impl"):
        fused_moe(x, w13, s13, w2, s2, weights, ids, impl="cuda")
    with pytest.raises(ValueError, match="w2_packed"):
        fused_moe(x, w13, s13, w2[:, :32], s2, weights, ids)
    with pytest.raises(ValueError, match="hidden_states"):
        fused_moe(x.float(), w13, s13, w2, s2, weights, ids)
