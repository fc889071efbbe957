"""Atomic outputs: safetensors shards written in place from a known plan, index, config, files.

A shard's header is computed from the plan (names, dtypes, shapes are known before any tensor
is read), so every tensor is written straight to its final offset with ``pwrite`` in whatever
order it is produced, and nothing larger than one tensor is held in memory. The file is built
as ``<name>.chordq-tmp`` and renamed into place only when every tensor has been written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch

from .errors import OutputError
from .shards import DTYPE_NAMES, DTYPES

__all__ = [
    "TensorSpec",
    "ShardWriter",
    "shard_file_size",
    "tensor_bytes",
    "atomic_write_text",
    "write_json",
    "TMP_SUFFIX",
]

TMP_SUFFIX = ".chordq-tmp"

TensorSpec = tuple[str, str, tuple[int, ...]]  # (name, safetensors dtype, shape)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPES[dtype].itemsize
    for d in shape:
        n *= d
    return n


def shard_layout(specs: Iterable[TensorSpec]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Header bytes (length prefix + padded JSON) and each tensor's (offset, nbytes) in the file.

    Tensors are ordered like safetensors' own writer (widest dtype first, then by name) so each
    one is aligned to its element size.
    """
    ordered = sorted(specs, key=lambda s: (-DTYPES[s[1]].itemsize, s[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    spans: dict[str, tuple[int, int]] = {}
    for name, dtype, shape in ordered:
        if name in header:
            raise ValueError(f"tensor {name} planned twice")
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        spans[name] = (offset, size)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = len(raw).to_bytes(8, "little") + raw
    return prefix, {k: (len(prefix) + o, n) for k, (o, n) in spans.items()}


def shard_file_size(specs: Iterable[TensorSpec]) -> int:
    """Exact size in bytes of the safetensors file holding ``specs``."""
    header, spans = shard_layout(specs)
    return len(header) + sum(n for _, n in spans.values())


def tensor_bytes(specs: Iterable[TensorSpec]) -> int:
    """Bytes of tensor data (what an index's ``total_size`` counts)."""
    return sum(_nbytes(dtype, shape) for _, dtype, shape in specs)


class ShardWriter:
    """Write one safetensors file whose tensors are known up front; tensors arrive in any order."""

    def __init__(self, path: Path, specs: list[TensorSpec]):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.specs = {name: (dtype, tuple(shape)) for name, dtype, shape in specs}
        header, self.spans = shard_layout(specs)
        self.size = len(header) + sum(n for _, n in self.spans.values())
        self.pending = set(self.specs)
        self.partial: dict[str, int] = {}
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _reserve(self.fd, self.size, self.path)
            os.pwrite(self.fd, header, 0)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        dtype, shape = self.specs[name]
        if DTYPE_NAMES.get(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.path.name}: tensor {name} is {tensor.dtype}{list(tensor.shape)}, planned {dtype}{list(shape)}"
            )
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self.write_bytes(name, 0, memoryview(data))

    def write_bytes(self, name: str, offset: int, data: bytes | memoryview) -> None:
        """Write raw bytes of tensor ``name`` starting ``offset`` bytes into its data."""
        start, size = self.spans[name]
        if offset + len(data) > size:
            raise ValueError(f"{self.path.name}: {len(data)} bytes at {offset} overflow tensor {name} ({size} bytes)")
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            try:
                written += os.pwrite(self.fd, view[written:], start + offset + written)
            except OSError as e:
                raise OutputError(f"{self.path}: write failed ({e.strerror}); free disk space and rerun to resume") from None
        done = self.partial.get(name, 0) + len(view)
        self.partial[name] = done
        if done >= size:
            self.pending.discard(name)

    def commit(self) -> None:
        if self.pending:
            raise RuntimeError(f"{self.path.name}: tensors never written: {sorted(self.pending)[:3]}")
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


def _reserve(fd: int, size: int, path: Path) -> None:
    """Allocate the whole file now so a full disk fails here, not hours later."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, max(size, 1))
        else:  # pragma: no cover - macOS
            os.ftruncate(fd, size)
    except OSError as e:
        if e.errno in (95, 22):  # filesystem without fallocate
            os.ftruncate(fd, size)
            return
        raise OutputError(f"{path}: cannot allocate {size} bytes ({e.strerror}); free disk space and rerun to resume") from None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: write failed ({e.strerror})") from None


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + TMP_SUFFIX)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{dst}: copy failed ({e.strerror})") from None
