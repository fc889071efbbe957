"""Bit-exactness of the subnormal dequantization on the GPU: every config run with
``k_order="subnormal"`` (``chordq.layout.subnormal_scales``) must give the same bits as the
same tile with ``k_order="fragments"``, also for zero, negative, tiny (2**-133) and large
(0.498) scales. Prints one line per config; exits 1 on any difference.

usage (GPU machine, repo root): python scripts/kernel_lab/subnormal_check.py
"""

import sys

import torch

from chordq.kernels.align import moe_align_block_size
from chordq.kernels.triton_config import W4A16Config
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton
from chordq.layout import fragment_order, subnormal_scales

CASES = [  # (N, K, activation, top_k, tokens, config fields past k_order)
    (4096, 7168, None, 8, 20, (16, 64, 256, 4, 3), {"max_registers": 128}),
    (4096, 7168, "silu_mul", 8, 20, (16, 64, 256, 4, 4), {}),
    (512, 7168, None, 8, 20, (16, 128, 256, 4, 4), {"split_k": 2}),
    (4096, 7168, None, 8, 128, (32, 128, 256, 4, 3), {}),
    (4096, 7168, None, 8, 256, (64, 128, 64, 4, 4), {}),
    (7168, 2048, None, 1, 512, (128, 256, 128, 8, 3), {}),
    (4096, 7168, "silu_mul", 8, 512, (128, 64, 64, 4, 4), {}),
    (7168, 256, None, 1, 32, (16, 64, 256, 4, 4), {"n_tiles": 14}),
]


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, bad = 16, 0
    for n, k, act, top_k, tokens, tile, extra in CASES:
        words = torch.randint(-2**31, 2**31, (experts, n, k // 8), generator=gen,
                              dtype=torch.int64, device="cuda").to(torch.int32)
        scale = 0.01 * torch.exp2(2 * torch.randn(experts, n, k // 32, generator=gen,
                                                  device="cuda"))
        scale = torch.where(torch.rand(scale.shape, generator=gen, device="cuda") < 0.5,
                            scale, -scale).clamp(-0.498, 0.498).to(torch.bfloat16)
        flat = scale.view(-1)
        flat[:7] = torch.tensor([0.0, -0.0, 2**-133, -2**-133, 0.498, -0.498, 2**-127])
        rows = tokens if top_k > 1 else tokens * 8
        x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
        topk = torch.rand(rows, experts, generator=gen, device="cuda").topk(
            top_k, dim=-1).indices.to(torch.int32)
        aligned = moe_align_block_size(topk, tile[0], experts)
        wf = fragment_order(words)
        outs = {}
        for order, s in (("fragments", scale), ("subnormal", subnormal_scales(scale))):
            cfg = W4A16Config(*tile, k_order=order, **extra)
            outs[order] = moe_gemm_indexed_triton(x, wf, s, *aligned, top_k, tile[0],
                                                  activation=act, config=cfg, w_order=order)
        same = torch.equal(outs["fragments"], outs["subnormal"])
        bad += not same
        print(f"N={n} K={k} act={act} T={tokens} {cfg.label}: "
              f"{'bit-identical' if same else 'DIFFERENT'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
