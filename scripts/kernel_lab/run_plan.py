"""Time tile configs of the indexed W4A16 GEMM on the GPU (CUDA graphs), one JSON plan per run.

The variant measurements in docs/kernel_notes.md come from these plans (``plan1.json`` ..
``plan4.json``). A plan is a list of ``{"proj": "gate_up"|"down", "T": tokens, "act": null |
"silu_mul", "layout"?: "EP8" | "TP8", "configs": [[BM, BN, BK, warps, stages, k_order, split_k?,
max_registers?, n_tiles?, stream_k?, columns_first?], ...]}`` at Kimi K2 shapes (``bench_humming.LAYOUTS``: EP8 48 experts, the
default; TP8 384 experts, gate_up N=512 K=7168, down N=7168 K=256), top-8, random words over all
16 levels and a uniform routing draw per (layout, T).
"fragments" and "subnormal" configs get ``chordq.layout.fragment_order`` words, "subnormal"
ones ``chordq.layout.subnormal_scales`` (converted once, untimed).

The configs of one item are timed together, their CUDA-graph replays interleaved (as the
side-by-side bench does), so clock and thermal drift hit every config alike (timed one after
another, lab and bench disagreed by more than the effect measured: variant 17 in
docs/kernel_notes.md). ``LAB_DRAWS`` repeats each item over new
routing draws, ``LAB_REPS`` sets the interleaved repetitions (median), ``LAB_BUDGET_S`` stops
starting new items.

Usage (repo root, GPU machine): ``OUT=/tmp/lab [LAB_DRAWS=2] python scripts/kernel_lab/run_plan.py
scripts/kernel_lab/plan3.json`` -> one line per config and ``$OUT/lab.json``.
"""

import json
import os
import sys
import time

import torch

from chordq.kernels import bench as B
from chordq.kernels.bench_humming import LAYOUTS, convert_weights, floor_model, time_graphs
from chordq.kernels.align import moe_align_block_size
from chordq.kernels.reference import cos_diff, moe_gemm_indexed_reference
from chordq.kernels.triton_config import W_ORDER_OF, W4A16Config
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton


def main(plan_path: str) -> None:
    out_dir = os.environ.get("OUT", "/tmp/lab")
    budget_s = float(os.environ.get("LAB_BUDGET_S", "480"))
    draws = int(os.environ.get("LAB_DRAWS", "1"))  # routing draws per item
    reps = int(os.environ.get("LAB_REPS", "5"))  # interleaved graph replays per config
    os.makedirs(out_dir, exist_ok=True)
    plan = json.loads(open(plan_path).read())
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, converted, results, start = {}, {}, [], time.time()
    for item, draw in ((item, d) for item in plan for d in range(draws)):
        if time.time() - start > budget_s:
            print("time budget reached", flush=True)
            break
        proj, tokens, act = item["proj"], item["T"], item.get("act")
        layout = item.get("layout", "EP8")
        p = next(q for q in LAYOUTS[layout] if q.proj == proj)
        key = (layout, proj)
        if key not in weights:
            words = torch.randint(-2**31, 2**31, (p.num_experts, p.n, p.k // 8), generator=gen,
                                  dtype=torch.int64, device="cuda").to(torch.int32)
            scale = (0.01 * torch.exp2(0.5 * torch.randn(p.num_experts, p.n, p.k // 32,
                                                          generator=gen, device="cuda")))
            weights[key] = (words, scale.to(torch.bfloat16))
        w, s = weights[key]
        topk = torch.rand(tokens, p.num_experts, generator=gen,
                          device="cuda").topk(8, dim=-1).indices.to(torch.int32)
        rows = 8 * tokens
        x = torch.randn(p.input_rows(tokens), p.k, generator=gen,
                        device="cuda").to(torch.bfloat16)
        top_k = p.top_k
        n_out = p.n // 2 if act else p.n
        floor_us = floor_model(p, tokens, int(torch.unique(topk).numel()))["floor_us"]
        want, fns, rec = None, {}, {}
        for c in item["configs"]:
            cfg = W4A16Config(*c[:5], k_order=c[5], split_k=c[6] if len(c) > 6 else 1,
                              max_registers=c[7] if len(c) > 7 else None,
                              n_tiles=c[8] if len(c) > 8 else 1,
                              stream_k=c[9] if len(c) > 9 else 0,
                              columns_first=bool(c[10]) if len(c) > 10 else False)
            order = W_ORDER_OF.get(cfg.k_order, "checkpoint")
            if (key, order) not in converted:
                converted[(key, order)] = convert_weights(w, s, order)
            words, scales = converted[(key, order)]
            aligned = moe_align_block_size(topk, cfg.block_m, p.num_experts)
            out = torch.empty(rows, n_out, dtype=torch.bfloat16, device="cuda")

            def fn(aligned=aligned, cfg=cfg, words=words, scales=scales, out=out, order=order):
                return moe_gemm_indexed_triton(x, words, scales, *aligned, top_k, cfg.block_m,
                                               activation=act, config=cfg, out=out,
                                               w_order=order)

            try:
                got = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - report the config and go on
                print(f"{layout} {proj} T={tokens} {cfg.label} FAILED {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)
                continue
            if want is None:  # every alignment routes the same rows: one reference per item
                want = moe_gemm_indexed_reference(x, w, s, *aligned, top_k, cfg.block_m,
                                                  activation=act)
            fns[cfg.label] = fn
            rec[cfg.label] = {"layout": layout, "proj": proj, "T": tokens, "act": act,
                              "draw": draw, "config": cfg.label,
                              "cos_diff": cos_diff(got, want)}
        # interleaved repetitions (A B C, C B A, ...)
        base = None
        for label, t in time_graphs(fns, reps, B.GRAPH_CALLS).items():
            r = rec[label]
            r["graph_us"] = t.get("graph_us")
            if not r["graph_us"]:
                print(f"{layout} {proj} T={tokens} {label} graph failed: {t}", flush=True)
                continue
            base = base or r["graph_us"]
            r["pct_of_floor"] = 100 * floor_us / r["graph_us"]
            r["vs_first"] = r["graph_us"] / base
            results.append(r)
            print(f"{layout} {proj:7s} {str(act):8s} T={tokens:5d} draw {draw} {label:26s} "
                  f"cos={r['cos_diff']:.1e} {r['graph_us']:8.1f} µs "
                  f"{r['pct_of_floor']:5.1f}% of floor  x{r['vs_first']:.3f} of the first",
                  flush=True)
        json.dump(results, open(f"{out_dir}/lab.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
