"""Shard-level parallelism: devices, worker processes, disk-space preflight, peak RSS.

``--workers 1`` is a plain loop in this process (the debug path). More workers are spawned
processes, each with its own device (one per GPU with ``--device cuda``) and its share of CPU
threads; each converts whole shards, so outputs are identical whatever the worker count.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import shutil
import threading
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterator

import torch

from .errors import InputError, OutputError
from .pipeline import ShardResult, convert_shard
from .plan import ShardPlan
from .quant import Method
from .shards import Checkpoint, open_checkpoint

__all__ = ["resolve_devices", "run_shards", "check_disk_space", "peak_rss_bytes"]


def resolve_devices(device: str, workers: int) -> list[str]:
    """One entry per worker: the device that worker computes on."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: no CUDA device is visible; use --device cpu")
        n = torch.cuda.device_count()
        if device == "cuda":
            return [f"cuda:{i % n}" for i in range(workers or n)]
        index = int(device.split(":", 1)[1])
        if index >= n:
            raise InputError(f"--device {device}: only {n} CUDA device(s) visible")
        return [device] * max(1, workers)
    return ["cpu"] * max(1, workers)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process or its largest worker (Linux reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) * 1024


def check_disk_space(out: Path, todo: list[ShardPlan]) -> None:
    """Refuse to start when the remaining output (exact shard file sizes) cannot fit."""
    needed = sum(shard.file_bytes for shard in todo)
    free = shutil.disk_usage(out).free
    if needed > free:
        raise OutputError(
            f"{out}: the remaining output needs {needed / 1e9:.2f} GB but only {free / 1e9:.2f} GB is free; "
            "free disk space or choose another -o"
        )


# --- worker processes ------------------------------------------------------------------------

_CKPT: Checkpoint | None = None
_DEVICE = "cpu"
_PROGRESS = None


def _init_worker(root: str, devices: "mp.Queue", progress: "mp.Queue", threads: int) -> None:
    global _CKPT, _DEVICE, _PROGRESS
    _CKPT = open_checkpoint(root)
    _DEVICE = devices.get()
    _PROGRESS = progress
    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:  # pragma: no cover
        pass
    if _DEVICE.startswith("cuda"):
        torch.cuda.set_device(_DEVICE)


def _work(shard: ShardPlan, out: str, method: str) -> ShardResult:
    assert _CKPT is not None
    return convert_shard(_CKPT, shard, Path(out), Method(method), _DEVICE, _PROGRESS.put)


def _prefetched(shards: list[ShardPlan], fetch: Callable[[str], None] | None, ahead: int) -> Iterator[ShardPlan]:
    """Yield shards in order once ``fetch`` (a download) has made each one available locally,
    downloading up to ``ahead`` shards in advance on a background thread."""
    if fetch is None:
        yield from shards
        return
    import queue

    ready: queue.Queue = queue.Queue(maxsize=max(1, ahead))
    failed: list[BaseException] = []
    stop = threading.Event()

    def download() -> None:
        for shard in shards:
            if stop.is_set():
                return
            try:
                fetch(shard.file)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                failed.append(e)
                ready.put(None)
                return
            while not stop.is_set():
                try:
                    ready.put(shard, timeout=0.1)
                    break
                except queue.Full:
                    continue

    t = threading.Thread(target=download, daemon=True)
    t.start()
    try:
        for _ in shards:
            shard = ready.get()
            if shard is None:
                raise failed[0]
            yield shard
    finally:
        stop.set()


def run_shards(
    ckpt: Checkpoint,
    shards: list[ShardPlan],
    out: Path,
    method: Method,
    devices: list[str],
    progress: Callable[[int], None],
    fetch: Callable[[str], None] | None = None,
) -> Iterator[ShardResult]:
    """Convert ``shards``, yielding each result as soon as its shard file is complete.

    :param fetch: makes a shard available locally (a Hub download); runs ahead of conversion
        on a background thread so download and conversion overlap.
    """
    if len(devices) == 1 or len(shards) <= 1:
        for shard in _prefetched(shards, fetch, 1):
            yield convert_shard(ckpt, shard, out, method, devices[0], progress)
        return
    ctx = mp.get_context("spawn")
    device_q, progress_q = ctx.Queue(), ctx.Queue()
    for d in devices:
        device_q.put(d)
    threads = max(1, (os.cpu_count() or 1) // len(devices))
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            try:
                progress(progress_q.get(timeout=0.1))
            except Exception:  # noqa: BLE001 - queue.Empty, or a closed queue at shutdown
                continue

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    pool = ProcessPoolExecutor(
        max_workers=len(devices), mp_context=ctx, initializer=_init_worker,
        initargs=(str(ckpt.root), device_q, progress_q, threads),
    )
    try:
        # Local: largest shards first keeps every worker busy until the end. Hub: in download
        # order, each submitted as soon as it has arrived.
        order = sorted(shards, key=lambda s: -s.source_bytes) if fetch is None else shards
        pending = set()
        for shard in _prefetched(order, fetch, len(devices)):
            pending.add(pool.submit(_work, shard, str(out), method.value))
            done = {f for f in pending if f.done()}
            pending -= done
            for fut in done:
                yield fut.result()
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                yield fut.result()
    except BaseException:
        for fut in list(pending):
            fut.cancel()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        stop.set()
        drainer.join(1)
