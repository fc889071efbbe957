"""The ``chordq`` command: thin click commands, one library call each, errors as one line."""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
from typing import Any, Callable

import click

from . import __version__
from .errors import ChordqError

EXIT_INTERRUPTED = 130


def _one_line(e: BaseException) -> tuple[str, int]:
    """Map an exception to (message, exit status): the CLI's single error table."""
    if isinstance(e, ChordqError):
        return str(e), e.exit_code
    if isinstance(e, KeyboardInterrupt):
        return "interrupted; rerun the same command to resume", EXIT_INTERRUPTED
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"{e.filename or 'output'}: no space left on device; free disk space and rerun to resume", 2
    if isinstance(e, PermissionError):
        return f"{e.filename}: permission denied", 2
    if isinstance(e, FileNotFoundError):
        return f"{e.filename}: no such file or directory", 2
    if isinstance(e, OSError):
        return f"{e.filename or ''}: {e.strerror or e}".lstrip(": "), 2
    if isinstance(e, MemoryError):
        return "out of memory; use --workers 1 or a machine with more RAM", 2
    return f"internal error: {type(e).__name__}: {e} (rerun with CHORDQ_DEBUG=1 for a traceback)", 3


def _handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except BaseException as e:  # noqa: BLE001 - the one place errors become messages
            if os.environ.get("CHORDQ_DEBUG") == "1" or isinstance(e, SystemExit):
                raise
            message, code = _one_line(e)
            click.echo(f"chordq: error: {message}", err=True)
            sys.exit(code)

    return wrapper


def _examples(*lines: str) -> str:
    return "\n\n\b\nExamples:\n" + "\n".join(f"  $ {line}" for line in lines)


