"""Time chordq's Triton W4A16 MoE GEMMs at Kimi K2 EP8 shapes (a thin wrapper over
``chordq.kernels.bench.run_benchmark``; see that module for what is measured).

    python scripts/bench_kernels.py --out bench_out            # full run, H200
    python scripts/bench_kernels.py --quick --tokens 1 20 2048
    python scripts/bench_kernels.py --sweep --out bench_sweep  # also try alternative tiles

Side by side with humming-kernels in the same process, on the same inputs
(``chordq.kernels.bench_humming.run_comparison``; writes bench_humming.{md,json} to --out)::

    python scripts/bench_kernels.py --against humming \\
        --humming-wheel .whl/humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl \\
        --out bench_vs_humming [--layouts EP8 TP8] [--tokens 1 20 2048] [--max-minutes 7]

Exits 0 with a message when there is no CUDA device; exits 1 if a shape fails its cos_diff check;
with ``--against humming``, exits 2 when the Humming side did not run for some row (the chordq
numbers are still written).
"""

from __future__ import annotations

import argparse
import sys

import torch

from chordq.kernels.bench import DEFAULT_TOKENS, run_benchmark


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Time chordq's Triton W4A16 MoE GEMMs at Kimi K2 EP8 shapes.")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"tokens per GPU (default: {list(DEFAULT_TOKENS)}; with --against "
                             "humming: 1 8 20 32 128 256 512 1024 2048 8192)")
    parser.add_argument("--out", default=None,
                        help="directory for bench_kernels.{md,json} (bench_humming.{md,json} "
                             "with --against humming)")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    cmp = parser.add_argument_group("side-by-side comparison (--against)")
    cmp.add_argument("--against", choices=["humming"], default=None,
                     help="also run this library's kernels on the same inputs, same process")
    cmp.add_argument("--humming-wheel", default=None, metavar="PATH",
                     help="humming-kernels wheel (installed into a temp --target dir), a folder "
                          "holding it, or a folder holding humming/; default: an installed humming")
    cmp.add_argument("--humming-target", default=None, metavar="DIR",
                     help="install the wheel here instead of a fresh temp dir")
    cmp.add_argument("--layouts", nargs="+", choices=["EP8", "TP8"], default=["EP8"],
                     help="EP8: 48 experts, N/K 4096/7168 and 7168/2048; TP8: 384 experts, "
                          "512/7168 and 7168/256 (default: %(default)s)")
    cmp.add_argument("--reps", type=int, default=6,
                     help="interleaved A/B graph repetitions, median; an even count runs each "
                          "contestant first equally often (default: %(default)s)")
    cmp.add_argument("--calls", type=int, default=20,
                     help="calls per CUDA graph (default: %(default)s)")
    cmp.add_argument("--do-bench-rep", type=int, default=200,
                     help="do_bench rep in ms (kernels.md uses 1000; default: %(default)s)")
    cmp.add_argument("--do-bench-warmup", type=int, default=25,
                     help="do_bench warmup in ms (kernels.md uses 100; default: %(default)s)")
    cmp.add_argument("--no-do-bench", action="store_true", help="CUDA-graph timing only")
    cmp.add_argument("--no-fused", action="store_true",
                     help="skip timing chordq's fused SiLU-and-mul gate_up")
    cmp.add_argument("--check-routes", type=int, default=2048,
                     help="routes compared with the FP32 reference per shape (default: "
                          "%(default)s; all routes when 8T is smaller)")
    cmp.add_argument("--max-minutes", type=float, default=None,
                     help="start no new shape after this many minutes")
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--w-order", choices=("blocked", "subnormal", "fragments", "checkpoint"),
                     default="blocked",
                     help="chordq's weights, converted once like Humming's transform: "
                          "fragment-order words and subnormal scales in row blocks (the "
                          "fastest, moe.prepare_weights' choice for Kimi), the same not in row "
                          "blocks, fragment words alone, or as checkpointed (default: "
                          "%(default)s)")
    cmp.add_argument("--stream-k-rows", type=int, nargs="*", default=None, metavar="BM",
                     help="the Gluon prefill blocks (64, 96, 128) whose 256-row tile the "
                          "heuristic runs with stream-K (default: "
                          "triton_config.GLUON_PREFILL_STREAM_K_ROWS; none: give the flag alone)")
    cmp.add_argument("--wide-stream-k-rows", type=int, nargs="*", default=None, metavar="BM",
                     help="the same for the wide form (64, 32; default: "
                          "triton_config.GLUON_PREFILL_WIDE_STREAM_K_ROWS)")
    cmp.add_argument("--alt", nargs="+", default=None, metavar="NAME=BM,..",
                     help="also time chordq with these triton_config constants set (e.g. "
                          "GLUON_PREFILL_STREAM_K_ROWS=64,96 GLUON_PREFILL_WIDE_STREAM_K_ROWS= "
                          "GLUON_STREAM_K_WAVES=0.9,1.25,2.3,2.6), "
                          "in the same interleaved graphs: the table adds alt / chordq per row")
    return parser


