"""Variant 62 (lab): where a stream-K prefill launch spends its time, piece by piece (GPU).

Why: variants 57 and 61 found stream-K's shared phase about one round (15-20 µs) slower than
its work at a whole tile's rate, and the handover protocol was not the cause. Graph times cannot
say which part is: the pieces' K loops, their stores, the gaps between pieces, or a few late
programs. This launches the 64-row tile once more with ``gluon_prefill`` patched to record, for
every piece of every program, the consumer's start, the end of its K loop and the end of its
stores (both consumers), and the loader's start, first slot issued and end, in globaltimer ns
(aligned across SMs) and SM clocks (``patches/timeline.patch``).

Cases: EP8 down with n experts of one full 64-row block each (``prefill_rounds.py``'s grids:
6.36, 7.00 and 10.18 rounds of 132 SMs), plain and stream-K, and EP8 down T=256 with the bench's
routing (seed 0, as the bench draws it). Each case: the graph time with the recorder off (the shipped code path, same
process), then one recorded launch after two warm ones. Writes every record to
``$OUT/prefill_timeline.json`` for offline study and prints a summary per case.

usage (GPU machine, repo root, kernel patched): ``git apply
scripts/kernel_lab/patches/timeline.patch && OUT=/tmp/lab python3
scripts/kernel_lab/prefill_timeline.py``
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics

import torch
from chordq.kernels import gluon_prefill
from chordq.kernels.align import moe_align_block_size
from chordq.kernels.bench_humming import (
    LAYOUTS,
    convert_weights,
    draw_routing,
    make_weights,
    routing_seed,
    time_graphs,
)
from chordq.kernels.triton_config import GLUON_PREFILL_TILE_64
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton

ROWS = 64
FIELDS = ("tile", "first", "num", "g", "ns0", "ns1", "ns2", "clk0", "clk1", "clk2")
CONFIGS = {"plain": GLUON_PREFILL_TILE_64,
           "sk": dataclasses.replace(GLUON_PREFILL_TILE_64, stream_k=1)}


def records(buf: torch.Tensor, programs: int) -> list[list[list[dict]]]:
    """``[program][who]`` -> that partition's pieces in order (who: consumer 0, 1, loader)."""
    raw = buf.view(-1, 3, 128, 16)[:programs].cpu().tolist()
    return [[[dict(zip(FIELDS, r[:10])) for r in who if r[0] >= 0] for who in prog]
            for prog in raw]


def summary(recs, num_steps: int) -> dict:
    """Per consumer-0 piece kinds: K-loop µs per step and store µs; gaps; phase ends."""
    t_min = min(p["ns0"] for prog in recs for who in prog for p in who)
    whole_loop, whole_store, cut_loop, cut_store, gaps, ends, sk_start = [], [], [], [], [], [], []
    for prog in recs:
        pieces = prog[0]
        if not pieces:
            continue
        for a, b in itertools.pairwise(pieces):
            gaps.append((b["ns0"] - a["ns2"]) / 1e3)
        for p in pieces:
            loop, store = (p["ns1"] - p["ns0"]) / 1e3, (p["ns2"] - p["ns1"]) / 1e3
            if p["num"] == num_steps:
                whole_loop.append(loop / p["num"])
                whole_store.append(store)
            else:
                cut_loop.append(loop / p["num"])
                cut_store.append(store)
        cuts = [p for p in pieces if p["num"] < num_steps]
        if cuts:
            sk_start.append((cuts[0]["ns0"] - t_min) / 1e3)
        ends.append((pieces[-1]["ns2"] - t_min) / 1e3)

    def stats(xs):
        return ([round(min(xs), 3), round(statistics.median(xs), 3), round(max(xs), 3)]
                if xs else None)

    return {"span_us": round(max(ends), 2), "end_us min/med/max": stats(ends),
            "whole loop us/step": stats(whole_loop), "whole store us": stats(whole_store),
            "cut loop us/step": stats(cut_loop), "cut store us": stats(cut_store),
            "gap us": stats(gaps), "shared phase start us": stats(sk_start),
            "pieces": sum(len(prog[0]) for prog in recs)}


def main() -> None:
    if not hasattr(gluon_prefill, "TIMES_BUF"):
        raise SystemExit("gluon_prefill has no recorder: git apply "
                         "scripts/kernel_lab/patches/timeline.patch first")
    out_dir = os.environ.get("OUT", "/tmp/lab")
    os.makedirs(out_dir, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = next(q for q in LAYOUTS["EP8"] if q.proj == "down")
    words, scales = convert_weights(*make_weights(p, 0, "cuda"), "blocked")
    cases = {}
    for n in (30, 33, 48):
        experts = torch.randperm(p.num_experts, generator=gen, device="cuda")[:n]
        topk = experts.to(torch.int32).repeat_interleave(ROWS)[:, None]
        cases[f"full{n}"] = (topk, 1)
    cases["T256"] = (draw_routing(256, p.num_experts, seed=routing_seed(0, "EP8", 256)).to(
        "cuda"), 8)
    out = {"device": torch.cuda.get_device_name(0), "sms": sms, "cases": {}}
    for case, (topk, top_k) in cases.items():
        num_routes = topk.numel()
        x = torch.randn(num_routes // top_k, p.k, generator=gen, device="cuda").to(torch.bfloat16)
        aligned = moe_align_block_size(topk, ROWS, p.num_experts)
        res = torch.empty(num_routes, p.n, dtype=torch.bfloat16, device="cuda")
        fns = {name: (lambda cfg=cfg, x=x, aligned=aligned, top_k=top_k, res=res:
                      moe_gemm_indexed_triton(x, words, scales, *aligned, top_k, ROWS, config=cfg,
                                              out=res, w_order="blocked"))
               for name, cfg in CONFIGS.items()}
        gluon_prefill.TIMES_BUF = None
        graph = time_graphs(fns, 4, 20)
        for name, fn in fns.items():
            buf = torch.full((sms * 3 * 128 * 16,), -1, dtype=torch.int64, device="cuda")
            gluon_prefill.TIMES_BUF = buf
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            gluon_prefill.TIMES_BUF = None
            recs = records(buf, sms)
            summ = summary(recs, p.k // GLUON_PREFILL_TILE_64.block_k)
            summ["graph_us"] = round(graph[name].get("graph_us", float("nan")), 2)
            tiles = int(aligned[2].item()) // ROWS * (p.n // GLUON_PREFILL_TILE_64.block_n)
            summ["tiles"], summ["rounds"] = tiles, round(tiles / sms, 3)
            out["cases"][f"{case} {name}"] = {"summary": summ, "records": recs}
            print(f"{case:7s} {name:5s} {json.dumps(summ)}", flush=True)
    with open(os.path.join(out_dir, "prefill_timeline.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
