"""Source formats: detection, and one function per format that yields weights.

=============  ==============================================  ===============================
format         routed-expert tensors                           what chordq does with them
=============  ==============================================  ===============================
``bf16``       ``weight`` BF16 / FP16 / FP32 ``[N, K]``         quantize
``fp8-block``  ``weight`` F8_E4M3 ``[N, K]`` + ``weight_scale_inv`` F32 ``[ceil(N/128), ceil(K/128)]``
                                                               dequantize (multiply), quantize
``int4-ct``    ``weight_packed`` / ``weight_scale`` / ``weight_shape`` (compressed-tensors)
                                                               copy bit for bit
=============  ==============================================  ===============================

The format is detected from the tensors (and checked against ``config.json``), never from a
repository name.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch

from .errors import InputError
from .models import FP8_SCALE_SUFFIX, parse_expert, text_config
from .shards import Checkpoint, TensorInfo, read_tensor

__all__ = [
    "SourceFormat",
    "detect_format",
    "fp8_block_size",
    "dequant_fp8_block",
    "read_float_weight",
    "fp8_scale_name",
]

FLOAT_DTYPES = ("BF16", "F16", "F32")


class SourceFormat(str, enum.Enum):
    BF16 = "bf16"
    FP8_BLOCK = "fp8-block"
    INT4_CT = "int4-ct"


def _source_quant_config(config: dict[str, Any]) -> dict[str, Any] | None:
    qc = text_config(config).get("quantization_config") or config.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def detect_format(ckpt: Checkpoint) -> SourceFormat:
    """Classify the routed experts of a checkpoint; raises InputError when there are none."""
    suffixes: dict[str, TensorInfo] = {}
    for name, info in ckpt.tensors.items():
        parsed = parse_expert(name)
        if parsed is not None:
            suffixes.setdefault(parsed[1], info)
    if not suffixes:
        raise InputError(
            f"{ckpt.root}: no routed-expert tensors (…mlp.experts.E.gate_proj…); "
            "chordq converts Kimi K2.x / DeepSeek-V3-style MoE checkpoints only"
        )
    if "weight_packed" in suffixes:
        _check_int4_config(ckpt)
        return SourceFormat.INT4_CT
    info = suffixes.get("weight")
    if info is None:
        raise InputError(f"{ckpt.root}: routed experts have no weight tensors; unknown expert format")
    if info.dtype == "F8_E4M3":
        return SourceFormat.FP8_BLOCK
    if info.dtype in FLOAT_DTYPES:
        return SourceFormat.BF16
    raise InputError(f"{info.shard}: expert tensor {info.name} has dtype {info.dtype}; expected BF16/FP16/FP32 or F8_E4M3")


def _check_int4_config(ckpt: Checkpoint) -> None:
    """Native INT4 is copied bit for bit, so its scheme must already be the one chordq writes."""
    qc = _source_quant_config(ckpt.config)
    if qc is None or qc.get("quant_method") != "compressed-tensors":
        raise InputError(
            f"{ckpt.root / 'config.json'}: experts are weight_packed but quantization_config is not "
            "compressed-tensors; cannot interpret the INT4 codes"
        )
    if qc.get("format") != "pack-quantized":
        raise InputError(f"{ckpt.root / 'config.json'}: compressed-tensors format {qc.get('format')!r}, expected pack-quantized")
    for group in (qc.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
        bad = {k: w.get(k) for k, v in wanted.items() if w.get(k) != v}
        if bad:
            raise InputError(
                f"{ckpt.root / 'config.json'}: INT4 scheme {bad} differs from symmetric int4 group 32; "
                "chordq repacks native INT4 bit-exactly and cannot change its scheme"
            )


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int]:
    qc = _source_quant_config(config) or {}
    block = qc.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def fp8_scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + FP8_SCALE_SUFFIX


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """DeepSeek-V3 block FP8: ``W[n, k] = fp8[n, k] * scale_inv[n // bn, k // bk]`` in float32.

    :param weight: float8_e4m3fn ``[N, K]``
    :param scale_inv: float32 ``[ceil(N/bn), ceil(K/bk)]`` (multiplied in despite its name)
    """
    n, k = weight.shape
    bn, bk = block
    if tuple(scale_inv.shape) != (math.ceil(n / bn), math.ceil(k / bk)):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {n}x{k} with block {bn}x{bk}")
    s = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * s


def read_float_weight(ckpt: Checkpoint, weight_name: str) -> torch.Tensor:
    """A linear's weight as float32 ``[N, K]`` (FP8 dequantized with its block scales)."""
    info = ckpt.tensors[weight_name]
    w = read_tensor(ckpt.root, info)
    if info.dtype == "F8_E4M3":
        scale_name = fp8_scale_name(weight_name)
        if scale_name not in ckpt.tensors:
            raise InputError(f"{info.shard}: FP8 tensor {weight_name} has no {FP8_SCALE_SUFFIX.lstrip('.')} in any shard")
        scale = read_tensor(ckpt.root, ckpt.tensors[scale_name])
        try:
            return dequant_fp8_block(w, scale, fp8_block_size(ckpt.config))
        except ValueError as e:
            raise InputError(f"{ckpt.tensors[scale_name].shard}: {scale_name}: {e}") from None
    return w.float()
