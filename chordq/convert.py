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
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__
from .errors import InputError, OutputError
from .layout import expert_tensors
from .models import PICKLE_SUFFIXES
from .plan import Job, JobKind, Plan, ShardPlan, build_plan, output_config
from .quant import Method, dequantize, quantize, sqnr_db
from .shards import INDEX_NAME, Checkpoint, open_checkpoint, read_tensor
from .sources import read_float_weight
from .writer import TMP_SUFFIX, ShardWriter, copy_file, write_json

__all__ = ["ConvertOptions", "ConvertResult", "convert_checkpoint", "MANIFEST_NAME"]

MANIFEST_NAME = "chordq_manifest.json"
# Files in a model directory that are never carried over.
_SKIP_FILES = {"config.json", INDEX_NAME, MANIFEST_NAME, "chordq_verify.json"}


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    method: Method = Method.MSE
    device: str = "cpu"
    overwrite: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a resumed run to produce the same bytes."""
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

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["output"] = str(self.output)
        return d


# --------------------------------------------------------------------------------------------
# output directory and manifest


def _prepare_output(src: Path, out: Path, plan: Plan, options: ConvertOptions) -> dict[str, Any]:
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise OutputError(f"{out}: output must not be the source directory or inside it; choose another -o")
    manifest_path = out / MANIFEST_NAME
    fresh = {
        "chordq_version": __version__,
        "options": options.fingerprint(),
        "source": str(src),
        "source_format": plan.fmt.value,
        "shards": {},
        "complete": False,
    }
    if not out.exists():
        out.mkdir(parents=True)
        return fresh
    if not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory")
    entries = [p for p in out.iterdir()]
    if not entries:
        return fresh
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
        _clear_output(out)
        return fresh
    if options.overwrite:
        _clear_output(out)
        return fresh
    return manifest


def _clear_output(out: Path) -> None:
    """Remove what chordq wrote (only called on a directory holding a chordq manifest)."""
    for p in out.iterdir():
        if p.is_dir():
            import shutil

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
# per-shard work


@dataclasses.dataclass
class _Stats:
    quantized: int = 0
    copied: int = 0
    sqnr: list[float] = dataclasses.field(default_factory=list)


def _run_job(ckpt: Checkpoint, job: Job, writer: ShardWriter, options: ConvertOptions, stats: _Stats) -> None:
    if job.kind is JobKind.COPY:
        writer.write(job.source, read_tensor(ckpt.root, ckpt.tensors[job.source]))
        stats.copied += 1
        return
    w = read_float_weight(ckpt, job.source)
    if job.kind is JobKind.FP8_TO_BF16:
        writer.write(job.source, w.to(torch.bfloat16))
        stats.copied += 1
        return
    info = ckpt.tensors[job.source]
    if not torch.isfinite(w).all():
        raise InputError(f"{info.shard}: tensor {job.source} contains NaN or Inf; the source is corrupt")
    w = w.to(options.device)
    q, scale = quantize(w, options.method)
    stats.sqnr.append(sqnr_db(w, dequantize(q, scale)))
    prefix = job.source[: -len(".weight")]
    for suffix, t in expert_tensors(q, scale).items():
        writer.write(f"{prefix}.{suffix}", t)
    stats.quantized += 1


def _convert_shard(ckpt: Checkpoint, shard: ShardPlan, out: Path, options: ConvertOptions, stats: _Stats, progress) -> int:
    writer = ShardWriter(out / shard.file, shard.specs)
    try:
        for job in shard.jobs:
            _run_job(ckpt, job, writer, options, stats)
            progress(job.source_bytes)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return writer.size


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
) -> ConvertResult:
    """Convert a local Kimi K2.x checkpoint directory into compressed-tensors INT4 group 32.

    :param source: local checkpoint directory (config.json + safetensors shards)
    :param output: output directory (created; must be empty, new, or a previous chordq run)
    :param options: method, device, overwrite
    :param progress: called with the number of source bytes finished after every tensor
    """
    t0 = time.monotonic()
    src, out = Path(source), Path(output)
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt)
    manifest = _prepare_output(src, out, plan, options)
    write_json(out / MANIFEST_NAME, manifest)
    progress = progress or (lambda n: None)
    stats = _Stats()
    converted = skipped = 0
    for shard in plan.shards:
        if _shard_done(out, manifest, ckpt, shard):
            skipped += 1
            progress(shard.source_bytes)
            continue
        size = _convert_shard(ckpt, shard, out, options, stats, progress)
        manifest["shards"][shard.file] = {"source": _shard_key(ckpt, shard.file), "output_size": size}
        write_json(out / MANIFEST_NAME, manifest)
        converted += 1
    for rel in _other_files(src):
        copy_file(src / rel, out / rel)
    _write_index(out, plan)
    write_json(out / "config.json", output_config(ckpt.config, plan.fmt))
    manifest["complete"] = True
    write_json(out / MANIFEST_NAME, manifest)
    finite = [s for s in stats.sqnr if math.isfinite(s)]
    return ConvertResult(
        output=out,
        source_format=plan.fmt.value,
        shards_total=len(plan.shards),
        shards_converted=converted,
        shards_skipped=skipped,
        tensors_quantized=stats.quantized,
        tensors_copied=stats.copied,
        source_bytes=plan.source_bytes,
        output_bytes=plan.output_bytes,
        seconds=time.monotonic() - t0,
        sqnr_min_db=min(finite) if finite else None,
        sqnr_mean_db=sum(finite) / len(finite) if finite else None,
    )
