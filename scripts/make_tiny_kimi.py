"""Write deterministic tiny Kimi K2.x checkpoints in every source flavour chordq reads.

Real K2 config fields and tensor names, tiny sizes (``kv_lora_rank`` 512 and
``qk_rope_head_dim`` 64 kept so real engines can run them). Every flavour is derived from the
same underlying BF16 weights, so conversions of different flavours are comparable.

Flavours
  bf16   BF16 mirror (no quantization_config)
  fp8    Kimi-K2-Instruct style: FP8 e4m3 128x128 block weights + weight_scale_inv for every
         linear but lm_head / router; several shards, some scales in another shard than their weight
  int4   Kimi-K2-Thinking style: compressed-tensors pack-quantized INT4 g32 experts with QAT-like
         codes in [-7, 7] (scale = absmax / 7), everything else BF16
  k25    Kimi-K2.5 style: nested text_config (+ INT4 experts), vision tower and projector,
         ``language_model.model.`` prefix

Usage: python scripts/make_tiny_kimi.py OUT_DIR --flavour fp8   (or --all OUT_ROOT)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

# chordq without installing it, but behind site-packages: the checkout's top-level kernels/
# (installed as chordq.kernels) must not shadow Hugging Face's `kernels`, which transformers
# >= 5.25 imports
sys.path.append(str(Path(__file__).resolve().parent.parent))
from chordq.layout import pack_int4  # noqa: E402

FLAVOURS = ("bf16", "fp8", "int4", "k25")

TINY_TEXT_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "model_type": "kimi_k2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 512,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 64,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": 1024,
}

FP8_QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

INT4_QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": 32, "dynamic": False, "actorder": None, "block_structure": None,
                "observer": "minmax", "observer_kwargs": {},
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}

TINY_VISION_CONFIG = {"model_type": "moonvit", "hidden_size": 64, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "intermediate_size": 128, "patch_size": 14,
                      "merge_kernel_size": [2, 2]}

REMOTE_CODE_TRAP = '''"""Stand-in for Kimi's remote code. chordq copies this file and must never import or run it."""
raise RuntimeError("remote code was executed")
'''


def _rand(name: str, shape: tuple[int, ...], std: float, heavy: bool = False) -> torch.Tensor:
    """Deterministic per-name weights; heavy-tailed (Student-t, df 4) for linear weights."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if heavy:
        # Student-t (df 4) = normal / sqrt(chi2_4 / 4); chi2 from 4 squared normals.
        z = torch.randn(shape, generator=g, dtype=torch.float64)
        c = sum(torch.randn(shape, generator=g, dtype=torch.float64) ** 2 for _ in range(4)) / 4
        t = z / c.sqrt()
        return (t * std / math.sqrt(2.0)).clamp(-20 * std, 20 * std).to(torch.bfloat16)
    return (torch.randn(shape, generator=g) * std).to(torch.bfloat16)


def bf16_text_weights(cfg: dict, prefix: str = "model.", lm_head: str = "lm_head.weight") -> dict[str, torch.Tensor]:
    """The BF16 master weights of the text model, real K2 tensor names."""
    h, inter, mi = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    heads, nope, rope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr, vocab, ne = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["vocab_size"], cfg["n_routed_experts"]
    t: dict[str, torch.Tensor] = {}

    def lin(name: str, n: int, k: int) -> None:
        t[name] = _rand(name, (n, k), 1.0 / math.sqrt(k), heavy=True)

    def norm(name: str, n: int) -> None:
        t[name] = (1.0 + 0.1 * _rand(name, (n,), 1.0).float()).to(torch.bfloat16)

    t[f"{prefix}embed_tokens.weight"] = _rand(f"{prefix}embed_tokens.weight", (vocab, h), 1.0)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{layer}."
        norm(p + "input_layernorm.weight", h)
        norm(p + "post_attention_layernorm.weight", h)
        a = p + "self_attn."
        lin(a + "q_a_proj.weight", qr, h)
        norm(a + "q_a_layernorm.weight", qr)
        lin(a + "q_b_proj.weight", heads * (nope + rope), qr)
        lin(a + "kv_a_proj_with_mqa.weight", kvr + rope, h)
        norm(a + "kv_a_layernorm.weight", kvr)
        lin(a + "kv_b_proj.weight", heads * (nope + v), kvr)
        lin(a + "o_proj.weight", h, heads * v)
        m = p + "mlp."
        if layer < cfg["first_k_dense_replace"]:
            lin(m + "gate_proj.weight", inter, h)
            lin(m + "up_proj.weight", inter, h)
            lin(m + "down_proj.weight", h, inter)
            continue
        t[m + "gate.weight"] = _rand(m + "gate.weight", (ne, h), 1.0 / math.sqrt(h))
        t[m + "gate.e_score_correction_bias"] = _rand(m + "gate.e_score_correction_bias", (ne,), 0.01).float()
        shared = mi * cfg["n_shared_experts"]
        lin(m + "shared_experts.gate_proj.weight", shared, h)
        lin(m + "shared_experts.up_proj.weight", shared, h)
        lin(m + "shared_experts.down_proj.weight", h, shared)
        for e in range(ne):
            lin(f"{m}experts.{e}.gate_proj.weight", mi, h)
            lin(f"{m}experts.{e}.up_proj.weight", mi, h)
            lin(f"{m}experts.{e}.down_proj.weight", h, mi)
    norm(f"{prefix}norm.weight", h)
    t[lm_head] = _rand(lm_head, (vocab, h), 1.0 / math.sqrt(h))
    return t


def fp8_block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 style: per 128x128 block, scale_inv = amax / 448, fp8 = w / scale_inv."""
    n, k = w.shape
    bn, bk = math.ceil(n / block), math.ceil(k / block)
    wp = torch.zeros(bn * block, bk * block)
    wp[:n, :k] = w.float()
    blocks = wp.reshape(bn, block, bk, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = (amax / 448.0).float()
    q = (blocks / scale_inv[:, None, :, None]).reshape(bn * block, bk * block)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale_inv


def int4_qat(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Kimi-QAT-like INT4: scale = absmax / 7 (BF16), codes in [-7, 7]."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    scale = (g.abs().amax(-1) / 7.0).to(torch.bfloat16)
    scale = torch.where(scale == 0, torch.full_like(scale, 2**-7), scale)
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -7, 7).to(torch.int8).reshape(n, k)
    return {"weight_packed": pack_int4(q), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}


def _is_fp8_linear(name: str) -> bool:
    # K2-Instruct keeps embeddings, norms, the router and lm_head in BF16.
    return name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _shard_of(name: str, n_layers: int, shards: int) -> int:
    if ".layers." not in name:
        return 0 if "embed_tokens" in name else shards - 1
    layer = int(name.split(".layers.")[1].split(".")[0])
    return min(shards - 1, layer * shards // n_layers)


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], shards: int, n_layers: int, moves: dict[str, int]) -> None:
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    for name in sorted(tensors):
        idx = moves.get(name, _shard_of(name, n_layers, shards)) if shards > 1 else 0
        groups[idx][name] = tensors[name].contiguous()
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(group, str(out / file), metadata={"format": "pt"})
        for name, t in group.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _common_files(out: Path, cfg: dict) -> None:
    (out / "configuration_deepseek.py").write_text(REMOTE_CODE_TRAP)
    gen = {"bos_token_id": cfg.get("bos_token_id", 1), "eos_token_id": cfg.get("eos_token_id", 2), "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096, "tokenizer_class": "TikTokenTokenizer"}, indent=2) + "\n")
    (out / "README.md").write_text("---\nlicense: other\nlicense_name: modified-mit\n---\n# tiny Kimi K2.x test model\n")


def make_tiny_kimi(out: str | Path, flavour: str = "fp8", *, shards: int = 3, num_layers: int = 3, num_experts: int = 16) -> Path:
    """Write one tiny checkpoint; returns its directory. Deterministic byte for byte."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = copy.deepcopy(TINY_TEXT_CONFIG)
    text["num_hidden_layers"], text["n_routed_experts"] = num_layers, num_experts
    nested = flavour == "k25"
    prefix = "language_model.model." if nested else "model."
    master = bf16_text_weights(text, prefix, "language_model.lm_head.weight" if nested else "lm_head.weight")
    tensors: dict[str, torch.Tensor] = {}
    moves: dict[str, int] = {}
    if flavour == "bf16":
        tensors = master
    elif flavour == "fp8":
        text["quantization_config"] = FP8_QUANT_CONFIG
        for name, w in master.items():
            if _is_fp8_linear(name):
                q, s = fp8_block_quantize(w)
                tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, s
            else:
                tensors[name] = w
        # Real FP8 releases split a weight from its scale across shards; so does this one.
        if shards > 1:
            moves[f"{prefix}layers.1.mlp.experts.0.gate_proj.weight_scale_inv"] = shards - 1
            moves[f"{prefix}layers.{num_layers - 1}.self_attn.o_proj.weight_scale_inv"] = 0
    else:
        for name, w in master.items():
            if _is_expert(name):
                for suffix, t in int4_qat(w).items():
                    tensors[name[: -len("weight")] + suffix] = t
            else:
                tensors[name] = w
        qc = copy.deepcopy(INT4_QUANT_CONFIG)
        if nested:
            qc["ignore"] += ["re:.*vision_tower.*", "re:.*mm_projector.*"]
        text["quantization_config"] = qc
    if nested:
        for name, shape in {
            "vision_tower.patch_embed.proj.weight": (64, 3, 14, 14),
            "vision_tower.encoder.blocks.0.attn.qkv.weight": (192, 64),
            "vision_tower.encoder.blocks.0.mlp.fc0.weight": (128, 64),
            "vision_tower.encoder.final_layernorm.weight": (64,),
            "mm_projector.pre_norm.weight": (256,),
            "mm_projector.proj.0.weight": (256, 256),
            "mm_projector.proj.2.weight": (256, 256),
        }.items():
            tensors[name] = _rand(name, shape, 0.05)
        config = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                         "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
            "model_type": "kimi_k25",
            "media_placeholder_token_id": 1000,
            "text_config": text,
            "vision_config": TINY_VISION_CONFIG,
            "torch_dtype": "bfloat16",
        }
    else:
        config = text
    _write_shards(out, tensors, shards, num_layers, moves)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _common_files(out, text)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--flavour", choices=FLAVOURS, default="fp8")
    ap.add_argument("--all", action="store_true", help="write every flavour into OUT/tiny-kimi-<flavour>")
    ap.add_argument("--shards", type=int, default=3)
    a = ap.parse_args(argv)
    for flavour in FLAVOURS if a.all else (a.flavour,):
        path = a.out / f"tiny-kimi-{flavour}" if a.all else a.out
        make_tiny_kimi(path, flavour, shards=a.shards)
        print(path)


if __name__ == "__main__":
    main()
