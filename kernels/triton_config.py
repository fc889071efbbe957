"""Tile configs for the W4A16 grouped GEMMs and the heuristic that picks them (no autotuning).

Names follow the *output* (rows = tokens/routes, columns = N features). Inside the kernel the
dot is swapped, ``C^T[BLOCK_N, BLOCK_M] = W[BLOCK_N, BLOCK_K] . X^T[BLOCK_K, BLOCK_M]``, so the
dequantized weight tile is the dot's left operand (kernels.md §2.1) and BLOCK_M, the tokens,
sits in the dot's N slot where 16 is the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["W4A16Config", "choose_config"]

GROUP_SIZE = 32


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
    :param plane_major: visit each K tile in nibble-plane-major order (``_w4a16_tile``): the
        weight goes to the tensor cores without a shared-memory round trip, the X tile is
        permuted instead. For small row tiles with block_k >= 64.
    """

    block_m: int = 16
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    plane_major: bool = False

    def __post_init__(self) -> None:
        if not (_is_pow2(self.block_m) and 16 <= self.block_m <= 128):
            raise ValueError(f"block_m must be a power of two in [16, 128], got {self.block_m}")
        if not (_is_pow2(self.block_n) and self.block_n >= 16):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if not (_is_pow2(self.block_k) and self.block_k >= GROUP_SIZE):
            raise ValueError(f"block_k must be a power of two >= {GROUP_SIZE}, got {self.block_k}")


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
    interpret: bool = False,
) -> W4A16Config:
    """Pick a config from the problem shape.

    :param rows_per_expert: routed rows / local experts (e.g. ``M * top_k / E``)
    :param n: output features (``I`` for gate_up with ``silu_mul``, ``H`` for down)
    :param k: reduction size, a multiple of 32
    :param gated: the tile computes gate and up halves (two weight tiles per K step)
    :param block_m: force the row tile (e.g. to reuse one ``moe_align_block_size`` result)
    :param interpret: for Triton's CPU interpreter (CPU tensors), which pays per operation
        more than per element: big tiles, one stage

    Decode (few rows per expert) is weight-bandwidth bound: the smallest row tile, wide
    ``block_n * block_k`` weight tiles and 4 stages keep bytes in flight. Prefill is compute
    bound: row tiles sized to the rows per expert, shallower K steps to fit the stages.
    """
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    bm = _block_m_for(rows_per_expert) if block_m is None else block_m
    max_bn = max(16, _next_pow2(n))
    if interpret:
        bk = _largest_dividing(k, 512)
        return W4A16Config(bm, min(256, max_bn), bk, 4, 1, plane_major=bk >= 64)
    bn = min(64 if gated else 128, max_bn)  # gated tiles read two weight row sets
    # Tiles below were picked from `scripts/bench_kernels.py --sweep` on the H200 (2026-12-02,
    # docs/performance.md): 256-deep K steps (128-byte weight rows per load) win for gated
    # decode and for 32-row tiles; gated prefill prefers 4 warps and 4 stages.
    if bm <= 32:
        if gated or bm == 32:
            bk = _largest_dividing(k, 256)
            wide = gated and bm == 16 and rows_per_expert >= 1
            stages = 4 if gated and bm == 16 and not wide else 3
            return W4A16Config(bm, min(128, max_bn) if wide else bn, bk, num_warps=4,
                               num_stages=stages, plane_major=bk >= 64)
        bk = _largest_dividing(k, 128)
        return W4A16Config(bm, bn, bk, num_warps=4, num_stages=4, plane_major=bk >= 64)
    if bm == 64 or gated:
        return W4A16Config(bm, bn, _largest_dividing(k, 64), num_warps=4, num_stages=4)
    return W4A16Config(bm, bn, _largest_dividing(k, 64), num_warps=8, num_stages=3)
