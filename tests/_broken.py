"""Builders of broken checkpoints: copy a good chordq output, then break one thing in it.

Each builder takes the directory of a copy and rewrites its safetensors files / JSON in place
(with safetensors' own writer, keeping the index consistent unless the index is what breaks),
and returns what it broke, so a test can look for it in verify's messages.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("chordq_verify.*"))
    return dst


def expert(layer: int, e: int, proj: str, suffix: str, prefix: str = "model.") -> str:
    return f"{prefix}layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"


def _index(root: Path) -> dict:
    return json.loads((root / INDEX).read_text())


def _write_index(root: Path, index: dict) -> None:
    (root / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def shard_of(root: Path, name: str) -> str:
    return _index(root)["weight_map"][name]


def edit_shard(root: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load one shard, let ``edit`` change the dict, write it back; re-derive the index entries
    of that shard and ``total_size``."""
    tensors = load_file(str(root / shard))
    edit(tensors)
    save_file(tensors, str(root / shard), metadata={"format": "pt"})
    index = _index(root)
    wm = {k: v for k, v in index["weight_map"].items() if v != shard}
    wm.update({k: shard for k in tensors})
    index["weight_map"] = dict(sorted(wm.items()))
    total = 0
    for file in sorted(set(wm.values())):
        total += sum(t.numel() * t.element_size() for t in load_file(str(root / file)).values())
    index["metadata"]["total_size"] = total
    _write_index(root, index)


def edit_tensor(root: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> str:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = fn(tensors[name]).contiguous()

    edit_shard(root, shard_of(root, name), edit)
    return name


def _codes(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & 0xF  # [..., K/8, 8], nibble j = k 8w+j


def _words(codes: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (codes.to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# the breakages


def reversed_nibbles(root: Path, layer: int = 1, e: int = 3, proj: str = "gate_proj") -> str:
    """Nibble order within every word of one expert tensor flipped (k = 8w in the top nibble)."""
    return edit_tensor(
        root, expert(layer, e, proj, "weight_packed"), lambda w: _words(_codes(w).flip(-1))
    )


def signed_codes(root: Path, layer: int = 2, e: int = 5, proj: str = "down_proj") -> str:
    """Two's-complement nibbles (q & 0xF) instead of offset binary (q + 8): code ^ 8."""
    return edit_tensor(
        root, expert(layer, e, proj, "weight_packed"), lambda w: _words(_codes(w) ^ 8)
    )


def other_experts_scales(
    root: Path, layer: int = 1, e: int = 6, other: int = 7, proj: str = "up_proj"
) -> str:
    """Expert ``e`` carries expert ``other``'s weight_scale."""
    donor = load_file(str(root / shard_of(root, expert(layer, other, proj, "weight_scale"))))[
        expert(layer, other, proj, "weight_scale")
    ]
    return edit_tensor(root, expert(layer, e, proj, "weight_scale"), lambda s: donor.clone())


def missing_expert(root: Path, layer: int = 2, e: int = 9) -> str:
    """Every tensor of one routed expert removed (index kept consistent)."""
    names = [
        expert(layer, e, p, s)
        for p in ("gate_proj", "up_proj", "down_proj")
        for s in ("weight_packed", "weight_scale", "weight_shape")
    ]

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for n in names:
            tensors.pop(n)

    edit_shard(root, shard_of(root, names[0]), edit)
    return f"layers.{layer}.mlp.experts.{e}."


def _edit_quant_config(root: Path, fn: Callable[[dict], None]) -> None:
    config = json.loads((root / "config.json").read_text())
    qc = config.get("quantization_config") or config["text_config"]["quantization_config"]
    fn(qc)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def wrong_group_size(root: Path, group_size: int = 64) -> str:
    """config.json claims group_size 64; the scales are [N, K/32]."""
    _edit_quant_config(
        root, lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=group_size)
    )
    return "group_size"


def attention_not_ignored(root: Path, pattern: str = "re:.*self_attn.*") -> str:
    """The ignore list loses its attention pattern, so vLLM would quantize attention."""
    _edit_quant_config(root, lambda qc: qc["ignore"].remove(pattern))
    return "self_attn"


def nan_scales(root: Path, layer: int = 1, e: int = 2, proj: str = "down_proj") -> str:
    def fn(s: torch.Tensor) -> torch.Tensor:
        s = s.clone()
        s[3, 1] = float("nan")
        return s

    return edit_tensor(root, expert(layer, e, proj, "weight_scale"), fn)


def missing_shard(root: Path, shard: str = "model-00002-of-00003.safetensors") -> str:
    (root / shard).unlink()
    return shard


def index_wrong_shard(root: Path, name: str | None = None) -> str:
    """The index points one tensor at a shard that does not hold it."""
    index = _index(root)
    name = name or expert(1, 0, "down_proj", "weight_scale")
    here = index["weight_map"][name]
    index["weight_map"][name] = next(
        f for f in sorted(set(index["weight_map"].values())) if f != here
    )
    _write_index(root, index)
    return name
