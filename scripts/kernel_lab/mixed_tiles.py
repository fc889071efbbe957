"""Time the indexed W4A16 GEMM with one row-tile size against mixed row tiles
(``align.moe_align_mixed`` + ``moe_gemm_mixed_triton``: one launch, blocks of 128 and 64 rows,
...) on the GPU, CUDA graphs, cos_diff against the reference on the single alignment.

Each row: the shipped single-size path (heuristic block_m and config), then each
``(sizes, config)`` variant (config None: the heuristic's for the largest size).

Usage (repo root, GPU machine): ``OUT=/tmp/lab python scripts/kernel_lab/mixed_tiles.py``
"""

import json
import os

import torch

from chordq.kernels import bench as B
from chordq.kernels.align import moe_align_block_size, moe_align_mixed
from chordq.kernels.bench_humming import LAYOUTS, floor_model
from chordq.kernels.reference import cos_diff, moe_gemm_indexed_reference
from chordq.kernels.triton_config import W4A16Config, choose_config
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton, moe_gemm_mixed_triton
from chordq.layout import fragment_order

GU, DN = [128, 128, 64, 4, 4], [128, 256, 128, 8, 3]
TWO, THREE = (128, 64), (128, 64, 32)
ROWS = [
    ("EP8", "gate_up", 1024, None, [(TWO, None), (THREE, None), (TWO, [128, 128, 64, 8, 3])]),
    ("EP8", "down", 1024, None, [(TWO, None), (THREE, None), (TWO, GU), (THREE, GU)]),
    ("TP8", "gate_up", 8192, None, [(TWO, None), (THREE, None)]),
    ("EP8", "gate_up", 1024, "silu_mul", [(TWO, None), (THREE, None)]),
    ("EP8", "gate_up", 512, None, [(TWO, None), (THREE, None), ((64, 32), [64, 128, 64, 4, 4])]),
    ("EP8", "down", 512, None, [(TWO, None), (THREE, None), (THREE, GU)]),
    ("EP8", "gate_up", 2048, None, [(TWO, None), (THREE, None)]),
    ("EP8", "down", 2048, None, [(TWO, None), (THREE, None), (THREE, GU)]),
    ("EP8", "gate_up", 8192, None, [(TWO, None), (THREE, None)]),
    ("EP8", "down", 8192, None, [(TWO, None), (THREE, None)]),
    ("EP8", "gate_up", 256, None, [((64, 32), None), ((64, 32, 16), None), (THREE, None)]),
    ("TP8", "gate_up", 2048, None, [((64, 32), None), ((64, 32, 16), None)]),
]


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/lab")
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, routings, results = {}, {}, []
    for layout, proj, tokens, act, variants in ROWS:
        p = next(q for q in LAYOUTS[layout] if q.proj == proj)
        if (layout, proj) not in weights:
            w = torch.randint(-2**31, 2**31, (p.num_experts, p.n, p.k // 8), generator=gen,
                              dtype=torch.int64, device="cuda").to(torch.int32)
            s = (0.01 * torch.exp2(0.5 * torch.randn(p.num_experts, p.n, p.k // 32,
                                                     generator=gen, device="cuda")))
            weights[(layout, proj)] = (w, s.to(torch.bfloat16), fragment_order(w))
        w, s, wf = weights[(layout, proj)]
        if (layout, tokens) not in routings:
            routings[(layout, tokens)] = torch.rand(tokens, p.num_experts, generator=gen,
                                                    device="cuda").topk(8, dim=-1).indices.to(
                                                        torch.int32)
        topk = routings[(layout, tokens)]
        rows = 8 * tokens
        n_out = p.n // 2 if act else p.n
        x = torch.randn(p.input_rows(tokens), p.k, generator=gen, device="cuda").to(torch.bfloat16)
        floor_us = floor_model(p, tokens, int(torch.unique(topk).numel()))["floor_us"]
        bm = choose_config(rows / p.num_experts, n_out, p.k, gated=act is not None,
                           w_order="fragments").block_m
        single = moe_align_block_size(topk, bm, p.num_experts)
        want = moe_gemm_indexed_reference(x, w, s, *single, p.top_k, bm, activation=act)
        fns = {}
        out = torch.empty(rows, n_out, dtype=torch.bfloat16, device="cuda")
        fns[f"single {bm}"] = (lambda out=out: moe_gemm_indexed_triton(
            x, wf, s, *single, p.top_k, bm, activation=act, out=out, w_order="fragments"), out)
        for sizes, c in variants:
            aligned = moe_align_mixed(topk, sizes, p.num_experts)
            cfg = None if c is None else W4A16Config(*c, k_order="fragments")
            out = torch.empty(rows, n_out, dtype=torch.bfloat16, device="cuda")
            name = "mixed " + "+".join(map(str, sizes)) + ("" if c is None else
                                                           " " + cfg.label)
            name += f" {list(aligned[2])}"
            fns[name] = (lambda out=out, aligned=aligned, cfg=cfg, sizes=sizes:
                         moe_gemm_mixed_triton(x, wf, s, *aligned, p.top_k, sizes[0],
                                               activation=act, config=cfg, out=out,
                                               w_order="fragments"), out)
        for name, (fn, out) in fns.items():
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{layout} {proj} T={tokens} {name} FAILED {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)
                continue
            r = {"layout": layout, "proj": proj, "T": tokens, "act": act, "variant": name,
                 "cos_diff": cos_diff(out, want), "graph_us": B._time_graph(fn, 5)}
            r["pct_of_floor"] = 100 * floor_us / r["graph_us"]
            results.append(r)
            print(f"{layout} {proj:7s} {str(act):8s} T={tokens:5d} {name:44s} "
                  f"{r['graph_us']:8.1f} µs {r['pct_of_floor']:5.1f}% cos={r['cos_diff']:.1e}",
                  flush=True)
            json.dump(results, open(f"{out_dir}/mixed.json", "w"), indent=1)


if __name__ == "__main__":
    main()
