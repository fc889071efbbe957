"""Safetensors index + headers, validated; lazy tensor reads.

Only headers are read when a checkpoint is opened (a 1 TB checkpoint opens in well under a
second); tensor bytes are read one tensor at a time with plain file reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import InputError
from .models import PICKLE_SUFFIXES

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "TensorInfo",
    "ShardHeader",
    "Checkpoint",
    "read_header",
    "parse_header",
    "open_checkpoint",
    "read_tensor",
    "INDEX_NAME",
]

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    shard: str  # file name relative to the checkpoint root
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclasses.dataclass
class ShardHeader:
    file: str
    size: int
    header_sha256: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_header(root: Path, file: str) -> ShardHeader:
    """Parse and validate one local shard's header (no tensor data is read)."""
    path = root / file
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{file}: not a safetensors file ({size} bytes); re-download it")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise InputError(
                    f"{file}: corrupt safetensors header (claims {hlen} bytes, file has {size}); "
                    "re-download the shard"
                )
            raw = f.read(hlen)
    except FileNotFoundError:
        raise InputError(f"{file}: shard listed by the index is missing; download it again") from None
    except OSError as e:
        raise InputError(f"{file}: cannot read ({e.strerror})") from None
    return parse_header(file, raw, size)


def parse_header(file: str, raw: bytes, size: int) -> ShardHeader:
    """Validate a shard's header JSON ``raw`` (without its 8-byte length) for a file of ``size``
    bytes: the same checks whether the header was read from disk or fetched from the Hub."""
    if 8 + len(raw) > size:
        raise InputError(f"{file}: corrupt safetensors header (longer than the file); re-download the shard")
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{file}: corrupt safetensors header (invalid JSON); re-download the shard") from None
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{file}: corrupt header entry for tensor {name}; re-download the shard") from None
        if dtype not in DTYPES:
            raise InputError(f"{file}: tensor {name} has unsupported dtype {dtype}")
        itemsize = DTYPES[dtype].itemsize
        if any(d < 0 for d in shape) or end - begin != _numel(shape) * itemsize or begin < 0:
            raise InputError(f"{file}: corrupt header entry for tensor {name} (size does not match shape)")
        if data_start + end > size:
            raise InputError(
                f"{file}: truncated: tensor {name} ends at byte {data_start + end} but the file has "
                f"{size} bytes; re-download the shard"
            )
        tensors[name] = TensorInfo(name, dtype, shape, file, data_start + begin, end - begin)
    return ShardHeader(file, size, hashlib.sha256(raw).hexdigest(), tensors, dict(metadata))


@dataclasses.dataclass
class Checkpoint:
    """A validated view of a local safetensors checkpoint directory."""

    root: Path
    config: dict[str, Any]
    shards: list[str]  # in index order (sorted file names)
    headers: dict[str, ShardHeader]
    tensors: dict[str, TensorInfo]  # every tensor by name
    has_index: bool

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def shard_tensors(self, shard: str) -> list[TensorInfo]:
        return list(self.headers[shard].tensors.values())


def _safe_relpath(root: Path, rel: str, what: str) -> str:
    """A shard path from the index, checked lexically: relative, no ``..``, no drive or
    backslash. Symlinks are not resolved, so a huggingface_hub cache snapshot (whose shards
    link into ``../../blobs``) is a valid checkpoint."""
    p = Path(rel)
    if not rel or p.is_absolute() or ".." in p.parts or rel.startswith(("/", "\\")) or "\\" in rel or ":" in rel:
        raise InputError(f"{what}: shard path {rel!r} escapes the checkpoint directory; refusing it")
    return p.as_posix()


def load_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise InputError(f"{root}: no config.json; is this a Hugging Face model directory?")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: invalid JSON ({e}); fix or re-download config.json") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: config.json is not a JSON object")
    return config


def _shard_files(root: Path) -> tuple[list[str], dict[str, str] | None]:
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise InputError(f"{index}: invalid index (no weight_map); re-download it") from None
        files = sorted({_safe_relpath(root, str(f), INDEX_NAME) for f in weight_map.values()})
        return files, {k: _safe_relpath(root, str(v), INDEX_NAME) for k, v in weight_map.items()}
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise InputError(
                f"{root}: only pickle checkpoints ({pickles[0]}, ...); chordq never unpickles. "
                "Use a safetensors release of the model"
            )
        raise InputError(f"{root}: no *.safetensors files and no {INDEX_NAME}")
    return files, None


def open_checkpoint(
    root: str | os.PathLike[str], header_of: Callable[[str], ShardHeader] | None = None
) -> Checkpoint:
    """Read config.json, the index and every shard header; check they agree.

    :param header_of: where a shard's header comes from (default: the local file); a Hub
        source passes a function that fetches only the header bytes with a range request.
    """
    root = Path(root)
    if not root.exists():
        raise InputError(f"{root}: no such directory or Hub model")
    if not root.is_dir():
        raise InputError(f"{root}: not a directory")
    config = load_config(root)
    files, weight_map = _shard_files(root)
    headers: dict[str, ShardHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        header = header_of(file) if header_of is not None else read_header(root, file)
        headers[file] = header
        for name, info in header.tensors.items():
            if name in tensors:
                raise InputError(
                    f"tensor {name} appears in both {tensors[name].shard} and {file}; the checkpoint is inconsistent"
                )
            tensors[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise InputError(f"{INDEX_NAME}: tensor {name} is not in {file}; re-download the checkpoint")
            if tensors[name].shard != file:
                raise InputError(
                    f"{INDEX_NAME}: tensor {name} is listed in {file} but stored in {tensors[name].shard}"
                )
        extra = [n for n in tensors if n not in weight_map]
        if extra:
            raise InputError(
                f"{tensors[extra[0]].shard}: tensor {extra[0]} is not listed in {INDEX_NAME} "
                f"({len(extra)} such tensors); re-download the index"
            )
    return Checkpoint(root, config, files, headers, tensors, weight_map is not None)


def read_tensor(root: Path, info: TensorInfo) -> torch.Tensor:
    """Read one tensor's bytes from disk into a new CPU tensor (little-endian, as on disk)."""
    buf = bytearray(info.nbytes)
    with open(root / info.shard, "rb") as f:
        f.seek(info.start)
        n = f.readinto(buf)
    if n != info.nbytes:
        raise InputError(f"{info.shard}: truncated while reading tensor {info.name}; re-download the shard")
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.torch_dtype)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    return t.view(info.torch_dtype).reshape(info.shape)
