"""Decode time against the number of experts touched, one route each (GPU): does the time step
where the grid's tiles pass a multiple of the CTA slots (SMs x CTAs per SM)?

For each layout and config, n distinct experts get one route each (top_k = 1, n tokens), so the
grid holds n x N / BLOCK_N tiles of equal work. Prints µs per n, interleaved CUDA-graph replays.

usage (GPU machine, repo root): OUT=/tmp/lab [SWEEP_LAYOUTS=TP8] python scripts/kernel_lab/wave_sweep.py
"""

import json
import os

import torch

from chordq.kernels.align import moe_align_block_size
from chordq.kernels.bench_humming import LAYOUTS, convert_weights, time_graphs
from chordq.kernels.triton_config import W4A16Config
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton

Z16 = {"k_order": "subnormal"}  # 16x128x256, 4 stages: 2 CTAs per SM
R128 = {"k_order": "subnormal", "max_registers": 128}  # 16x64x256, 3 stages: 4 CTAs per SM
SWEEPS = [  # (layout, proj, experts touched, configs)
    ("TP8", "gate_up", [112, 128, 132, 133, 136, 144, 166, 200],
     [W4A16Config(16, 128, 256, 4, 4, **Z16, columns_first=True),
      W4A16Config(16, 128, 256, 4, 4, **Z16, stream_k=2, columns_first=True),
      W4A16Config(16, 64, 256, 4, 3, **R128, columns_first=True),
      W4A16Config(16, 64, 256, 4, 3, **R128, stream_k=4, columns_first=True)]),
    ("EP8", "gate_up", range(16, 49, 4),
     [W4A16Config(16, 64, 256, 4, 3, **R128), W4A16Config(16, 64, 256, 4, 3, **R128,
                                                          columns_first=True),
      W4A16Config(16, 128, 256, 4, 4, **Z16), W4A16Config(16, 128, 256, 4, 4, **Z16, stream_k=2),
      W4A16Config(16, 128, 256, 4, 4, **Z16, columns_first=True)]),
]


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/lab")
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    layouts = os.environ.get("SWEEP_LAYOUTS", "TP8,EP8").split(",")
    for layout, proj, touched, configs in (w for w in SWEEPS if w[0] in layouts):
        p = next(q for q in LAYOUTS[layout] if q.proj == proj)
        words = torch.randint(-2**31, 2**31, (p.num_experts, p.n, p.k // 8), generator=gen,
                              dtype=torch.int64, device="cuda").to(torch.int32)
        scale = (0.003 * torch.exp2(0.5 * torch.randn(p.num_experts, p.n, p.k // 32,
                                                      generator=gen, device="cuda")))
        words, scales = convert_weights(words, scale.to(torch.bfloat16), "subnormal")
        for cfg in configs:
            fns = {}
            for n in touched:
                experts = torch.randperm(p.num_experts, generator=gen, device="cuda")[:n]
                topk = experts.to(torch.int32)[:, None]
                x = torch.randn(n, p.k, generator=gen, device="cuda").to(torch.bfloat16)
                aligned = moe_align_block_size(topk, cfg.block_m, p.num_experts)
                out = torch.empty(n, p.n, dtype=torch.bfloat16, device="cuda")
                fns[n] = (lambda x=x, aligned=aligned, out=out, cfg=cfg, w=words, s=scales:
                          moe_gemm_indexed_triton(x, w, s, *aligned, 1, cfg.block_m,
                                                  config=cfg, out=out, w_order="subnormal"))
            times = time_graphs(fns, 3, 20)
            for n in touched:
                tiles = n * p.n // cfg.block_n
                us = times[n].get("graph_us")
                results.append({"layout": layout, "proj": proj, "config": cfg.label,
                                "touched": n, "tiles": tiles, "us": us})
                print(f"{layout} {proj} {cfg.label:22s} experts={n:4d} tiles={tiles:5d} "
                      f"tiles/SM={tiles / sms:6.2f} {us:8.1f} µs  {us / n:6.3f} µs/expert",
                      flush=True)
    json.dump(results, open(f"{out_dir}/wave_sweep.json", "w"), indent=1)


if __name__ == "__main__":
    main()
