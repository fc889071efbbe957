"""vLLM's ``moe_align_block_size`` in plain PyTorch (format.md §5.1).

The indexed kernels take their rows from three buffers built here::

    sorted_token_ids  int32 [M*top_k + E*(block_size-1)]   flat route ids r = token*top_k + slot,
                      grouped by expert, each expert's segment padded to a multiple of
                      block_size with the sentinel M*top_k
    expert_ids        int32 [ceil(capacity / block_size)]   expert per block (through expert_map,
                      so non-local experts read -1); blocks past the end stay 0
    num_tokens_post_padded  int32 [1]                       sum of the padded segment lengths

Within a segment the route ids ascend (vLLM's CUDA kernel gives no order guarantee; the
kernels rely only on "valid ids first, then sentinels" inside each block). Routes whose
``topk_ids`` is -1 are dropped; experts with no routes get no blocks.
"""

from __future__ import annotations

import torch

__all__ = ["moe_align_block_size"]


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group routes by expert in blocks of ``block_size`` rows.

    :param topk_ids: int ``[M, top_k]`` global expert ids in ``[0, num_experts)``, or -1
    :param block_size: rows per block (the kernel's BLOCK_M)
    :param num_experts: global expert count E
    :param expert_map: optional int ``[E]`` global -> local expert id, -1 where not local
    :returns: ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, all int32 on
        ``topk_ids.device`` (see the module docstring)
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_routes = flat.numel()
    if ((flat < -1) | (flat >= num_experts)).any():
        raise ValueError(f"topk_ids must lie in [-1, {num_experts}), "
                         f"got {int(flat.min())}..{int(flat.max())}")
    capacity = num_routes + num_experts * (block_size - 1)
    sorted_token_ids = torch.full((capacity,), num_routes, dtype=torch.int32, device=device)
    expert_ids = torch.zeros(-(-capacity // block_size), dtype=torch.int32, device=device)

    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts)  # routes per expert
    blocks = (counts + block_size - 1) // block_size  # blocks per expert
    block_start = torch.cumsum(blocks, 0) - blocks  # first block of each expert
    num_blocks = int(blocks.sum())

    # Stable sort keeps route ids ascending within each expert; -1 routes sort last.
    key = torch.where(valid, flat, num_experts)
    order = torch.sort(key, stable=True).indices[: int(valid.sum())]
    experts = flat[order]
    rank = torch.arange(order.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_token_ids[block_start[experts] * block_size + rank] = order.to(torch.int32)

    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), blocks)
    if expert_map is not None:
        block_expert = expert_map.to(device).long()[block_expert]
    expert_ids[:num_blocks] = block_expert.to(torch.int32)
    num_tokens_post_padded = torch.tensor([num_blocks * block_size], dtype=torch.int32,
                                          device=device)
    return sorted_token_ids, expert_ids, num_tokens_post_padded
