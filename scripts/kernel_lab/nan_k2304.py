"""Repro of kernel_notes item 5 (GPU): the fused gate_up fragment tile for 128-row blocks as
128x64x64, 4 warps, 4 stages gave NaN in most rows at K = 2304 on the H200. Prints the NaN
count and cos_diff of the owned rows per K for that tile and the shipped one (``REMOTE=1``,
the default: ``E`` experts (8), 15% of routes dropped and a remote expert, as the GPU test
``test_indexed_heuristic_gated_128_row_tile``; ``REMOTE=0``: neither), so it can run under
``compute-sanitizer --tool memcheck|racecheck python scripts/kernel_lab/nan_k2304.py [K ..]``.
"""

import os
import sys

import torch

from chordq.kernels.align import moe_align_block_size
from chordq.kernels.reference import cos_diff, moe_gemm_indexed_reference
from chordq.kernels.triton_config import W4A16Config, choose_config
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton
from chordq.layout import fragment_order, pack_codes


def main(ks):
    g = torch.Generator().manual_seed(0)
    e, n, m, top_k = int(os.environ.get("E", "8")), 4096, 60, 4
    for k in ks:
        codes = torch.randint(0, 16, (e, n, k), generator=g)
        w = pack_codes(codes).cuda()
        s = (0.02 * torch.exp2(torch.randn(e, n, k // 32, generator=g))).to(torch.bfloat16).cuda()
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
        topk = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)])
        topk = topk.to(torch.int32)
        if REMOTE:  # as the GPU test: 15% of routes dropped, expert 3 on another rank
            topk[torch.rand(m, top_k, generator=g) < 0.15] = -1
        expert_map = torch.arange(e, dtype=torch.int32)
        expert_map[3] = -1 if REMOTE else 3
        aligned = [t.cuda() for t in moe_align_block_size(topk, 128, e, expert_map)]
        want = moe_gemm_indexed_reference(x, w, s, *aligned, top_k, 128, activation="silu_mul")
        for cfg in (W4A16Config(128, 64, 64, 4, 4, k_order="fragments"),
                    choose_config(120, n // 2, k, gated=True, block_m=128, w_order="fragments")):
            got = moe_gemm_indexed_triton(x, fragment_order(w), s, *aligned, top_k, 128,
                                          activation="silu_mul", config=cfg, w_order="fragments")
            torch.cuda.synchronize()
            flat = topk.reshape(-1).cuda()
            owned = (flat >= 0) & (flat != 3) if REMOTE else flat >= 0
            got, want_o = got[owned], want[owned]
            print(f"K={k} E={e} remote={REMOTE} {cfg.label}: nan {int(got.isnan().sum())} of "
                  f"{got.numel()}, "
                  f"cos_diff {cos_diff(got.float().nan_to_num(), want_o):.2e}", flush=True)


REMOTE = os.environ.get("REMOTE", "1") == "1"

if __name__ == "__main__":
    main([int(v) for v in sys.argv[1:]] or [2048, 2304])
