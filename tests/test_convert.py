"""`convert_checkpoint` end to end on every tiny flavour, read back with safetensors itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open

from chordq import ConvertOptions, OutputError, convert_checkpoint
from chordq.layout import unpack_int4
from chordq.models import parse_expert
from chordq.quant import dequantize, quantize, sqnr_db
from chordq.sources import dequant_fp8_block

# 4-bit group-32 of the tiny models' heavy-tailed weights measures ~18.5 dB mean.
EXPERT_SQNR_FLOOR_DB = 17.0


def load_all(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == file, name
                out[name] = f.get_tensor(name)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def quant_config(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    return (cfg.get("text_config") or cfg)["quantization_config"]


@pytest.mark.parametrize("flavour", ["bf16", "fp8", "int4", "k25"])
def test_output_structure(flavour, tiny, converted):
    out = load_all(converted[flavour])
    qc = quant_config(converted[flavour])
    QuantizationConfig.model_validate(qc)
    assert qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (4, 32, True, "group")
    prefix = "language_model.model." if flavour == "k25" else "model."
    experts = {}
    for name, t in out.items():
        parsed = parse_expert(name)
        if parsed:
            assert parsed[0].prefix == prefix
            experts.setdefault(parsed[0], {})[parsed[1]] = t
    assert len(experts) == 2 * 16 * 3
    for ex, ts in experts.items():
        assert set(ts) == {"weight_packed", "weight_scale", "weight_shape"}, ex
        n, k = (256, 64) if ex.proj == "down_proj" else (64, 256)
        assert ts["weight_packed"].dtype == torch.int32 and ts["weight_packed"].shape == (n, k // 8)
        assert ts["weight_scale"].dtype == torch.bfloat16 and ts["weight_scale"].shape == (n, k // 32)
        assert ts["weight_shape"].tolist() == [n, k]
    assert not any(name.endswith("weight_scale_inv") for name in out)
    for f in ("configuration_deepseek.py", "generation_config.json", "tokenizer_config.json"):
        assert (converted[flavour] / f).read_bytes() == (tiny[flavour] / f).read_bytes()


def test_fp8_experts_and_linears(tiny, converted):
    src, out = load_all(tiny["fp8"]), load_all(converted["fp8"])
    worst = 99.0
    for name, t in src.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            ref = dequant_fp8_block(t, src[name[: -len("weight")] + "weight_scale_inv"])
            parsed = parse_expert(name)
            if parsed is None:  # non-expert FP8 linear -> exact BF16 dequantization
                assert out[name].dtype == torch.bfloat16
                assert torch.equal(out[name], ref.to(torch.bfloat16)), name
                continue
            p = name[: -len("weight")]
            deq = dequantize(unpack_int4(out[p + "weight_packed"]), out[p + "weight_scale"])
            worst = min(worst, sqnr_db(ref, deq))
            # the mse result is never worse than plain rtn of the same source tensor
            assert sqnr_db(ref, deq) >= sqnr_db(ref, dequantize(*quantize(ref, "rtn"))) - 1e-9
        else:
            assert torch.equal(out[name], t), name
    assert worst > EXPERT_SQNR_FLOOR_DB


def test_native_int4_is_copied_bit_for_bit(tiny, converted):
    for flavour in ("int4", "k25"):
        src, out = load_all(tiny[flavour]), load_all(converted[flavour])
        assert set(src) == set(out)
        for name, t in src.items():
            assert out[name].dtype == t.dtype
            assert torch.equal(out[name].view(torch.uint8) if t.dtype.itemsize > 1 else out[name],
                               t.view(torch.uint8) if t.dtype.itemsize > 1 else t), name
        src_cfg = json.loads((tiny[flavour] / "config.json").read_text())
        assert json.loads((converted[flavour] / "config.json").read_text()) == src_cfg


def test_k25_keeps_nesting_and_vision(converted):
    cfg = json.loads((converted["k25"] / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and "quantization_config" not in cfg
    assert cfg["text_config"]["quantization_config"]["format"] == "pack-quantized"
    out = load_all(converted["k25"])
    assert any(n.startswith("vision_tower.") for n in out)
    assert "mm_projector.proj.0.weight" in out and "language_model.lm_head.weight" in out


def test_bf16_rtn_is_deterministic_quantize(tiny, tmp_path):
    res = convert_checkpoint(tiny["bf16"], tmp_path / "o", ConvertOptions(method="rtn"))
    src, out = load_all(tiny["bf16"]), load_all(res.output)
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    q, s = quantize(src[name].float(), "rtn")
    p = name[: -len("weight")]
    assert torch.equal(unpack_int4(out[p + "weight_packed"]), q)
    assert torch.equal(out[p + "weight_scale"], s)
    assert "quantization_config" in json.loads((res.output / "config.json").read_text())


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "chordq_manifest.json"}


def test_resume_after_crash_is_byte_identical(tiny, converted, tmp_path):
    out = tmp_path / "o"
    seen = []

    def crash_midway(n):
        seen.append(n)
        if len(seen) == 30:  # inside the second shard
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tiny["fp8"], out, progress=crash_midway)
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    manifest = json.loads((out / "chordq_manifest.json").read_text())
    assert len(manifest["shards"]) == 1 and not manifest["complete"]
    assert not list(out.glob("*.chordq-tmp"))
    res = convert_checkpoint(tiny["fp8"], out)
    assert res.shards_skipped == 1 and res.shards_converted == 2
    assert _files(out) == _files(converted["fp8"])


def test_refuses_foreign_or_source_output(tiny, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="not made by chordq"):
        convert_checkpoint(tiny["bf16"], foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    with pytest.raises(OutputError, match="source"):
        convert_checkpoint(tiny["bf16"], tiny["bf16"])


def test_option_mismatch_needs_overwrite(tiny, tmp_path):
    out = tmp_path / "o"
    convert_checkpoint(tiny["bf16"], out, ConvertOptions(method="rtn"))
    with pytest.raises(OutputError, match="--overwrite"):
        convert_checkpoint(tiny["bf16"], out, ConvertOptions(method="mse"))
    res = convert_checkpoint(tiny["bf16"], out, ConvertOptions(method="mse", overwrite=True))
    assert res.shards_converted == 3


def test_two_workers_write_the_same_bytes(tiny, converted, tmp_path):
    """Several CPU worker processes stand in for several GPUs: same bytes as one worker."""
    res = convert_checkpoint(tiny["fp8"], tmp_path / "o", ConvertOptions(workers=2, device="cpu"))
    assert res.workers == 2 and res.shards_converted == 3
    assert _files(res.output) == _files(converted["fp8"])


def test_kill_9_then_resume_is_byte_identical(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from make_tiny_kimi import make_tiny_kimi

    src = make_tiny_kimi(tmp_path / "src", "bf16", shards=6, num_layers=6, num_experts=32)
    ref = convert_checkpoint(src, tmp_path / "ref").output
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "chordq", "convert", str(src), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = out / "chordq_manifest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and len(json.loads(manifest.read_text() or "{}").get("shards", {})) >= 1:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "conversion finished before it could be killed; make the model larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "config.json").exists()
    res = convert_checkpoint(src, out)
    assert res.shards_skipped >= 1
    assert _files(out) == _files(ref)
    assert not list(out.glob("*.chordq-tmp"))