def _progress_bar(total: int | None, desc: str, unit: str = "B", position: int = 0):
    """tqdm on a terminal (rate and ETA), silent when stderr is not a tty."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        disable=not sys.stderr.isatty(),
        dynamic_ncols=True,
        position=position,
    )


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


def _human(n: int | float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


@click.group(
    help="Quantize Kimi K2.x routed experts to compressed-tensors INT4 group 32 for Chord / vLLM."
    + _examples(
        "chordq inspect ./Kimi-K2-Instruct-0905",
        "chordq convert ./Kimi-K2-Instruct-0905 -o ./Kimi-K2-0905-W4A16-g32",
        "chordq convert ./Kimi-K2-Thinking -o ./out      # native INT4: copied bit for bit",
    )
)
@click.version_option(__version__, prog_name="chordq")
def main() -> None:
    pass


@main.command(
    help="Convert a checkpoint's routed experts to INT4 group 32 (resumable: rerun to continue)."
    + _examples(
        "chordq convert examples/tiny-kimi-k2-fp8 -o /tmp/tiny-w4a16",
        "chordq convert ./Kimi-K2-Instruct -o ./out --dry-run",
        "chordq convert ./Kimi-K2-Instruct -o ./out --method rtn --device cuda",
        "chordq convert ./Kimi-K2-Instruct -o ./out --json > summary.json",
        "chordq convert moonshotai/Kimi-K2-Instruct-0905 -o ./out --delete-source",
    )
)
@click.argument("source")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--method", type=click.Choice(["mse", "rtn"]), default="mse", show_default=True,
              help="Scale search: mse (least squared error over clipping ratios) or rtn (absmax/7.5).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda (every GPU) or cuda:N.")
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Shards converted at once (0: one per GPU with cuda, else 1).")
@click.option("--overwrite", is_flag=True, help="Discard a previous chordq output made with other options.")
@click.option("--revision", help="Hub sources: branch, tag or commit.")
@click.option("--delete-source", is_flag=True, help="Hub sources: delete each cached shard once converted.")
@click.option("--dry-run", is_flag=True, help="Check everything and print the plan; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
@_handle_errors
def convert(source: str, output: str, dry_run: bool, as_json: bool, **opts: Any) -> None:
    from .convert import ConvertOptions, convert_checkpoint, dry_run_plan

    options = ConvertOptions(**opts)
    if dry_run:
        info = dry_run_plan(source, output, options)
        _print_json(info) if as_json else click.echo(_format_plan(info))
        return

    def start(n_shards: int, n_bytes: int) -> None:
        shards.reset(total=n_shards)
        bar.reset(total=n_bytes)

    with _progress_bar(None, "shards", "shard") as shards, _progress_bar(None, "bytes", position=1) as bar:
        result = convert_checkpoint(source, output, options, progress=bar.update,
                                    on_shard=lambda f: shards.update(1), on_plan=start)
    if as_json:
        _print_json(result.to_json())
        return
    mb_s = result.source_bytes / max(result.seconds, 1e-9) / 1e6
    sqnr = f", expert SQNR min {result.sqnr_min_db:.2f} dB mean {result.sqnr_mean_db:.2f} dB" if result.sqnr_min_db is not None else ""
    click.echo(
        f"{result.output}: {result.shards_converted} shards converted, {result.shards_skipped} already done; "
        f"{result.tensors_quantized} expert tensors quantized, {result.tensors_copied} copied; "
        f"{_human(result.output_bytes)} written in {result.seconds:.1f}s ({mb_s:.0f} MB/s){sqnr}"
    )


@main.command(
    help="Say what a checkpoint is and what convert will do (reads headers only)."
    + _examples("chordq inspect examples/tiny-kimi-k2-fp8", "chordq inspect ./out --json")
)
@click.argument("source")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_handle_errors
def inspect(source: str, as_json: bool) -> None:
    from .plan import build_plan, describe
    from .shards import open_checkpoint

    info = describe(build_plan(open_checkpoint(source)))
    _print_json(info) if as_json else click.echo(_format_plan(info))


def _format_plan(info: dict[str, Any]) -> str:
    p = info["plan"]
    lines = [
        f"path            {info['path']}",
        f"architecture    {info['architectures']} (model_type {info['model_type']}"
        + (f", text {info['text_model_type']})" if info["text_model_type"] else ")"),
        f"format          {info['source_format']}",
        f"layers          {info['num_hidden_layers']} ({info['moe_layers']} MoE), "
        f"{info['routed_experts_per_layer']} routed experts, top-{info['experts_per_token']}",
        f"expert shapes   gate/up {info['expert_shapes']['gate_proj']}, down {info['expert_shapes']['down_proj']}",
        f"tensors         {info['tensors']} in {info['shards']} shards, {_human(info['source_tensor_bytes'])}",
        f"convert will    {p['action']}",
        f"                {p['quantize']} quantize, {p['fp8_to_bf16']} FP8->BF16, {p['copy']} copy; "
        f"output {_human(p['output_tensor_bytes'])}",
    ]
    for shard in info.get("shards_plan", []):
        lines.append(
            f"  {shard['file']}  {_human(shard['source_bytes'])} -> {_human(shard['output_file_bytes'])}"
            f"  {shard['status']}"
        )
    if "output_dir" in info:
        lines.append(
            f"output dir      {info['output_dir']}: needs {_human(info['needed_bytes'])}, "
            f"{_human(info['free_bytes'])} free; devices {', '.join(info['devices'])}"
        )
    return "\n".join(lines)


@main.command(
    help="Publish a converted checkpoint to the Hub with a generated model card (rerun to resume)."
    + _examples(
        "chordq push ./Kimi-K2-0905-W4A16-g32 me/Kimi-K2-0905-W4A16-g32 --dry-run",
        "chordq push ./Kimi-K2-0905-W4A16-g32 me/Kimi-K2-0905-W4A16-g32 --private",
        "chordq push ./out me/model --create-pr --base-model moonshotai/Kimi-K2-Instruct-0905",
    )
)
@click.argument("output", type=click.Path(file_okay=False))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--revision", help="Branch to push to (created if missing), or refs/pr/N to add to an open PR.")
@click.option("--create-pr", is_flag=True, help="Open a pull request against the default branch instead.")
@click.option("--commit-message", help="Commit title.")
@click.option("--base-model", help="Hub id of the source for the card, when it was converted from a local path.")
@click.option("--skip-verify", is_flag=True, help="Push without a passing chordq_verify.json (card: not verified).")
@click.option("--dry-run", is_flag=True, help="Write the card and list what would be uploaded; no network.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
@_handle_errors
def push(output: str, repo_id: str, as_json: bool, **options: Any) -> None:
    from .hub import push_checkpoint

    result = push_checkpoint(output, repo_id, **options)
    if as_json:
        return _print_json(result)
    if options["dry_run"]:
        click.echo("\n".join(f"{_human(f['size']):>10}  {f['path']}" for f in result["files"]))
    where = result["pr_url"] or result["commit_url"] or "dry run, nothing uploaded"
    click.echo(f"{repo_id}: {len(result['files'])} files, {_human(result['bytes'])}; {where}")


@main.command(
    help="Check a converted checkpoint: structure, fidelity to its source, MoE compute, codes "
    "(exit 1 when a check fails; report in OUTPUT/chordq_verify.json and .png)."
    + _examples(
        "chordq verify ./Kimi-K2-0905-W4A16-g32 --source moonshotai/Kimi-K2-Instruct-0905",
        "chordq verify ./K2-Thinking-chord        # no source: structure, codes, kernel",
        "chordq verify ./out --source ./Kimi-K2-Instruct --layers 1-3 --experts-per-layer 4 --device cuda",
    )
)
@click.argument("output")
@click.option("--source", help="The checkpoint OUTPUT was converted from (local dir or Hub id).")
@click.option("--revision", help="Hub sources: branch, tag or commit.")
@click.option("--layers", help="MoE layers to read and compute, e.g. 1,5,10-20 (default: all).")
@click.option("--experts-per-layer", type=click.IntRange(min=0),
              help="Experts per layer run through the MoE check (default: all up to 64, else 8; 0: none).")
@click.option("--device", default="cpu", show_default=True, help="Device for the math and the Triton kernel (cpu: interpreted).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="JSON report path (default OUTPUT/chordq_verify.json).")
@_handle_errors
def verify(output: str, source: str | None, revision: str | None, layers: str | None,
           experts_per_layer: int | None, device: str, json_path: str | None) -> None:
    from .report import format_summary
    from .verify import verify_checkpoint

    src: Any = source
    if source is not None and not os.path.exists(source):
        from .hub import HubCheckpoint, is_hub_id

        src = HubCheckpoint(source, revision=revision) if is_hub_id(source) else source
    with _progress_bar(0, "verify") as bar:
        report = verify_checkpoint(output, source=src, layers=layers, experts_per_layer=experts_per_layer,
                                   device=device, json_path=json_path,
                                   progress=lambda done, total: (setattr(bar, "total", total), bar.update(done - bar.n)))
    click.echo(format_summary(report))
    report.raise_if_failed()


@main.command(
    help="Time the bundled Triton W4A16 MoE kernels at Kimi K2 EP8 shapes on this GPU."
    + _examples("chordq bench", "chordq bench --tokens 1 20 2048 --quick", "chordq bench --out ./bench --json")
)
@click.option("--tokens", type=int, multiple=True, help="Tokens per GPU (repeatable; default 1..2048).")
@click.option("--quick", is_flag=True, help="Fewer timing repetitions.")
@click.option("--out", type=click.Path(file_okay=False), help="Write bench_kernels.{md,json} here.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@_handle_errors
def bench(tokens: tuple[int, ...], quick: bool, out: str | None, as_json: bool) -> None:
    import torch

    from .errors import InputError

    if not torch.cuda.is_available():
        raise InputError("chordq bench needs a CUDA GPU; none is visible")
    from .kernels.bench import DEFAULT_TOKENS, run_benchmark

    rows = run_benchmark(tuple(tokens) or DEFAULT_TOKENS, out_dir=out, quick=quick)
    if as_json:
        _print_json(rows)


if __name__ == "__main__":  # pragma: no cover
    main()
