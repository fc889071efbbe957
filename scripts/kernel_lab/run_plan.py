"""Time tile configs of the indexed W4A16 GEMM on the GPU (CUDA graphs), one JSON plan per run.

The variant measurements in docs/kernel_notes.md come from these plans (``plan1.json`` ..
``plan4.json``). A plan is a list of ``{"proj": "gate_up"|"down", "T": tokens, "act": null |
"silu_mul", "configs": [[BM, BN, BK, warps, stages, k_order, split_k?, max_registers?], ...]}``
at Kimi K2 EP8 shapes (48 experts, top-8; ``chordq.kernels.bench``'s weights and routing).
"fragments" configs get ``chordq.layout.fragment_order`` words (converted once, untimed).

Usage (repo root, GPU machine): ``OUT=/tmp/lab python scripts/kernel_lab/run_plan.py
scripts/kernel_lab/plan3.json`` -> one line per config and ``$OUT/lab.json``.
"""

import json
import os
import sys
import time

import torch

from chordq.kernels import bench as B
from chordq.kernels.align import moe_align_block_size
from chordq.kernels.reference import cos_diff, moe_gemm_indexed_reference
from chordq.kernels.triton_config import W4A16Config
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton
from chordq.layout import fragment_order


def main(plan_path: str) -> None:
    out_dir = os.environ.get("OUT", "/tmp/lab")
    budget_s = float(os.environ.get("LAB_BUDGET_S", "480"))
    os.makedirs(out_dir, exist_ok=True)
    plan = json.loads(open(plan_path).read())
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = B._make_weights(gen)
    routings, frag, results, start = {}, {}, [], time.time()
    for item in plan:
        proj, tokens, act = item["proj"], item["T"], item.get("act")
        routings.setdefault(tokens, B._routing(tokens, gen))
        topk = routings[tokens]
        p = B._projections()[proj]
        w, s = weights[proj]
        rows = 8 * tokens
        x = torch.randn(tokens if proj == "gate_up" else rows, p["k"], generator=gen,
                        device="cuda").to(torch.bfloat16)
        top_k = 8 if proj == "gate_up" else 1
        n_out = p["n"] // 2 if act else p["n"]
        bytes_, flops = B._bytes_and_flops(proj, tokens, int(torch.unique(topk).numel()))
        floor_us = max(bytes_ / B.HBM_BYTES_PER_S, flops / B.BF16_FLOPS) * 1e6
        want = None
        for c in item["configs"]:
            if time.time() - start > budget_s:
                print("time budget reached", flush=True)
                break
            cfg = W4A16Config(*c[:5], k_order=c[5], split_k=c[6] if len(c) > 6 else 1,
                              max_registers=c[7] if len(c) > 7 else None)
            order = "fragments" if cfg.k_order == "fragments" else "checkpoint"
            if order == "fragments" and proj not in frag:
                frag[proj] = fragment_order(w)
            words = frag[proj] if order == "fragments" else w
            aligned = moe_align_block_size(topk, cfg.block_m, 48)
            out = torch.empty(rows, n_out, dtype=torch.bfloat16, device="cuda")

            def fn(aligned=aligned, cfg=cfg, words=words, out=out, order=order):
                return moe_gemm_indexed_triton(x, words, s, *aligned, top_k, cfg.block_m,
                                               activation=act, config=cfg, out=out,
                                               w_order=order)

            try:
                got = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - report the config and go on
                print(f"{proj} T={tokens} {cfg.label} FAILED {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)
                continue
            if want is None:
                want = moe_gemm_indexed_reference(x, w, s, *aligned, top_k, cfg.block_m,
                                                  activation=act)
            r = {"proj": proj, "T": tokens, "act": act, "config": cfg.label,
                 "cos_diff": cos_diff(got, want), "graph_us": B._time_graph(fn, 5)}
            r["pct_of_floor"] = 100 * floor_us / r["graph_us"]
            results.append(r)
            print(f"{proj:7s} {str(act):8s} T={tokens:5d} {cfg.label:26s} "
                  f"cos={r['cos_diff']:.1e} {r['graph_us']:8.1f} µs "
                  f"{r['pct_of_floor']:5.1f}% of floor", flush=True)
            json.dump(results, open(f"{out_dir}/lab.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
