"""Time chordq's Triton W4A16 MoE GEMMs at Kimi K2 EP8 shapes (a thin wrapper over
``chordq.kernels.bench.run_benchmark``; see that module for what is measured).

    python scripts/bench_kernels.py --out bench_out            # full run, H200
    python scripts/bench_kernels.py --quick --tokens 1 20 2048
    python scripts/bench_kernels.py --sweep --out bench_sweep  # also try alternative tiles

Exits 0 with a message when there is no CUDA device; exits 1 if a shape fails its cos_diff check.
"""

from __future__ import annotations

import argparse
import sys

import torch

from chordq.kernels.bench import DEFAULT_TOKENS, run_benchmark


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Time chordq's Triton W4A16 MoE GEMMs at Kimi K2 EP8 shapes.")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                        help="tokens per GPU (default: %(default)s)")
    parser.add_argument("--out", default=None, help="directory for bench_kernels.{md,json}")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device found; nothing to benchmark.", file=sys.stderr)
        return 0
    rows = run_benchmark(tuple(args.tokens), out_dir=args.out, quick=args.quick, sweep=args.sweep)
    failed = [f"T={r['tokens']} {r['projection']}" for r in rows if not r["ok"]]
    if failed:
        print(f"bench_kernels: cos_diff above the limit for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
