"""Benchmark the Triton W4A16 MoE GEMMs at Kimi K2 EP8 shapes on one GPU (kernels.md §3, §5).

Per token count T (tokens per GPU, top-8 of 48 local experts, uniform random routing):

* ``gate_up``: ``[T, 7168] -> [8T, 2048]``, w13 (N = 2I = 4096, K = 7168) with SiLU-and-mul fused
* ``down``:    ``[8T, 2048] -> [8T, 7168]`` (N = 7168, K = 2048), ``top_k = 1``

Each shape is first checked against ``reference.moe_gemm_indexed_reference`` (cos_diff), then
timed by CUDA-graph replay of ``GRAPH_CALLS`` back-to-back calls (primary; median over
repetitions) and by ``triton.testing.do_bench`` (secondary, L2 flushed, mean). The floor is
``max(bytes / 4.28 TB/s, FLOPs / 792 TFLOP/s)`` with kernels.md §3's bytes model: touched experts
x (int4 weight + BF16 scales) + BF16 activations in and out (gate_up counted with its unfused
``8T x 4096`` output, as in the doc's table, so the floors match it).

``sweep=True`` also times a short list of alternative tile configs per shape and reports the
fastest, to tune ``triton_config.choose_config``.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["run_benchmark", "DEFAULT_TOKENS"]

DEFAULT_TOKENS = (1, 8, 20, 32, 128, 512, 2048)
NUM_EXPERTS, HIDDEN, INTER, TOP_K = 48, 7168, 2048, 8
HBM_BYTES_PER_S = 4.28e12  # measured H200 copy bandwidth (kernels.md §3)
BF16_FLOPS = 792e12  # measured cuBLAS BF16 peak at 8192^3
MAX_COS_DIFF = 1e-3
DEVICE = "cuda"
GRAPH_CALLS = 20

# Alternative tiles for sweep=True: (block_n, block_k, num_warps, num_stages, k_order) per
# regime; block_n is per half for gate_up (silu_mul reads two weight row sets).
_P, _N = "planes", "natural"
_SWEEP_DECODE = [(64, 128, 4, 4, _P), (128, 128, 4, 4, _P), (128, 128, 4, 4, _N),
                 (64, 256, 4, 4, _P), (128, 256, 8, 3, _P), (256, 128, 8, 3, _P),
                 (128, 64, 4, 6, _P), (64, 128, 4, 6, _P), (64, 256, 4, 3, _P),
                 (128, 256, 4, 3, _P), (32, 256, 4, 4, _P), (64, 512, 8, 3, _P)]
_SWEEP_PREFILL = [(64, 64, 4, 4, _N), (128, 64, 4, 4, _N), (128, 64, 8, 3, _N),
                  (64, 64, 8, 3, _N), (256, 64, 8, 3, _N), (128, 32, 8, 4, _N),
                  (128, 64, 8, 3, _P)]


def _projections() -> dict[str, dict]:
    """Static facts per projection: weight shape, activation bytes per routed row, FLOPs."""
    return {
        "gate_up": {"n": 2 * INTER, "k": HIDDEN, "activation": "silu_mul"},
        "down": {"n": HIDDEN, "k": INTER, "activation": None},
    }


def _bytes_and_flops(proj: str, tokens: int, touched: int) -> tuple[float, float]:
    p = _projections()[proj]
    n, k = p["n"], p["k"]
    weight = touched * (n * k // 2 + n * (k // 32) * 2)
    rows = TOP_K * tokens
    if proj == "gate_up":
        act = tokens * HIDDEN * 2 + rows * 2 * INTER * 2
    else:
        act = rows * INTER * 2 + rows * HIDDEN * 2
    return float(weight + act), 2.0 * rows * n * k


def _time_graph(fn: Callable[[], object], reps: int) -> float:
    """Median µs per call over ``reps`` replays of a graph of GRAPH_CALLS calls."""
    from .bench_humming import capture_graph

    graph = capture_graph(fn, GRAPH_CALLS)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(times)


def _gpu_state() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi unavailable"


def _make_weights(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random packed words (every int32 is 8 valid codes, uniform over all 16 levels) + scales."""
    out = {}
    for proj, p in _projections().items():
        n, k = p["n"], p["k"]
        words = torch.randint(-2**31, 2**31, (NUM_EXPERTS, n, k // 8), generator=gen,
                              dtype=torch.int64, device=DEVICE).to(torch.int32)
        scale = (0.01 * torch.exp2(0.5 * torch.randn(NUM_EXPERTS, n, k // 32, generator=gen,
                                                      device=DEVICE))).to(torch.bfloat16)
        out[proj] = (words, scale)
    return out


def _routing(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform top-8 of 48 distinct experts per token: int32 [T, 8]."""
    scores = torch.rand(tokens, NUM_EXPERTS, generator=gen, device=DEVICE)
    return scores.topk(TOP_K, dim=-1).indices.to(torch.int32)


def _candidates(proj: str, rows_per_expert: float, sweep: bool) -> list:
    from .triton_config import W4A16Config, choose_config

    p = _projections()[proj]
    gated = p["activation"] is not None
    n_out = p["n"] // 2 if gated else p["n"]
    base = choose_config(rows_per_expert, n_out, p["k"], gated=gated)
    if not sweep:
        return [base]
    table = _SWEEP_DECODE if base.block_m <= 32 else _SWEEP_PREFILL
    block_ms = [base.block_m] if base.block_m <= 32 else sorted({64, 128, base.block_m})
    cands = [base]
    for bm in block_ms:
        for bn, bk, warps, stages, k_order in table:
            cfg = W4A16Config(bm, bn, bk, warps, stages, k_order)
            if cfg not in cands and p["k"] % bk == 0:
                cands.append(cfg)
    return cands


def _bench_shape(proj: str, topk_ids: torch.Tensor, weights, gen: torch.Generator, quick: bool,
                 sweep: bool) -> dict:
    """Check, then time one projection for one routing draw ``topk_ids`` int32 [T, 8]."""
    import triton.testing

    from .align import moe_align_block_size
    from .reference import cos_diff, moe_gemm_indexed_reference
    from .triton_w4a16 import moe_gemm_indexed_triton

    p = _projections()[proj]
    w, s = weights[proj]
    tokens = topk_ids.shape[0]
    touched = int(torch.unique(topk_ids).numel())
    rows = tokens * TOP_K
    rows_per_expert = rows / NUM_EXPERTS
    x = torch.randn(tokens if proj == "gate_up" else rows, p["k"], generator=gen,
                    device=DEVICE).to(torch.bfloat16)
    top_k = TOP_K if proj == "gate_up" else 1
    bytes_, flops = _bytes_and_flops(proj, tokens, touched)
    floor_us = max(bytes_ / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e6

    results, want = [], None
    for cfg in _candidates(proj, rows_per_expert, sweep):
        aligned = moe_align_block_size(topk_ids, cfg.block_m, NUM_EXPERTS)
        args = (x, w, s, *aligned, top_k, cfg.block_m)
        out = torch.empty(rows, p["n"] // 2 if p["activation"] else p["n"], dtype=torch.bfloat16,
                          device=DEVICE)
        t0 = time.perf_counter()
        got = moe_gemm_indexed_triton(*args, activation=p["activation"], config=cfg, out=out)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        if want is None:  # routed rows do not depend on the tile config: one reference
            want = moe_gemm_indexed_reference(*args, activation=p["activation"])
        cos = cos_diff(got, want)

        def fn(cfg=cfg, args=args, out=out):
            return moe_gemm_indexed_triton(*args, activation=p["activation"], config=cfg, out=out)

        graph_us = _time_graph(fn, reps=3 if quick else 7)
        if quick or sweep:
            bench_us = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="mean") * 1e3
        else:
            bench_us = triton.testing.do_bench(fn, warmup=100, rep=1000, return_mode="mean") * 1e3
        results.append({
            "config": cfg, "cos_diff": cos, "ok": cos <= MAX_COS_DIFF, "graph_us": graph_us,
            "do_bench_us": bench_us, "first_call_s": first_call_s,
        })
    best = min(results, key=lambda r: (not r["ok"], r["graph_us"]))
    heuristic = results[0]
    cfg = best["config"]
    return {
        "tokens": tokens, "projection": proj, "rows_per_expert": round(rows_per_expert, 2),
        "experts_touched": touched,
        "config": {"block_m": cfg.block_m, "block_n": cfg.block_n, "block_k": cfg.block_k,
                   "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                   "k_order": cfg.k_order, "split_k": cfg.split_k, "label": cfg.label},
        "is_heuristic_config": best is heuristic,
        "heuristic_graph_us": heuristic["graph_us"],
        "cos_diff": best["cos_diff"], "ok": all(r["ok"] for r in results),
        "graph_us": best["graph_us"], "do_bench_us": best["do_bench_us"],
        "first_call_s": best["first_call_s"],
        "bytes": bytes_, "flops": flops,
        "tb_per_s": bytes_ / best["graph_us"] / 1e6, "tflop_per_s": flops / best["graph_us"] / 1e6,
        "floor_us": floor_us, "pct_of_floor": 100.0 * floor_us / best["graph_us"],
        "bound": "memory" if bytes_ / HBM_BYTES_PER_S >= flops / BF16_FLOPS else "compute",
        "sweep": [{"config": str(r["config"]), "graph_us": r["graph_us"], "ok": r["ok"]}
                  for r in results] if sweep else None,
    }


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# chordq Triton W4A16 MoE: Kimi K2 EP8 ({NUM_EXPERTS} experts, H={HIDDEN}, "
        f"I={INTER}, top-{TOP_K})",
        "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']}"
        f"{' · quick' if meta['quick'] else ''}{' · sweep' if meta['sweep'] else ''}",
        "",
        "gate_up = w13 GEMM with SiLU-and-mul fused (writes 8T x 2048). Graph = CUDA-graph replay "
        f"of {GRAPH_CALLS} calls, median; do_bench = triton.testing.do_bench mean (L2 flushed). "
        "Floor = max(bytes / 4.28 TB/s, FLOPs / 792 TFLOP/s), kernels.md §3. "
        "P = plane-major K order.",
        "",
        "| T | proj | rows/E | experts | BM,BN,BK,warps,stages(,P) | cos_diff | graph µs "
        "| do_bench µs "
        "| TB/s | TFLOP/s | floor µs | % floor | first call s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["config"]
        cfg = c["label"]
        if not r["is_heuristic_config"]:
            cfg += f" (heuristic {r['heuristic_graph_us']:.1f} µs)"
        lines.append(
            f"| {r['tokens']} | {r['projection']} | {r['rows_per_expert']} "
            f"| {r['experts_touched']} "
            f"| {cfg} | {r['cos_diff']:.1e}{'' if r['ok'] else ' FAIL'} | {r['graph_us']:.1f} "
            f"| {r['do_bench_us']:.1f} | {r['tb_per_s']:.2f} | {r['tflop_per_s']:.0f} "
            f"| {r['floor_us']:.1f} ({r['bound'][:3]}) | {r['pct_of_floor']:.0f}% "
            f"| {r['first_call_s']:.1f} |")
    sums = {}
    for r in rows:
        sums.setdefault(r["tokens"], 0.0)
        sums[r["tokens"]] += r["graph_us"]
    lines += ["", "gate_up + down (graph µs): "
              + ", ".join(f"T={t}: {v:.1f}" for t, v in sums.items()), ""]
    lines += [f"GPU state before: {meta['gpu_state_before']}", "",
              f"GPU state after: {meta['gpu_state_after']}", ""]
    return "\n".join(lines)


def run_benchmark(
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    out_dir: str | Path | None = None,
    quick: bool = False,
    sweep: bool = False,
) -> list[dict]:
    """Check and time gate_up and down at each token count; print and optionally save a table.

    :param tokens: tokens per GPU (routed rows = 8 T)
    :param out_dir: if given, write ``bench_kernels.md`` and ``bench_kernels.json`` there
    :param quick: fewer timing repetitions (a smoke run)
    :param sweep: also time alternative tile configs and report the fastest per shape
    :returns: one dict per (T, projection): config, cos_diff, graph_us, do_bench_us, tb_per_s,
        tflop_per_s, floor_us, pct_of_floor, ...
    :raises RuntimeError: without a CUDA device
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU (none found)")
    import triton

    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "quick": quick, "sweep": sweep,
        "gpu_state_before": _gpu_state(),
    }
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weights = _make_weights(gen)
    rows = []
    for t in tokens:
        topk_ids = _routing(t, gen)  # one draw per T, shared by both projections
        for proj in _projections():
            row = _bench_shape(proj, topk_ids, weights, gen, quick, sweep)
            rows.append(row)
            print(f"T={t:5d} {proj:8s} "
                  f"cos_diff={row['cos_diff']:.1e}{'' if row['ok'] else ' FAIL'} "
                  f"graph={row['graph_us']:8.1f} µs do_bench={row['do_bench_us']:8.1f} µs "
                  f"{row['tb_per_s']:.2f} TB/s {row['tflop_per_s']:.0f} TFLOP/s "
                  f"{row['pct_of_floor']:.0f}% of floor", flush=True)
    meta["gpu_state_after"] = _gpu_state()
    table = _markdown(rows, meta)
    print(table)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_kernels.md").write_text(table)
        (out / "bench_kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return rows
