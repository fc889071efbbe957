"""Time the indexed W4A16 GEMM with one row-tile size against mixed row tiles
(``align.moe_align_mixed`` + ``moe_gemm_mixed_triton``: blocks of 128, 64, 32 ... rows, one
launch per size) on the GPU: CUDA graphs, replays interleaved, cos_diff against the reference
on the single alignment. Every launch takes the heuristic's config for its block size, on
subnormal weights (the shipped ones).

The numbers behind ``triton_config.choose_row_tiles`` (docs/kernel_notes.md, variants 15, 24).

Usage (repo root, GPU machine): ``OUT=/tmp/lab [MIXED_T="512 1024"] python
scripts/kernel_lab/mixed_tiles.py`` (MIXED_T: only the rows of these token counts)
"""

import json
import os

import torch

from chordq.kernels import bench as B
from chordq.kernels.align import moe_align_block_size, moe_align_mixed
from chordq.kernels.bench_humming import (LAYOUTS, convert_weights, floor_model, make_weights,
                                          time_graphs)
from chordq.kernels.reference import cos_diff, moe_gemm_indexed_reference
from chordq.kernels.triton_config import choose_config
from chordq.kernels.triton_w4a16 import indexed_config, moe_gemm_mixed_triton

# (layout, projection, tokens per GPU, activation)
ROWS = [("EP8", "gate_up", 256, None), ("EP8", "down", 256, None),
        ("EP8", "gate_up", 512, None), ("EP8", "down", 512, None),
        ("EP8", "gate_up", 1024, None), ("EP8", "down", 1024, None),
        ("EP8", "gate_up", 1024, "silu_mul"), ("EP8", "gate_up", 2048, None),
        ("TP8", "gate_up", 2048, None), ("TP8", "gate_up", 8192, None),
        ("EP8", "gate_up", 128, None)]
SETS = [(128, 64), (128, 64, 32), (64, 32), (64, 32, 16), (32, 16)]


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/lab")
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, routings, results = {}, {}, []
    only = os.environ.get("MIXED_T")
    for layout, proj, tokens, act in ROWS:
        if only and str(tokens) not in only.split():
            continue
        p = next(q for q in LAYOUTS[layout] if q.proj == proj)
        if (layout, proj) not in weights:
            w, s = make_weights(p, 0, "cuda")
            weights[(layout, proj)] = (w, s, *convert_weights(w, s, "subnormal"))
        w, s, wf, sf = weights[(layout, proj)]
        if (layout, tokens) not in routings:
            scores = torch.rand(tokens, p.num_experts, generator=gen, device="cuda")
            routings[(layout, tokens)] = scores.topk(8, dim=-1).indices.to(torch.int32)
        topk = routings[(layout, tokens)]
        rows = 8 * tokens
        n_out = p.n // 2 if act else p.n
        x = torch.randn(p.input_rows(tokens), p.k, generator=gen, device="cuda").to(torch.bfloat16)
        floor_us = floor_model(p, tokens, int(torch.unique(topk).numel()))["floor_us"]
        bm = choose_config(rows / p.num_experts, n_out, p.k, gated=act is not None,
                           w_order="subnormal").block_m
        single = moe_align_block_size(topk, bm, p.num_experts)
        want = moe_gemm_indexed_reference(x, w, s, *single, p.top_k, bm, activation=act)
        variants = {f"single {bm}": [(bm, single)]}
        for sizes in SETS:
            variants["mixed " + "+".join(map(str, sizes))] = moe_align_mixed(
                topk, sizes, p.num_experts)
        fns, outs, info = {}, {}, {}
        for name, pieces in variants.items():
            out = torch.empty(rows, n_out, dtype=torch.bfloat16, device="cuda")
            fns[name] = (lambda pieces=pieces, out=out: moe_gemm_mixed_triton(
                x, wf, sf, pieces, p.top_k, activation=act, out=out, w_order="subnormal"))
            fns[name]()
            torch.cuda.synchronize()
            outs[name] = out
            info[name] = ([int(a[1].numel()) for _, a in pieces],
                          [indexed_config(rows, p.num_experts, n_out, p.k, size, activation=act,
                                          w_order="subnormal", live_blocks=a[1].numel()).label
                           for size, a in pieces])
        for name, t in time_graphs(fns, 5, B.GRAPH_CALLS).items():
            blocks, labels = info[name]
            r = {"layout": layout, "proj": proj, "T": tokens, "act": act, "variant": name,
                 "blocks": blocks, "configs": labels, "cos_diff": cos_diff(outs[name], want),
                 "graph_us": t.get("graph_us")}
            if not r["graph_us"]:
                print(f"{layout} {proj} T={tokens} {name}: {t}", flush=True)
                continue
            r["pct_of_floor"] = 100 * floor_us / r["graph_us"]
            results.append(r)
            print(f"{layout} {proj:7s} {str(act):8s} T={tokens:5d} {name:16s} "
                  f"{r['graph_us']:8.1f} µs {r['pct_of_floor']:5.1f}% cos={r['cos_diff']:.1e} "
                  f"blocks={blocks} {' + '.join(labels)}", flush=True)
        json.dump(results, open(f"{out_dir}/mixed.json", "w"), indent=1)


if __name__ == "__main__":
    main()
