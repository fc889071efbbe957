"""Plain-PyTorch oracles for the W4A16 MoE kernels: readable first, runs on CPU.

Every Triton kernel in this package has a twin here with the same arguments:

=================================  ==========================================
Triton (``triton_w4a16.py`` ...)   reference (this file)
=================================  ==========================================
``moe_gemm_indexed_triton``        ``moe_gemm_indexed_reference``
``grouped_gemm_contiguous_triton`` ``grouped_gemm_contiguous_reference``
``grouped_gemm_masked_triton``     ``grouped_gemm_masked_reference``
``moe_sum_triton``                 ``moe_sum_reference``
``fused_moe(impl="triton")``       ``fused_moe_reference``
=================================  ==========================================

Numerics (Chord's reference, format.md §4.1): ``W = bf16(code - 8) * bf16 scale`` rounded once
to BF16, then FP32 accumulation; GEMM outputs are rounded to BF16. The references return zeros
in output rows that the Triton kernels leave unwritten (sentinel / padding rows, expert -1).

Shapes: ``w_packed`` int32 ``[E, N, K/8]`` (chordq.layout), ``w_scale`` BF16 ``[E, N, K/32]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chordq.layout import unpack_codes

__all__ = [
    "GROUP_SIZE",
    "cos_diff",
    "dequantize",
    "route",
    "silu_and_mul_reference",
    "moe_gemm_indexed_reference",
    "grouped_gemm_contiguous_reference",
    "grouped_gemm_masked_reference",
    "moe_sum_reference",
    "fused_moe_reference",
]

GROUP_SIZE = 32


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2*sum(x*y) / sum(x*x + y*y)`` in float64 (DeepGEMM ``calc_diff``, Chord roofline).

    0 for identical tensors (including both all-zero), up to 2 for ``y = -x``.
    """
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1.0 - 2.0 * (x * y).sum() / denom)


