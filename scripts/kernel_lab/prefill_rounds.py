"""Variant 57 (lab, prepared): what a persistent prefill grid's last round costs (GPU).

Why: variant 56's stream-K schedule spreads a thin last round of tiles over every program and
lost 2-5% at 43 rows an expert, where the rounds model (variant 55) had the last round cost a
full tile time (EP8 down T=256: 1344 tiles, 10.2 rounds of 132 SMs, charged as 11). If a thin
round's few tiles run faster, having the memory system nearly to themselves, the time grows
with the tiles smoothly rather than in steps of one round; if not, it steps where the tiles
pass a multiple of the SMs. This measures which, for the 64-row Gluon tile (its 256-row and
wide forms, each plain and with stream-K).

Each of n experts gets exactly 64 routes (one full 64-row block), so the grid holds n x N /
block_n tiles of equal work; n runs over the layout's experts, the tiles across several
multiples of the SM count. Prints µs and µs per tile for each n, interleaved CUDA-graph
replays (``bench_humming.time_graphs``), and writes ``$OUT/prefill_rounds.json``.

usage (GPU machine, repo root): ``OUT=/tmp/lab [ROUNDS_PROJ=down] python3
scripts/kernel_lab/prefill_rounds.py``
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from chordq.kernels.align import moe_align_block_size
from chordq.kernels.bench_humming import LAYOUTS, convert_weights, make_weights, time_graphs
from chordq.kernels.triton_config import GLUON_PREFILL_TILE_64, GLUON_PREFILL_TILE_64_WIDE
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton

ROWS = 64  # routes an expert: one full 64-row block
CONFIGS = {
    "256-row": GLUON_PREFILL_TILE_64,
    "256-row sk": dataclasses.replace(GLUON_PREFILL_TILE_64, stream_k=1),
    "wide": GLUON_PREFILL_TILE_64_WIDE,
    "wide sk": dataclasses.replace(GLUON_PREFILL_TILE_64_WIDE, stream_k=1),
}


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/lab")
    os.makedirs(out_dir, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for proj in os.environ.get("ROUNDS_PROJ", "down,gate_up").split(","):
        p = next(q for q in LAYOUTS["EP8"] if q.proj == proj)
        words, scales = convert_weights(*make_weights(p, 0, "cuda"), "blocked")
        counts = range(max(1, p.num_experts - 18), p.num_experts + 1)
        for name, cfg in CONFIGS.items():
            if p.n % cfg.block_n:
                continue
            fns = {}
            for n in counts:
                experts = torch.randperm(p.num_experts, generator=gen, device="cuda")[:n]
                topk = experts.to(torch.int32).repeat_interleave(ROWS)[:, None]
                x = torch.randn(n * ROWS, p.k, generator=gen, device="cuda").to(torch.bfloat16)
                aligned = moe_align_block_size(topk, ROWS, p.num_experts)
                out = torch.empty(n * ROWS, p.n, dtype=torch.bfloat16, device="cuda")
                fns[n] = (lambda x=x, aligned=aligned, out=out, cfg=cfg:
                          moe_gemm_indexed_triton(x, words, scales, *aligned, 1, ROWS,
                                                  config=cfg, out=out, w_order="blocked"))
            times = time_graphs(fns, 3, 20)
            for n in counts:
                tiles = n * p.n // cfg.block_n
                us = times[n].get("graph_us")
                results.append({"proj": proj, "form": name, "config": cfg.label, "experts": n,
                                "tiles": tiles, "rounds": tiles / sms, "us": us})
                print(f"EP8 {proj:7s} {name:10s} experts={n:3d} tiles={tiles:5d} "
                      f"rounds={tiles / sms:5.2f} {us:8.1f} µs {us / tiles * sms:7.2f} µs a "
                      f"round of tiles", flush=True)
    with open(os.path.join(out_dir, "prefill_rounds.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
