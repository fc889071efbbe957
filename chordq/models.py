"""Kimi K2.x knowledge as data: tensor-name patterns, ignore lists, expected shapes and counts.

Logic elsewhere never hard-codes a tensor name; it asks this module (format.md §1, §6).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = [
    "PROJECTIONS",
    "EXPERT_RE",
    "ExpertName",
    "parse_expert",
    "expert_name",
    "TextArch",
    "text_config",
    "text_arch",
    "is_nested",
    "ignore_list",
    "int4_quantization_config",
    "FP8_LINEAR_SUFFIX",
    "FP8_SCALE_SUFFIX",
    "INT4_SUFFIXES",
    "PICKLE_SUFFIXES",
]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# <prefix>layers.<L>.mlp.experts.<E>.<proj>.<suffix>; prefix is "model." (K2, K2-Thinking) or
# "language_model.model." (K2.5, K2.6).
EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:[A-Za-z_][\w]*\.)*)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>weight|weight_scale_inv|weight_packed|"
    r"weight_scale|weight_shape|weight_zero_point|weight_g_idx)$"
)

FP8_LINEAR_SUFFIX = ".weight"
FP8_SCALE_SUFFIX = ".weight_scale_inv"
INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# Expert tensors are named by (prefix, layer, expert, proj); suffix varies per format.
@dataclasses.dataclass(frozen=True, order=True)
class ExpertName:
    prefix: str
    layer: int
    expert: int
    proj: str

    def tensor(self, suffix: str) -> str:
        return expert_name(self.prefix, self.layer, self.expert, self.proj, suffix)

    @property
    def module(self) -> str:
        return f"{self.prefix}layers.{self.layer}.mlp.experts.{self.expert}.{self.proj}"


def expert_name(prefix: str, layer: int, expert: int, proj: str, suffix: str) -> str:
    return f"{prefix}layers.{layer}.mlp.experts.{expert}.{proj}.{suffix}"


def parse_expert(name: str) -> tuple[ExpertName, str] | None:
    """``(ExpertName, suffix)`` for a routed-expert tensor name, else None."""
    m = EXPERT_RE.match(name)
    if m is None:
        return None
    return (
        ExpertName(m["prefix"], int(m["layer"]), int(m["expert"]), m["proj"]),
        m["suffix"],
    )


def is_nested(config: dict[str, Any]) -> bool:
    """K2.5 / K2.6: a multimodal wrapper whose language model sits in ``text_config``."""
    return isinstance(config.get("text_config"), dict)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config["text_config"] if is_nested(config) else config


@dataclasses.dataclass(frozen=True)
class TextArch:
    """The MoE facts of a DeepSeek-V3-style text config (read from config.json, never assumed)."""

    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_routed_experts: int
    num_experts_per_tok: int
    prefix: str  # tensor-name prefix of the text model, "model." or "language_model.model."

    @property
    def moe_layers(self) -> list[int]:
        return [
            i
            for i in range(self.num_hidden_layers)
            if i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0
        ]

    def expert_shape(self, proj: str) -> tuple[int, int]:
        """Logical ``[N, K]`` of one routed expert projection."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return (h, i) if proj == "down_proj" else (i, h)

    @property
    def expected_expert_modules(self) -> int:
        return len(self.moe_layers) * self.n_routed_experts * len(PROJECTIONS)

    def expected_experts(self) -> list[ExpertName]:
        return [
            ExpertName(self.prefix, layer, e, p)
            for layer in self.moe_layers
            for e in range(self.n_routed_experts)
            for p in PROJECTIONS
        ]


_REQUIRED = (
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "n_routed_experts",
    "num_experts_per_tok",
)


def text_arch(config: dict[str, Any]) -> TextArch:
    """Read the MoE facts; raises ``KeyError(field)`` when one is missing."""
    tc = text_config(config)
    for key in _REQUIRED:
        if key not in tc or tc[key] is None:
            raise KeyError(key)
    return TextArch(
        hidden_size=int(tc["hidden_size"]),
        moe_intermediate_size=int(tc["moe_intermediate_size"]),
        num_hidden_layers=int(tc["num_hidden_layers"]),
        first_k_dense_replace=int(tc.get("first_k_dense_replace", 0) or 0),
        moe_layer_freq=int(tc.get("moe_layer_freq", 1) or 1),
        n_routed_experts=int(tc["n_routed_experts"]),
        num_experts_per_tok=int(tc["num_experts_per_tok"]),
        prefix="language_model.model." if is_nested(config) else "model.",
    )


# Kimi K2-Thinking's own ignore list (format.md §1.5). The last pattern keeps the dense layer-0
# MLP in BF16: `mlp.gate_proj` matches it, `mlp.experts.E.gate_proj` does not.
_TEXT_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
# K2.5 / K2.6 add the vision side; their lm_head lives at language_model.lm_head.
_MULTIMODAL_IGNORE = ["re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]


def ignore_list(config: dict[str, Any]) -> list[str]:
    return list(_TEXT_IGNORE) + (list(_MULTIMODAL_IGNORE) if is_nested(config) else [])


def int4_quantization_config(config: dict[str, Any], group_size: int = 32) -> dict[str, Any]:
    """The compressed-tensors block chordq writes (Kimi's own, format.md §1.5)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "actorder": None,
                    "block_structure": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
            }
        },
        "ignore": ignore_list(config),
    }
