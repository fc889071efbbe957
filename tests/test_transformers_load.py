"""Real-client test: chordq's output loads in transformers (compressed-tensors) and computes what it says.

For each converted tiny model (``converted`` fixture: bf16, fp8, int4) these models are loaded with
``AutoModelForCausalLM`` on the CPU in BF16 and run on one fixed batch of token ids:

``compressed``           chordq's output as written, only ``model_type`` set to ``deepseek_v3``
                         (transformers does not know ``kimi_k2``) and ``auto_map`` dropped; loaded the
                         default way, so transformers' compressed-tensors integration reads
                         ``weight_packed`` / ``weight_scale`` / ``weight_shape`` itself.
``dequantized_at_load``  the same directory with compressed-tensors' decompress-at-load option
                         (``dequantize=True`` in 5.x, ``run_compressed=False`` in 4.x).
``dequantized_copy``     an independent plain BF16 checkpoint of the same output: tensors read with
                         ``safetensors``, words unpacked with compressed-tensors' own
                         ``unpack_from_int32`` (never chordq's layout code), ``q * scale`` rounded once
                         to BF16, no ``quantization_config``.
``original``             the source chordq converted (its FP8 blocks dequantized here, independently
                         of chordq's ``sources.py``).

The first two must equal ``dequantized_copy`` bit for bit (the INT4 checkpoint *means* exactly those
BF16 weights to a real client) and stay close to ``original`` (INT4 g32 error only; int4 sources are
copied bit for bit, so there they must be equal).

No network, no remote code: ``trust_remote_code`` is never passed, ``use_kernels=False``, and the
remote-code trap file ``configuration_deepseek.py`` stays in every directory loaded.

Which transformers (needs >= 5.13, or 4.56-4.57 with accelerate; 5.0-5.12 fail with the experts
missing). In 5.x DeepseekV3's routed experts are fused 3-D parameters (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I]), not ``nn.Linear`` modules, so compressed-tensors cannot
keep them compressed: from 5.13 on, transformers' ``CompressedTensorsDequantize`` load operation
decompresses each expert's packed tensors with compressed-tensors and the MoE weight converter
stacks them. Every other linear is in chordq's ignore list, so the loaded model is dense BF16 with
either option. In 4.5x experts are ``nn.Linear`` modules; they load compressed (holding
``weight_packed``/``weight_scale``) and compressed-tensors decompresses them in place on the first
forward.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors import safe_open
from safetensors.torch import save_file

try:  # compressed-tensors >= 0.14
    from compressed_tensors.compressors import unpack_from_int32
except ImportError:  # pragma: no cover - older compressed-tensors
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
        unpack_from_int32,
    )

try:
    from compressed_tensors.utils import match_name
except ImportError:  # pragma: no cover - older compressed-tensors: its documented semantics

    def match_name(name: str, target: str) -> bool:
        import re

        return (
            re.match(target[3:], name) is not None if target.startswith("re:") else name == target
        )

# --------------------------------------------------------------------------------------------
# criteria (measured; see the module docstring of each test for what they guard)

# compressed load vs independently dequantized BF16 copy. Measured: max |logit diff| = 0.0 for every
# flavour, both load options, transformers 4.56.2, 4.57.6, 5.13.0, 5.18.0, 5.24.0, 5.25.0. q * scale
# (q in [-8, 7], BF16 scale) is exact in float32 and rounds once to BF16, as compressed-tensors'
# decompression does, so the weights are bitwise equal and the same forward gives bitwise equal
# logits. A difference means the client reads the checkpoint otherwise than compressed-tensors'
# unpacker (expert order or gate/up order when fusing, scale broadcast, weight_shape), so: exact.
# (chordq-side layout bugs show up against the original below.)
COMPRESSED_VS_DEQUANT_MAX_ABS = 0.0

# compressed load vs the source model (bf16: the BF16 source; fp8: its FP8 blocks dequantized here).
# Cosine similarity of the flattened float32 logits and mean KL(source || int4) of the next-token
# distributions, on this fixed batch with chordq's default --method mse. These random tiny models
# amplify weight error (top-4 of 16 sigmoid routing flips experts), so INT4 g32 experts alone cost
# ~2% cosine; measured with transformers 5.24 / torch 2.13 CPU:
#   correct conversion:          bf16 cos 0.9802 KL 0.021 | fp8 cos 0.9818 KL 0.019
#   for scale: FP8-everything vs BF16 source: cos 0.9851; an independent RTN of the experts: 0.9789
#   bugs: every expert scale x1.07 (absmax/7 vs /7.5 mix-up): cos 0.969 KL 0.033; groups of 32
#   reversed: 0.62; nibble order reversed: 0.63; experts shifted by one index: 0.69; experts zero: 0.78
MIN_COSINE_VS_ORIGINAL = 0.97
MAX_KL_VS_ORIGINAL = 0.03

FLAVOURS = ("bf16", "fp8", "int4")
# Native INT4 sources are copied bit for bit, so their output computes exactly what the source does.
COPIED_FLAVOURS = {"int4"}
SEQ_LEN = 24
BATCH = 2
GROUP = 32


def _token_ids(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(20240601)
    return torch.randint(3, vocab, (BATCH, SEQ_LEN), generator=g)


# --------------------------------------------------------------------------------------------
# checkpoint rewriting (only safetensors, json and compressed-tensors; nothing from chordq)


def _hf_config(cfg: dict, *, keep_quant: bool) -> dict:
    cfg = json.loads(json.dumps(cfg))
    cfg["model_type"] = "deepseek_v3"
    cfg.pop("auto_map", None)
    if not keep_quant:
        cfg.pop("quantization_config", None)
    return cfg


def _copy_dir(src: Path, dst: Path, *, keep_quant: bool, with_weights: bool) -> dict:
    """Copy a model directory (remote-code trap included), rewriting config.json for transformers."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        weights = p.suffix == ".safetensors" or p.name.endswith(".index.json")
        if p.is_file() and p.name != "config.json" and (with_weights or not weights):
            shutil.copy2(p, dst / p.name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(_hf_config(cfg, keep_quant=keep_quant), indent=2))
    return cfg


