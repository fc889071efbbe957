"""Orchestration: open -> plan and validate everything -> convert shard by shard -> index, config.

Resumable: each finished shard is recorded in ``chordq_manifest.json`` (source shard size and
header hash, chordq version, options). A rerun skips recorded shards whose output is intact.
``config.json`` and the index are written last, so a partial output never looks loadable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .errors import InputError, OutputError
from .models import PICKLE_SUFFIXES
from .plan import Plan, ShardPlan, build_plan, output_config
from .quant import Method
from .shards import INDEX_NAME, Checkpoint, open_checkpoint
from .workers import check_disk_space, peak_rss_bytes, resolve_devices, run_shards
from .writer import TMP_SUFFIX, copy_file, write_json

__all__ = ["ConvertOptions", "ConvertResult", "convert_checkpoint", "MANIFEST_NAME"]

MANIFEST_NAME = "chordq_manifest.json"
# Files in a model directory that are never carried over.
_SKIP_FILES = {"config.json", INDEX_NAME, MANIFEST_NAME, "chordq_verify.json"}


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """How to convert. ``device``: auto | cpu | cuda | cuda:N; ``workers``: shards converted at
    once (0 = one per GPU with ``cuda``, else 1: the CPU kernel already uses every core)."""

    method: Method = Method.MSE
    device: str = "auto"
    workers: int = 0
    overwrite: bool = False
    revision: str | None = None  # Hub sources only
    delete_source: bool = False  # Hub sources only: drop each cached shard once converted

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        if self.workers < 0:
            raise ValueError("workers must be >= 0")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InputError(f"--device {self.device!r}: use auto, cpu, cuda or cuda:N")

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a resumed run to produce the same bytes (every device computes
        the same bits, so the device is not part of it)."""
        return {"method": self.method.value, "chordq_version": __version__}


@dataclasses.dataclass
class ConvertResult:
    output: Path
    source_format: str
    shards_total: int
    shards_converted: int
    shards_skipped: int
    tensors_quantized: int
    tensors_copied: int
    source_bytes: int
    output_bytes: int
    seconds: float
    sqnr_min_db: float | None
    sqnr_mean_db: float | None
    method: str = "mse"
    devices: list[str] = dataclasses.field(default_factory=list)
    workers: int = 1
    peak_rss_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["output"] = str(self.output)
        return d


# --------------------------------------------------------------------------------------------
# output directory and manifest