def dequantize(w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., N, K/8]`` + BF16 scales ``[..., N, K/32]`` -> BF16 ``[..., N, K]``.

    ``bf16(code - 8)`` is exact; the product with the BF16 scale is rounded once to BF16,
    exactly what the kernels compute before their FP32-accumulating dot.
    """
    q = (unpack_codes(w_packed).to(torch.int16) - 8).to(torch.bfloat16)
    if q.shape[-1] != w_scale.shape[-1] * GROUP_SIZE:
        raise ValueError(f"K={q.shape[-1]} does not match scales {tuple(w_scale.shape)} (group 32)")
    return q * w_scale.to(torch.bfloat16).repeat_interleave(GROUP_SIZE, dim=-1)


def route(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi ``noaux_tc`` routing.

    :param router_logits: ``[M, E]`` any float dtype
    :param e_score_correction_bias: ``[E]``; added to the scores only to *choose* experts
    :param n_group, topk_group: group-limited choice (Kimi: 1, 1): a group scores the sum of its
        two best biased scores; only the ``topk_group`` best groups stay eligible
    :returns: ``(topk_weights float32 [M, top_k], topk_ids int32 [M, top_k])``; ids in
        descending order of biased score; weights are the unbiased sigmoid scores, divided by
        their sum when ``renormalize``, times ``routed_scaling_factor``
    """
    m, e = router_logits.shape
    scores = torch.sigmoid(router_logits.float())
    choice = scores + e_score_correction_bias.float()
    if n_group > 1:
        if e % n_group:
            raise ValueError(f"{e} experts do not split into n_group={n_group} groups")
        grouped = choice.view(m, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [M, n_group]
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(m, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights * routed_scaling_factor, topk_ids.to(torch.int32)


def silu_and_mul_reference(h: torch.Tensor) -> torch.Tensor:
    """``[R, 2I]`` (gate columns, then up) -> BF16 ``[R, I]`` = silu(gate) * up, in FP32."""
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def _expert_matmul(
    x_rows: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, activation: str | None
) -> torch.Tensor:
    """BF16 ``[R, K]`` @ dequantized expert ``[N, K]``^T in FP32 -> BF16 ``[R, N]``.

    With ``activation="silu_mul"`` the result is ``[R, N/2]``.
    """
    out = (x_rows.float() @ dequantize(w_packed, w_scale).float().T).to(torch.bfloat16)
    return silu_and_mul_reference(out) if activation == "silu_mul" else out


def _out_features(w_packed: torch.Tensor, activation: str | None) -> int:
    return w_packed.shape[-2] // 2 if activation == "silu_mul" else w_packed.shape[-2]


def moe_gemm_indexed_reference(
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
) -> torch.Tensor:
    """Indexed (vLLM ``moe_align_block_size``) grouped GEMM.

    :param x: BF16 ``[M, K]``; route id ``r`` reads row ``r // top_k``
    :param sorted_token_ids: int32 route ids per block; ids ``>= num_routes`` are sentinels
    :param expert_ids: int32 ``[num_blocks]`` expert per block (-1: skipped)
    :param num_tokens_post_padded: int32 ``[1]``; only ``ntp / block_m`` blocks are read
    :param block_m: the alignment block size
    :param num_routes: number of valid route ids (default ``M * top_k``)
    :param activation: None, or ``"silu_mul"`` (``w`` holds gate rows then up rows)
    :returns: BF16 ``[num_routes, N]`` (``N/2`` with silu_mul); skipped rows are zero
    """
    num_routes = x.shape[0] * top_k if num_routes is None else num_routes
    ntp = int(num_tokens_post_padded[0])
    ids = sorted_token_ids[:ntp].long()
    experts = expert_ids[: ntp // block_m].long().repeat_interleave(block_m)
    valid = (ids < num_routes) & (experts >= 0)
    out = torch.zeros(num_routes, _out_features(w_packed, activation), dtype=torch.bfloat16,
                      device=x.device)
    for e in experts[valid].unique().tolist():
        routes = ids[valid & (experts == e)]
        out[routes] = _expert_matmul(x[routes // top_k], w_packed[e], w_scale[e], activation)
    return out


def grouped_gemm_contiguous_reference(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    m_indices: torch.Tensor,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Contiguous grouped GEMM (DeepGEMM style, format.md §5.2).

    :param x: BF16 ``[m, K]``, each expert's rows consecutive
    :param m_indices: int32 ``[m]`` expert id per row, -1 for padding rows
    :returns: BF16 ``[m, N]`` (``N/2`` with silu_mul); padding rows are zero
    """
    out = torch.zeros(x.shape[0], _out_features(w_packed, activation), dtype=torch.bfloat16,
                      device=x.device)
    for e in m_indices[m_indices >= 0].unique().tolist():
        rows = (m_indices == e).nonzero().squeeze(-1)
        out[rows] = _expert_matmul(x[rows], w_packed[e], w_scale[e], activation)
    return out


def grouped_gemm_masked_reference(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Masked grouped GEMM (DeepGEMM style, format.md §5.2).

    :param x: BF16 ``[G, max_m, K]`` (or flat ``[G * max_m, K]``); group ``g`` uses expert ``g``
        and its first ``masked_m[g]`` rows
    :param expected_m: unused here (a tile-size hint for the Triton twin)
    :returns: BF16 ``[G * max_m, N]`` (``N/2`` with silu_mul); rows past ``masked_m`` are zero
    """
    g_count = w_packed.shape[0]
    x = x.reshape(g_count, -1, x.shape[-1])
    max_m = x.shape[1]
    out = torch.zeros(g_count, max_m, _out_features(w_packed, activation), dtype=torch.bfloat16,
                      device=x.device)
    for g in range(g_count):
        rows = int(masked_m[g])
        if rows:
            out[g, :rows] = _expert_matmul(x[g, :rows], w_packed[g], w_scale[g], activation)
    return out.reshape(g_count * max_m, -1)


def moe_sum_reference(
    y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Weighted top-k reduction: BF16 ``[M, H] = sum_j w[m, j] * y[m * top_k + j]`` in FP32.

    Routes with ``topk_ids == -1`` contribute nothing (their ``y`` rows may hold garbage).
    """
    m, top_k = topk_ids.shape
    y = y.float().view(m, top_k, -1)
    w = torch.where(topk_ids >= 0, topk_weights.float(), 0.0).unsqueeze(-1)
    return torch.where(topk_ids.unsqueeze(-1) >= 0, y * w, 0.0).sum(dim=1).to(torch.bfloat16)


def fused_moe_reference(
    hidden_states: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """BF16 ``[M, H]`` = ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))``, e = ``topk_ids[m, j]``.

    Loops over the routed experts only, so a few real-size experts run on a CPU. Intermediate
    roundings follow the kernels: gate_up BF16, silu*up BF16, down BF16, FP32 top-k sum.
    Expert id -1 (an expert on another rank) contributes nothing.
    """
    m, h = hidden_states.shape
    out = torch.zeros(m, h, dtype=torch.float32, device=hidden_states.device)
    for e in topk_ids[topk_ids >= 0].unique().tolist():
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        act = _expert_matmul(hidden_states[tokens], w13_packed[e], w13_scale[e], "silu_mul")
        y = _expert_matmul(act, w2_packed[e], w2_scale[e], None)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(torch.bfloat16)