def _read_all(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(
        {*json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()}
    )
    tensors = {}
    for file in files:
        with safe_open(str(src / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """pack-quantized INT4 g32 -> BF16, with compressed-tensors' own unpacker."""
    n, k = (int(v) for v in shape.tolist())
    q = unpack_from_int32(packed, 4, torch.Size([n, k]))  # int8 in [-8, 7]
    assert q.shape == (n, k) and scale.shape == (n, k // GROUP)
    return (q.float() * scale.float().repeat_interleave(GROUP, dim=1)).to(torch.bfloat16)


def dequantize_fp8_block(
    w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128
) -> torch.Tensor:
    """DeepSeek-V3 FP8 128x128 block weights -> BF16 (weight * scale_inv per block)."""
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (w.float() * s).to(torch.bfloat16)


def write_dequantized_copy(src: Path, dst: Path) -> Path:
    """A plain BF16 checkpoint of ``src``: INT4 triplets and FP8 blocks become BF16 ``weight``s."""
    _copy_dir(src, dst, keep_quant=False, with_weights=False)
    t = _read_all(src)
    out: dict[str, torch.Tensor] = {}
    for name, v in t.items():
        if name.endswith(".weight_packed"):
            p = name[: -len("weight_packed")]
            out[p + "weight"] = dequantize_int4(v, t[p + "weight_scale"], t[p + "weight_shape"])
        elif name.endswith(".weight_scale_inv"):
            p = name[: -len("weight_scale_inv")]
            out[p + "weight"] = dequantize_fp8_block(t[p + "weight"], v)
        elif name.endswith((".weight_scale", ".weight_shape")) or name in out:
            continue
        else:
            out[name] = v
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    # use_kernels=False: transformers >= 5.25 defaults to Hub kernels (the `kernels` package, which
    # downloads code) and refuses to load without that package; this test stays offline and local.
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, output_loading_info=True, use_kernels=False, **kwargs
    )
    bad = {k: v for k, v in info.items() if v}
    hint = ""
    if any("experts" in str(k) for k in bad.get("missing_keys", ())):
        hint = (
            f" (transformers {transformers.__version__}: 5.0-5.12 cannot load per-expert compressed-tensors"
            " weights into fused experts; use >= 5.13, or 4.56-4.57 with accelerate)"
        )
    assert not bad, f"{path}: transformers reported {bad}{hint}"
    return model.eval()


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


# --------------------------------------------------------------------------------------------
# fixtures: one set of loads per flavour, shared by the tests


def _dequantize_at_load_config():
    """compressed-tensors config asking transformers to decompress at load time."""
    import inspect

    from transformers import CompressedTensorsConfig

    if "dequantize" in inspect.signature(CompressedTensorsConfig.__init__).parameters:  # 5.x
        return CompressedTensorsConfig(dequantize=True)
    return CompressedTensorsConfig(run_compressed=False)  # 4.x


@pytest.fixture(scope="module")
def hf_runs(converted, tiny, tmp_path_factory):
    """flavour -> logits of every model on the fixed batch, plus the default-loaded compressed model."""
    root = tmp_path_factory.mktemp("hf")
    runs = {}
    for flavour in FLAVOURS:
        out_dir = root / flavour / "compressed"
        cfg = _copy_dir(converted[flavour], out_dir, keep_quant=True, with_weights=True)
        ids = _token_ids(cfg["vocab_size"])
        compressed = _load(out_dir)  # the default: what a user gets from from_pretrained
        with warnings.catch_warnings():  # "the quantization_config from the model will be used"
            warnings.simplefilter("ignore", UserWarning)
            at_load = _load(out_dir, quantization_config=_dequantize_at_load_config())
        runs[flavour] = {
            "config": cfg,
            "compressed_model": compressed,
            "compressed": _logits(compressed, ids),
            "dequantized_at_load": _logits(at_load, ids),
            "dequantized_copy": _logits(
                _load(write_dequantized_copy(converted[flavour], root / flavour / "dequantized")),
                ids,
            ),
            "original": _logits(
                _load(write_dequantized_copy(tiny[flavour], root / flavour / "original")), ids
            ),
        }
        del at_load
    return runs


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(
        a.flatten().double(), b.flatten().double(), dim=0
    ).item()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) of the next-token distributions."""
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_config_is_compressed_tensors_int4_g32(hf_runs, flavour):
    """transformers parsed chordq's block as compressed-tensors pack-quantized INT4 g32."""
    model = hf_runs[flavour]["compressed_model"]
    qc = model.config.quantization_config
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "pack-quantized"
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (
        4,
        "int",
        True,
        "group",
        32,
    )


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_ignore_list_matches_tensors(converted, flavour):
    """Every quantized module is targeted and every BF16 linear is ignored (compressed-tensors' matcher)."""
    cfg = json.loads((converted[flavour] / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    names = json.loads((converted[flavour] / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    packed = {n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")}
    linears = {
        n[: -len(".weight")]
        for n in names
        if n.endswith(("_proj.weight", "lm_head.weight"))  # nn.Linear in DeepseekV3
    }
    assert packed and linears
    assert not [m for m in packed if any(match_name(m, i) for i in ignore)], (
        "a quantized module is ignored"
    )
    unignored = [m for m in linears if not any(match_name(m, i) for i in ignore)]
    assert not unignored, (
        f"BF16 linears a compressed-tensors client would expect packed: {unignored[:5]}"
    )


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_experts_loaded_as_independent_dequant(hf_runs, converted, flavour):
    """The expert weights transformers holds are q * scale of the words chordq wrote, per expert."""
    r = hf_runs[flavour]
    model, cfg = r["compressed_model"], r["config"]
    t = _read_all(converted[flavour])
    inter = cfg["moe_intermediate_size"]
    layer = cfg["first_k_dense_replace"]
    experts = model.model.layers[layer].mlp.experts
    for e in (0, cfg["n_routed_experts"] - 1):
        ref = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            p = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
            ref[proj] = dequantize_int4(
                t[p + "weight_packed"], t[p + "weight_scale"], t[p + "weight_shape"]
            )
        if hasattr(experts, "gate_up_proj"):
            # transformers >= 5.13: fused [E, 2I, H] and [E, H, I], decompressed while loading
            got = {
                "gate_proj": experts.gate_up_proj[e, :inter],
                "up_proj": experts.gate_up_proj[e, inter:],
                "down_proj": experts.down_proj[e],
            }
        else:
            # transformers 4.5x: nn.Linear per expert. Loaded compressed (run_compressed) and
            # decompressed in place by compressed-tensors on the first forward, which has run here.
            got = {}
            for proj, w in ref.items():
                mod = getattr(experts[e], proj)
                if hasattr(mod, "weight_packed"):  # still compressed: it holds the file's words
                    p = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
                    assert torch.equal(mod.weight_packed, t[p + "weight_packed"])
                    assert torch.equal(mod.weight_scale, t[p + "weight_scale"])
                    got[proj] = w
                else:
                    got[proj] = mod.weight
        for proj, want in ref.items():
            assert got[proj].dtype == torch.bfloat16
            assert torch.equal(got[proj], want), f"layer {layer} expert {e} {proj}"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_logits_equal_dequantized_copy(hf_runs, flavour):
    r = hf_runs[flavour]
    for key in ("compressed", "dequantized_at_load"):
        diff = (r[key] - r["dequantized_copy"]).abs().max().item()
        print(f"{flavour}: {key} vs dequantized copy max|diff| = {diff:.3g}")
        assert torch.isfinite(r[key]).all()
        assert diff <= COMPRESSED_VS_DEQUANT_MAX_ABS, f"{flavour} {key}: max |logit diff| {diff}"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_logits_close_to_original(hf_runs, flavour):
    r = hf_runs[flavour]
    a, b = r["compressed"], r["original"]
    if flavour in COPIED_FLAVOURS:
        assert torch.equal(a, b), f"{flavour}: INT4 experts were not carried over unchanged"
        return
    cos = _cos(a, b)
    kl = _kl(b, a)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()  # reported only: too fragile here
    rel = ((a - b).norm() / b.norm()).item()
    print(
        f"{flavour}: vs original cos={cos:.5f} KL={kl:.4f} argmax agreement={agree:.3f} rel l2={rel:.4f}"
    )
    assert cos >= MIN_COSINE_VS_ORIGINAL, f"{flavour}: logit cosine vs the source {cos:.5f}"
    assert kl <= MAX_KL_VS_ORIGINAL, f"{flavour}: KL(source || int4) {kl:.4f}"
    assert not torch.equal(a, b)  # the experts really were quantized