def _check_output(src: Path, out: Path, plan: Plan, options: ConvertOptions) -> tuple[dict[str, Any] | None, bool]:
    """Every refusal about the output directory, without touching it.

    :returns: (the manifest of a previous run to resume, or None to start fresh;
        whether chordq's previous output must be cleared first)
    """
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise OutputError(f"{out}: output must not be the source directory or inside it; choose another -o")
    if not out.exists():
        return None, False
    if not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory")
    if not any(out.iterdir()):
        return None, False
    manifest_path = out / MANIFEST_NAME
    if not manifest_path.is_file():
        raise OutputError(
            f"{out}: exists, is not empty and was not made by chordq; choose an empty or new -o directory"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError:
        raise OutputError(f"{manifest_path}: unreadable manifest; remove {out} or pass --overwrite") from None
    if manifest.get("options") != options.fingerprint() or manifest.get("source_format") != plan.fmt.value:
        if not options.overwrite:
            raise OutputError(
                f"{out}: made by chordq with other options ({manifest.get('options')}); "
                "rerun with the same options or pass --overwrite"
            )
        return None, True
    if options.overwrite:
        return None, True
    return manifest, False


def _prepare_output(src: Path, out: Path, plan: Plan, options: ConvertOptions) -> dict[str, Any]:
    manifest, clear = _check_output(src, out, plan, options)
    if clear:
        _clear_output(out)
    out.mkdir(parents=True, exist_ok=True)
    if manifest is not None:
        return manifest
    return {
        "chordq_version": __version__,
        "options": options.fingerprint(),
        "source": str(src),
        "source_format": plan.fmt.value,
        "shards": {},
        "complete": False,
    }


def _clear_output(out: Path) -> None:
    """Remove what chordq wrote (only called on a directory holding a chordq manifest)."""
    for p in out.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _shard_key(ckpt: Checkpoint, file: str) -> dict[str, Any]:
    h = ckpt.headers[file]
    return {"size": h.size, "header_sha256": h.header_sha256}


def _shard_done(out: Path, manifest: dict[str, Any], ckpt: Checkpoint, shard: ShardPlan) -> bool:
    rec = manifest["shards"].get(shard.file)
    if rec is None:
        return False
    if rec.get("source") != _shard_key(ckpt, shard.file):
        raise OutputError(
            f"{out / shard.file}: the source shard changed since it was converted; pass --overwrite to start over"
        )
    path = out / shard.file
    return path.is_file() and path.stat().st_size == rec.get("output_size")


# --------------------------------------------------------------------------------------------
# whole checkpoint


def _other_files(src: Path) -> list[Path]:
    files = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if rel.as_posix() in _SKIP_FILES or p.suffix == ".safetensors" or p.suffix in PICKLE_SUFFIXES:
            continue
        if p.name.endswith(TMP_SUFFIX):
            continue
        files.append(rel)
    return files


def _write_index(out: Path, plan: Plan) -> None:
    weight_map = {name: shard.file for shard in plan.shards for name, _, _ in shard.specs}
    write_json(
        out / INDEX_NAME,
        {"metadata": {"total_size": plan.output_bytes}, "weight_map": dict(sorted(weight_map.items()))},
    )


def convert_checkpoint(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    on_shard: Callable[[str], None] | None = None,
    on_plan: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert a local Kimi K2.x checkpoint directory into compressed-tensors INT4 group 32.

    :param source: local checkpoint directory (config.json + safetensors shards)
    :param output: output directory (created; must be empty, new, or a previous chordq run)
    :param options: method, device, workers, overwrite
    :param progress: called with the number of source bytes finished after every tensor
    :param on_shard: called with each shard's file name once it is written (or found done)
    :param on_plan: called once with (shard count, source bytes) after preflight
    """
    t0 = time.monotonic()
    out = Path(output)
    ckpt, hub = open_source(str(source), options)
    src = ckpt.root
    plan = build_plan(ckpt)
    devices = resolve_devices(options.device, options.workers)
    manifest = _prepare_output(src, out, plan, options)
    manifest["source"] = str(source)
    todo = [s for s in plan.shards if not _shard_done(out, manifest, ckpt, s)]
    check_disk_space(out, todo)
    write_json(out / MANIFEST_NAME, manifest)
    if on_plan is not None:
        on_plan(len(plan.shards), ckpt.total_bytes)
    progress = progress or (lambda n: None)
    on_shard = on_shard or (lambda f: None)
    for shard in plan.shards:
        if shard not in todo:
            progress(shard.source_bytes)
            on_shard(shard.file)
    results = []
    needs = {s.file: shard_inputs(ckpt, s) for s in plan.shards}
    fetch = None if hub is None else (lambda f: [_fetch_checked(hub, ckpt, x) for x in sorted(needs[f])])
    unfinished = {s.file for s in todo}
    for result in run_shards(ckpt, todo, out, options.method, devices, progress, fetch):
        manifest["shards"][result.file] = {"source": _shard_key(ckpt, result.file), "output_size": result.size}
        write_json(out / MANIFEST_NAME, manifest)
        results.append(result)
        on_shard(result.file)
        unfinished.discard(result.file)
        if hub is not None and options.delete_source:
            still_needed = set().union(*(needs[f] for f in unfinished)) if unfinished else set()
            for f in sorted(needs[result.file] - still_needed):
                hub.delete(f)
    for rel in _other_files(src):
        copy_file(src / rel, out / rel)
    _write_index(out, plan)
    write_json(out / "config.json", output_config(ckpt.config, plan.fmt))
    manifest["complete"] = True
    manifest["seconds"] = round(manifest.get("seconds", 0.0) + time.monotonic() - t0, 3)  # all runs
    manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(out / MANIFEST_NAME, manifest)
    sqnr = [x for r in results for x in r.sqnr if math.isfinite(x)]
    return ConvertResult(
        output=out,
        source_format=plan.fmt.value,
        shards_total=len(plan.shards),
        shards_converted=len(results),
        shards_skipped=len(plan.shards) - len(todo),
        tensors_quantized=sum(r.quantized for r in results),
        tensors_copied=sum(r.copied for r in results),
        source_bytes=plan.source_bytes,
        output_bytes=plan.output_bytes,
        seconds=time.monotonic() - t0,
        sqnr_min_db=min(sqnr) if sqnr else None,
        sqnr_mean_db=sum(sqnr) / len(sqnr) if sqnr else None,
        method=options.method.value,
        devices=devices,
        workers=len(devices),
        peak_rss_bytes=peak_rss_bytes(),
    )


def open_source(source: str, options: ConvertOptions) -> tuple[Checkpoint, Any]:
    """A local directory, or a Hub id: config, index and small files are downloaded first and
    every shard header is read with range requests, so nothing large moves before preflight."""
    if Path(source).exists():
        is_hub = False
    else:
        from .hub import is_hub_id  # huggingface_hub is only imported for Hub sources

        is_hub = is_hub_id(source)
    if not is_hub:
        if options.delete_source:
            raise InputError(f"{source}: --delete-source only applies to Hub sources (it never deletes local files)")
        return open_checkpoint(source), None
    from .hub import HubCheckpoint

    remote = HubCheckpoint(source, revision=options.revision)
    return remote.checkpoint, remote.hub


def shard_inputs(ckpt: Checkpoint, shard: ShardPlan) -> set[str]:
    """Every source file a shard's conversion reads: itself, plus the shards holding FP8 scales
    of its weights (real FP8 releases split a weight and its scale across shards)."""
    from .plan import JobKind
    from .sources import fp8_scale_name

    files = {shard.file}
    for job in shard.jobs:
        if job.kind is not JobKind.COPY and (scale := ckpt.tensors.get(fp8_scale_name(job.source))) is not None:
            files.add(scale.shard)
    return files


def _fetch_checked(hub: Any, ckpt: Checkpoint, file: str) -> None:
    """Download one shard and check it is the shard the plan was made from."""
    from .shards import read_header

    hub.fetch(file)
    if read_header(ckpt.root, file).header_sha256 != ckpt.headers[file].header_sha256:
        raise InputError(f"{file}: the downloaded shard differs from the header checked at preflight; rerun")


def dry_run_plan(
    source: str | os.PathLike[str], output: str | os.PathLike[str], options: ConvertOptions = ConvertOptions()
) -> dict[str, Any]:
    """Everything convert checks before heavy work, and the plan it would run; writes nothing."""
    from .plan import describe

    out = Path(output)
    ckpt, _ = open_source(str(source), options)
    plan = build_plan(ckpt)
    devices = resolve_devices(options.device, options.workers)
    manifest = _check_output(ckpt.root, out, plan, options)[0] or {"shards": {}}
    info = describe(plan)
    shards, needed = [], 0
    for shard in plan.shards:
        done = out.exists() and _shard_done(out, manifest, ckpt, shard)
        needed += 0 if done else shard.file_bytes
        shards.append({"file": shard.file, "source_bytes": shard.source_bytes, "output_file_bytes": shard.file_bytes,
                       "status": "done" if done else "to convert"})
    probe = out if out.exists() else next(p for p in out.absolute().parents if p.exists())
    info.update(shards_plan=shards, output_dir=str(out), needed_bytes=needed,
                free_bytes=shutil.disk_usage(probe).free, devices=devices)
    return info
