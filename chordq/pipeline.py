"""One shard, streamed: a reader thread, the quantizer, and a writer thread joined by small
bounded queues, so reading, computing and writing overlap and memory stays bounded.

Peak memory per worker is about ``(2 * QUEUE_DEPTH + 2)`` tensors in flight: each quantized
expert is read as its raw source bytes (14.7 MB for an FP8 K2 expert) and leaves as 8.3 MB of
words and scales; copied tensors move in ``COPY_CHUNK`` pieces whatever their size (the 2.3 GB
K2 embedding included). No float32 copy of a shard, or of a whole expert on the CPU path, exists.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import InputError
from .layout import pack_int4
from .plan import Job, JobKind, ShardPlan
from .quant import Method, dequantize, quantize, sqnr_db
from .shards import Checkpoint, TensorInfo, read_tensor
from .sources import dequant_fp8_block, fp8_block_size, fp8_scale_name, read_float_weight
from .writer import ShardWriter

__all__ = ["ShardResult", "convert_shard", "quantize_expert", "QUEUE_DEPTH", "COPY_CHUNK"]

QUEUE_DEPTH = 2
COPY_CHUNK = 64 * 1024 * 1024


@dataclasses.dataclass
class ShardResult:
    file: str
    size: int
    quantized: int = 0
    copied: int = 0
    sqnr: list[float] = dataclasses.field(default_factory=list)


def quantize_expert(
    raw: torch.Tensor, scale_inv: torch.Tensor | None, block: tuple[int, int], method: Method, device: str
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Source weight (BF16/FP16/FP32, or FP8 + block scales) -> (words, scale, SQNR dB, #non-finite).

    CPU: the fused numba kernel; CUDA: the fused Triton kernel. Both are bit-identical to the
    plain-PyTorch oracle (``chordq.quant``), which is the fallback when neither is available.
    """
    if device == "cpu":
        from .kernels.cpu_quant import HAVE_NUMBA, quantize_packed_cpu

        if HAVE_NUMBA:
            return quantize_packed_cpu(raw, method, scale_inv=scale_inv, block=block)
    elif device.startswith("cuda"):
        from .kernels.triton_quant import quantize_packed_triton

        return quantize_packed_triton(raw.to(device), method, scale_inv=None if scale_inv is None else scale_inv.to(device), block=block)
    w = dequant_fp8_block(raw, scale_inv, block) if scale_inv is not None else raw.float()
    bad = int((~torch.isfinite(w)).sum())
    w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0).to(device)
    q, scale = quantize(w, method)
    return pack_int4(q), scale, sqnr_db(w, dequantize(q, scale)), bad


class _Pipe:
    """Runs reader and writer threads; the first error anywhere stops all of them."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def put(self, q: queue.Queue, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, q: queue.Queue) -> Any:
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return None

    def fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        self.stop.set()

    def thread(self, fn: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - forwarded to the main thread
                self.fail(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


def _copy_chunks(ckpt: Checkpoint, info: TensorInfo, pipe: _Pipe, out_q: queue.Queue) -> bool:
    """Queue a tensor's bytes in COPY_CHUNK pieces (at least one, possibly empty)."""
    with open(ckpt.root / info.shard, "rb") as f:
        f.seek(info.start)
        for done in range(0, max(info.nbytes, 1), COPY_CHUNK):
            n = min(COPY_CHUNK, info.nbytes - done)
            data = f.read(n)
            if len(data) != n:
                raise InputError(f"{info.shard}: truncated while reading tensor {info.name}; re-download the shard")
            if not pipe.put(out_q, ("raw", info.name, done, data)):
                return False
    return True


def convert_shard(
    ckpt: Checkpoint,
    shard: ShardPlan,
    out: Path,
    method: Method,
    device: str,
    progress: Callable[[int], None] = lambda n: None,
) -> ShardResult:
    """Convert one source shard into ``out / shard.file`` (atomically)."""
    writer = ShardWriter(out / shard.file, shard.specs)
    result = ShardResult(shard.file, writer.size)
    block = fp8_block_size(ckpt.config)
    pipe = _Pipe()
    read_q: queue.Queue = queue.Queue(QUEUE_DEPTH)
    write_q: queue.Queue = queue.Queue(QUEUE_DEPTH)
    copy_stream = torch.cuda.Stream(device) if device.startswith("cuda") else None

    def reader() -> None:
        for job in shard.jobs:
            info = ckpt.tensors[job.source]
            if job.kind is JobKind.COPY:
                if not _copy_chunks(ckpt, info, pipe, write_q) or not pipe.put(write_q, ("done", job, None, None)):
                    return
                continue
            if job.kind is JobKind.FP8_TO_BF16:
                item = read_float_weight(ckpt, job.source).to(torch.bfloat16)
            else:
                raw = read_tensor(ckpt.root, info)
                sname = fp8_scale_name(job.source)
                scale_inv = read_tensor(ckpt.root, ckpt.tensors[sname]) if info.dtype == "F8_E4M3" else None
                if copy_stream is not None:  # host-to-device here, overlapping the kernels
                    with torch.cuda.stream(copy_stream):
                        raw = raw.to(device, non_blocking=False)
                        scale_inv = None if scale_inv is None else scale_inv.to(device)
                item = (raw, scale_inv)
            if not pipe.put(read_q, (job, item)):
                return
        pipe.put(read_q, None)

    def writer_loop() -> None:
        while (item := pipe.get(write_q)) is not None:
            kind, a, b, c = item
            if kind == "raw":
                writer.write_bytes(a, b, c)
            elif kind == "tensors":
                for name, t in b:
                    writer.write(name, t)
                progress(a.source_bytes)
            elif kind == "done":
                progress(a.source_bytes)
            elif kind == "end":
                return

    threads = [pipe.thread(reader), pipe.thread(writer_loop)]
    try:
        while (item := pipe.get(read_q)) is not None:
            job, payload = item
            if job.kind is JobKind.FP8_TO_BF16:
                pipe.put(write_q, ("tensors", job, [(job.source, payload)], None))
                result.copied += 1
                continue
            raw, scale_inv = payload
            for t in (raw, scale_inv):
                if t is not None and t.is_cuda:  # allocated on the copy stream, used on this one
                    t.record_stream(torch.cuda.current_stream(t.device))
            words, scale, sqnr, bad = quantize_expert(raw, scale_inv, block, method, device)
            if bad:
                info = ckpt.tensors[job.source]
                raise InputError(f"{info.shard}: tensor {job.source} contains {bad} NaN/Inf values; the source is corrupt")
            n, k = raw.shape
            prefix = job.source[: -len(".weight")]
            tensors = [  # device-to-host happens on the writer thread
                (f"{prefix}.weight_packed", words),
                (f"{prefix}.weight_scale", scale),
                (f"{prefix}.weight_shape", torch.tensor([n, k], dtype=torch.int64)),
            ]
            if not pipe.put(write_q, ("tensors", job, tensors, None)):
                break
            result.quantized += 1
            if math.isfinite(sqnr):
                result.sqnr.append(sqnr)
        pipe.put(write_q, ("end", None, None, None))
        for t in threads:
            while t.is_alive():
                t.join(0.1)
                if pipe.error is not None:
                    break
        if pipe.error is not None:
            raise pipe.error
        result.copied += sum(1 for j in shard.jobs if j.kind is JobKind.COPY)
        writer.commit()
    except BaseException as e:
        pipe.fail(e)
        for t in threads:
            t.join(5)
        writer.abort()
        raise e if isinstance(e, KeyboardInterrupt) else (pipe.error or e)
    return result
