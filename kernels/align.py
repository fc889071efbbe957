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

import itertools

import torch

__all__ = ["moe_align_block_size", "moe_align_mixed", "align_row_tiles", "mixed_tiles"]


def _check_expert_ids(flat: torch.Tensor, num_experts: int) -> None:
    if ((flat < -1) | (flat >= num_experts)).any():
        raise ValueError(f"topk_ids must lie in [-1, {num_experts}), "
                         f"got {int(flat.min())}..{int(flat.max())}")


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
    _check_expert_ids(flat, num_experts)
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


def mixed_tiles(counts: torch.Tensor, block_sizes: tuple[int, ...]) -> torch.Tensor:
    """Rows per expert covered by each tile size: ``[len(block_sizes), E]``, padded.

    ``block_sizes`` descend, and all but the first halve one to the next (``(128, 64, 32)``,
    or ``(96, 32)``: the Gluon prefill tile with a Triton remainder tile). Each expert takes
    full tiles of the largest size, then covers its remainder with at most one tile of each
    smaller size (the binary digits of the remainder rounded up to the smallest size), unless
    the remainder is more than the smaller sizes cover together, which then takes one more
    large tile (fewer, better-amortized tiles). 85 rows with ``(128, 64, 32)``: 64 + 32 (96
    rows) instead of 128; 170: 128 + 64. With ``(96, 32)``: 85 rows one 96, 100 rows 96 + 32,
    130 rows two 96.
    """
    big, small = block_sizes[0], block_sizes[-1]
    chain = block_sizes[1:]
    if (any(a != 2 * b for a, b in itertools.pairwise(chain))
            or chain and (big <= chain[0] or big % small)):
        raise ValueError(f"block sizes must descend, the smaller ones halving one to the next "
                         f"and dividing the largest, got {block_sizes}")
    full = counts // big
    rest = -(-(counts - full * big) // small) * small  # remainder rounded up to `small`
    whole = rest > sum(chain)
    full, rest = full + whole, torch.where(whole, 0, rest)
    rows = [full * big] + [rest & s for s in chain]
    return torch.stack(rows)


def moe_align_mixed(
    topk_ids: torch.Tensor,
    block_sizes: tuple[int, ...],
    num_experts: int,
    expert_map: torch.Tensor | None = None,
) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """``moe_align_block_size`` with row tiles of several sizes: one alignment per size.

    Power-of-two tiles pad an expert's rows to the next multiple of the tile: at 128-256 rows
    per expert (Kimi prefill, EP8 T=1024) a quarter of the 128-row tiles is padding. Here each
    expert's routes are split between tile sizes (``mixed_tiles``: 170 rows are one 128-row
    and one 64-row block instead of two 128-row blocks), and each size gets its own
    ``moe_align_block_size`` buffers (the other sizes' routes masked to -1) trimmed to their
    live blocks. One indexed GEMM launch per size then writes disjoint output rows.

    :param block_sizes: as for ``mixed_tiles``, e.g. ``(128, 64, 32)`` or ``(96, 32)``
    :returns: ``[(block_size, (sorted_token_ids, expert_ids, num_tokens_post_padded)), ...]``,
        largest size first, sizes without routes left out
    """
    flat = topk_ids.reshape(-1).long()
    num_routes = flat.numel()
    valid = flat >= 0
    _check_expert_ids(flat, num_experts)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    rows = mixed_tiles(counts, tuple(block_sizes))  # [S, E] rows of each size per expert
    ends = torch.cumsum(rows, 0)  # an expert's routes of rank in [ends[i-1], ends[i]) -> size i
    # each route's rank within its expert, in route order (as moe_align_block_size keeps it)
    key = torch.where(valid, flat, num_experts)
    order = torch.sort(key, stable=True).indices
    starts = torch.cat([torch.cumsum(counts, 0) - counts, counts.new_zeros(1)])
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(num_routes, device=flat.device) - starts[key[order]]
    size_of = (rank.unsqueeze(0) >= ends[:, flat.clamp(min=0)]).sum(0)
    pieces = []
    for i, bs in enumerate(block_sizes):
        mine = valid & (size_of == i)
        if not bool(mine.any()):
            continue
        ids = torch.where(mine, flat, -1).reshape(topk_ids.shape)
        sorted_ids, expert_ids, ntp = moe_align_block_size(ids, bs, num_experts, expert_map)
        blocks = int(ntp[0]) // bs
        pieces.append((bs, (sorted_ids[: blocks * bs], expert_ids[:blocks], ntp)))
    return pieces


def align_row_tiles(
    topk_ids: torch.Tensor,
    block_sizes: tuple[int, ...],
    num_experts: int,
    expert_map: torch.Tensor | None = None,
) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The alignment for ``triton_config.choose_row_tiles``' sizes, as pieces for
    ``moe_gemm_mixed_triton``: one size, ``moe_align_block_size``'s buffers as they are;
    several, ``moe_align_mixed``.
    """
    if len(block_sizes) == 1:
        bs = block_sizes[0]
        return [(bs, moe_align_block_size(topk_ids, bs, num_experts, expert_map))]
    return moe_align_mixed(topk_ids, block_sizes, num_experts, expert_map)