def parse_alt(items: list[str] | None) -> dict[str, tuple[float, ...]] | None:
    """``--alt NAME=1,2.5 ..`` -> ``{"NAME": (1, 2.5)}``, each NAME a tuple constant of
    ``triton_config``."""
    from chordq.kernels import triton_config

    if not items:
        return None
    out = {}
    for item in items:
        name, _, values = item.partition("=")
        if not isinstance(getattr(triton_config, name, None), tuple):
            raise SystemExit(f"bench_kernels: --alt {item}: {name!r} is not a tuple constant of "
                             f"chordq.kernels.triton_config")
        try:
            out[name] = tuple(float(v) if "." in v else int(v) for v in values.split(",") if v)
        except ValueError:
            raise SystemExit(f"bench_kernels: --alt {item}: give numbers, e.g. {name}=64,96"
                             ) from None
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.humming_wheel and args.against != "humming":
        print("bench_kernels: --humming-wheel needs --against humming", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device found; nothing to benchmark.", file=sys.stderr)
        return 0
    from chordq.kernels import triton_config

    if args.stream_k_rows is not None:  # the heuristic reads these at each call
        triton_config.GLUON_PREFILL_STREAM_K_ROWS = tuple(args.stream_k_rows)
    if args.wide_stream_k_rows is not None:
        triton_config.GLUON_PREFILL_WIDE_STREAM_K_ROWS = tuple(args.wide_stream_k_rows)
    if args.against == "humming":
        from chordq.kernels.bench_humming import (
            DEFAULT_TOKENS as HUMMING_TOKENS,
            Options,
            exit_status,
            run_comparison,
        )

        opts = Options(reps=min(args.reps, 2) if args.quick else args.reps, calls=args.calls,
                       do_bench=not args.no_do_bench,
                       do_bench_warmup=10 if args.quick else args.do_bench_warmup,
                       do_bench_rep=50 if args.quick else args.do_bench_rep,
                       fused=not args.no_fused, check_routes=args.check_routes, seed=args.seed,
                       w_order=args.w_order, alt=parse_alt(args.alt))
        result = run_comparison(tuple(args.tokens or HUMMING_TOKENS), tuple(args.layouts),
                                humming_wheel=args.humming_wheel, out_dir=args.out, opts=opts,
                                max_minutes=args.max_minutes, humming_target=args.humming_target)
        status = exit_status(result)
        if status:
            why = ("a cos_diff check failed" if status == 1
                   else "the Humming side did not run for some rows")
            print(f"bench_kernels: exit {status} ({why}); see the table", file=sys.stderr)
        return status
    rows = run_benchmark(tuple(args.tokens or DEFAULT_TOKENS), out_dir=args.out, quick=args.quick,
                         sweep=args.sweep)
    failed = [f"T={r['tokens']} {r['projection']}" for r in rows if not r["ok"]]
    if failed:
        print(f"bench_kernels: cos_diff above the limit for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
