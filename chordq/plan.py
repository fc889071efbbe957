"""The conversion plan: for every source shard, which output tensors come from which source
tensors. Built from headers alone, so it is checked before any heavy work starts.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

from .errors import InputError
from .models import (
    FP8_SCALE_SUFFIX,
    INT4_SUFFIXES,
    TextArch,
    int4_quantization_config,
    is_nested,
    parse_expert,
    text_arch,
)
from .quant import GROUP_SIZE
from .shards import Checkpoint, TensorInfo
from .sources import SourceFormat, detect_format, fp8_scale_name
from .writer import TensorSpec, shard_file_size, tensor_bytes

__all__ = ["JobKind", "Job", "ShardPlan", "Plan", "build_plan", "output_config"]


class JobKind(str, enum.Enum):
    QUANTIZE = "quantize"  # float/FP8 expert weight -> weight_packed, weight_scale, weight_shape
    FP8_TO_BF16 = "fp8-to-bf16"  # non-expert FP8 linear -> BF16 weight
    COPY = "copy"  # bytes unchanged (native INT4 experts included)


@dataclasses.dataclass
class Job:
    kind: JobKind
    source: str  # source tensor name
    outputs: list[TensorSpec]
    source_bytes: int  # bytes read from the source (FP8 scales included)


@dataclasses.dataclass
class ShardPlan:
    file: str
    jobs: list[Job]

    @property
    def specs(self) -> list[TensorSpec]:
        return [spec for job in self.jobs for spec in job.outputs]

    @property
    def source_bytes(self) -> int:
        return sum(j.source_bytes for j in self.jobs)

    @property
    def output_bytes(self) -> int:
        """Tensor bytes of the output shard (its share of the index's ``total_size``)."""
        return tensor_bytes(self.specs)

    @property
    def file_bytes(self) -> int:
        """Exact size of the output shard file, header included."""
        return shard_file_size(self.specs)


@dataclasses.dataclass
class Plan:
    ckpt: Checkpoint
    fmt: SourceFormat
    arch: TextArch
    shards: list[ShardPlan]

    @property
    def output_bytes(self) -> int:
        return sum(s.output_bytes for s in self.shards)

    @property
    def source_bytes(self) -> int:
        return sum(s.source_bytes for s in self.shards)

    def count(self, kind: JobKind) -> int:
        return sum(1 for s in self.shards for j in s.jobs if j.kind is kind)


def _quantized_specs(name_prefix: str, n: int, k: int) -> list[TensorSpec]:
    return [
        (f"{name_prefix}.weight_packed", "I32", (n, k // 8)),
        (f"{name_prefix}.weight_scale", "BF16", (n, k // GROUP_SIZE)),
        (f"{name_prefix}.weight_shape", "I64", (2,)),
    ]


def _arch(ckpt: Checkpoint) -> TextArch:
    try:
        return text_arch(ckpt.config)
    except KeyError as e:
        raise InputError(
            f"{ckpt.root / 'config.json'}: missing {e.args[0]!r}; not a Kimi K2.x / DeepSeek-V3 MoE config"
        ) from None


def _check_experts(ckpt: Checkpoint, fmt: SourceFormat, arch: TextArch) -> None:
    """Every expected routed expert is present with the right shape and dtype."""
    for ex in arch.expected_experts():
        n, k = arch.expert_shape(ex.proj)
        if fmt is SourceFormat.INT4_CT:
            for suffix in INT4_SUFFIXES:
                if ex.tensor(suffix) not in ckpt.tensors:
                    raise InputError(f"tensor {ex.tensor(suffix)} is missing; the checkpoint is incomplete")
            packed = ckpt.tensors[ex.tensor("weight_packed")]
            scale = ckpt.tensors[ex.tensor("weight_scale")]
            if packed.shape != (n, k // 8) or packed.dtype != "I32" or scale.shape != (n, k // GROUP_SIZE):
                raise InputError(
                    f"{packed.shard}: {packed.name} is {packed.dtype}{list(packed.shape)} with scale "
                    f"{list(scale.shape)}; expected I32[{n}, {k // 8}] with scale [{n}, {k // GROUP_SIZE}]"
                )
            continue
        name = ex.tensor("weight")
        info = ckpt.tensors.get(name)
        if info is None:
            raise InputError(f"tensor {name} is missing; the checkpoint is incomplete")
        if info.shape != (n, k):
            raise InputError(f"{info.shard}: {name} has shape {list(info.shape)}, config says [{n}, {k}]")
        if fmt is SourceFormat.FP8_BLOCK and info.dtype != "F8_E4M3":
            raise InputError(f"{info.shard}: {name} is {info.dtype}; other experts are F8_E4M3")
        if fmt is SourceFormat.FP8_BLOCK and fp8_scale_name(name) not in ckpt.tensors:
            raise InputError(f"{info.shard}: FP8 tensor {name} has no weight_scale_inv in any shard")


def _job_for(ckpt: Checkpoint, fmt: SourceFormat, info: TensorInfo) -> Job | None:
    name = info.name
    parsed = parse_expert(name)
    if fmt is SourceFormat.INT4_CT or (parsed is None and not name.endswith((".weight", FP8_SCALE_SUFFIX))):
        return Job(JobKind.COPY, name, [(name, info.dtype, info.shape)], info.nbytes)
    if name.endswith(FP8_SCALE_SUFFIX):
        partner = ckpt.tensors.get(name[: -len(FP8_SCALE_SUFFIX)] + ".weight")
        if partner is not None and partner.dtype == "F8_E4M3":
            return None  # consumed with its weight (wherever that weight lives)
        return Job(JobKind.COPY, name, [(name, info.dtype, info.shape)], info.nbytes)
    scale_bytes = ckpt.tensors[fp8_scale_name(name)].nbytes if info.dtype == "F8_E4M3" and fp8_scale_name(name) in ckpt.tensors else 0
    if parsed is not None and parsed[1] == "weight":
        n, k = info.shape
        if k % GROUP_SIZE:
            raise InputError(f"{info.shard}: {name} has K={k}, not divisible by the group size {GROUP_SIZE}")
        return Job(JobKind.QUANTIZE, name, _quantized_specs(name[: -len(".weight")], n, k), info.nbytes + scale_bytes)
    if info.dtype == "F8_E4M3":
        if not scale_bytes:
            raise InputError(f"{info.shard}: FP8 tensor {name} has no weight_scale_inv in any shard")
        return Job(JobKind.FP8_TO_BF16, name, [(name, "BF16", info.shape)], info.nbytes + scale_bytes)
    return Job(JobKind.COPY, name, [(name, info.dtype, info.shape)], info.nbytes)


def build_plan(ckpt: Checkpoint) -> Plan:
    """Detect the format, check every expected expert, and lay out every output shard."""
    fmt = detect_format(ckpt)
    arch = _arch(ckpt)
    if arch.expected_expert_modules == 0:
        raise InputError(f"{ckpt.root / 'config.json'}: the config has no MoE layers; nothing to quantize")
    _check_experts(ckpt, fmt, arch)
    shards = []
    for file in ckpt.shards:
        jobs = [
            job
            for info in sorted(ckpt.headers[file].tensors.values(), key=lambda t: t.name)
            if (job := _job_for(ckpt, fmt, info)) is not None
        ]
        shards.append(ShardPlan(file, jobs))
    return Plan(ckpt, fmt, arch, shards)


def output_config(config: dict[str, Any], fmt: SourceFormat) -> dict[str, Any]:
    """config.json of the output: the INT4 block where the source kept its quantization config.

    Native INT4 sources keep their config untouched (it already describes the copied experts).
    """
    out = copy.deepcopy(config)
    if fmt is SourceFormat.INT4_CT:
        return out
    nested = is_nested(out)
    in_text = nested and "quantization_config" in out["text_config"]
    at_top = "quantization_config" in out
    out.pop("quantization_config", None)
    if nested:
        out["text_config"].pop("quantization_config", None)
    block = int4_quantization_config(config)
    if at_top or not nested:
        out["quantization_config"] = block
    if nested and (in_text or not at_top):
        out["text_config"]["quantization_config"] = block
    # The block is validated against compressed-tensors' own schema by the tests and by
    # `chordq verify` (importing compressed-tensors here would cost seconds on every run).
    return out



def describe(plan: Plan) -> dict[str, Any]:
    """What the checkpoint is and what convert will do (headers only), for inspect / --dry-run."""
    ckpt, arch = plan.ckpt, plan.arch
    cfg = ckpt.config
    action = {
        SourceFormat.BF16: "quantize routed experts to INT4 g32; copy everything else",
        SourceFormat.FP8_BLOCK: "dequantize FP8 block experts, quantize to INT4 g32; FP8 non-expert linears -> BF16",
        SourceFormat.INT4_CT: "copy native INT4 experts bit for bit (no requantization); copy everything else",
    }[plan.fmt]
    return {
        "path": str(ckpt.root),
        "architectures": cfg.get("architectures"),
        "model_type": cfg.get("model_type"),
        "text_model_type": cfg["text_config"].get("model_type") if is_nested(cfg) else None,
        "source_format": plan.fmt.value,
        "tensor_prefix": arch.prefix,
        "num_hidden_layers": arch.num_hidden_layers,
        "moe_layers": len(arch.moe_layers),
        "routed_experts_per_layer": arch.n_routed_experts,
        "experts_per_token": arch.num_experts_per_tok,
        "expert_shapes": {p: list(arch.expert_shape(p)) for p in ("gate_proj", "up_proj", "down_proj")},
        "expert_modules": arch.expected_expert_modules,
        "shards": len(ckpt.shards),
        "tensors": len(ckpt.tensors),
        "source_tensor_bytes": ckpt.total_bytes,
        "plan": {
            "action": action,
            "quantize": plan.count(JobKind.QUANTIZE),
            "fp8_to_bf16": plan.count(JobKind.FP8_TO_BF16),
            "copy": plan.count(JobKind.COPY),
            "output_tensor_bytes": plan.output_bytes,
        },
    }
