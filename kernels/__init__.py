"""chordq.kernels: W4A16 MoE kernels for Kimi K2.x experts (Triton) and their PyTorch twins.

Weights are the checkpoint layout itself (chordq.layout): int32 ``[E, N, K/8]`` words, 8 INT4
codes per word along K (lowest nibble first, code = q + 8), BF16 scales ``[E, N, K/32]``.

Modules: ``reference`` (plain-PyTorch oracles + routing), ``align`` (moe_align_block_size,
moe_align_mixed), ``triton_w4a16`` (grouped GEMMs), ``gluon_w4a16`` (the 8-row decode tile
in Gluon) and ``gluon_prefill`` (the 128-, 96- and 64-row warp-specialized prefill tile; both
sm_90 only, picked by the heuristic), ``triton_moe_sum`` (top-k sum),
``triton_config`` (tile heuristic), ``moe`` (fused_moe dispatch, prepare_weights), ``bench``
(H200 benchmark), ``bench_humming`` (the same kernels side by side with humming-kernels, same
process and inputs).

The Triton-backed names are imported lazily, on first use, so ``route``, ``fused_moe(...,
impl="reference")`` and the references work without Triton, and so ``TRITON_INTERPRET`` may be
set after ``import chordq.kernels`` (it must be set before the first Triton name is touched).
"""

from __future__ import annotations

import importlib
from typing import Any

from .align import moe_align_block_size, moe_align_mixed
from .moe import fused_moe, prepare_weights
from .reference import (
    cos_diff,
    dequantize,
    fused_moe_reference,
    grouped_gemm_contiguous_reference,
    grouped_gemm_masked_reference,
    moe_gemm_indexed_reference,
    moe_sum_reference,
    route,
    silu_and_mul_reference,
)

# name -> submodule, resolved by __getattr__ on first access.
_LAZY = {
    "moe_gemm_indexed_triton": "triton_w4a16",
    "indexed_config": "triton_w4a16",
    "grouped_gemm_contiguous_triton": "triton_w4a16",
    "grouped_gemm_masked_triton": "triton_w4a16",
    "moe_sum_triton": "triton_moe_sum",
    "W4A16Config": "triton_config",
    "choose_config": "triton_config",
    "choose_n_tiles": "triton_config",
    "choose_row_tiles": "triton_config",
    "moe_gemm_mixed_triton": "triton_w4a16",
    "choose_split_k": "triton_config",
    "run_benchmark": "bench",
}

__all__ = [
    # Routing and the MoE forward
    "route",
    "moe_align_block_size",
    "moe_align_mixed",
    "fused_moe",
    "prepare_weights",
    # PyTorch references
    "cos_diff",
    "dequantize",
    "silu_and_mul_reference",
    "moe_gemm_indexed_reference",
    "grouped_gemm_contiguous_reference",
    "grouped_gemm_masked_reference",
    "moe_sum_reference",
    "fused_moe_reference",
    # Triton kernels, configs, benchmark (lazy)
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
