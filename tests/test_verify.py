"""chordq verify: good conversions pass; each broken checkpoint fails with a message naming it.

Broken checkpoints start from the ``converted`` fixture copied to tmp and are broken by
rewriting their safetensors files (tests/_broken.py). The Triton kernel runs interpreted on CPU
(TRITON_INTERPRET=1, set below before this module imports anything that imports triton), so the
compute check samples a few experts per layer except where it is the subject.

Triton reads TRITON_INTERPRET once, when *it* is first imported. If another test module imported
triton earlier in the same pytest process without the variable (compressed-tensors imports
triton), the interpreter is off for the whole process: verify then reports "Triton kernel not
run" as a warning and these tests check that warning instead of the kernel's cos_diff. Setting
TRITON_INTERPRET=1 in conftest.py (or the environment) on machines without CUDA avoids that.
"""

from __future__ import annotations

import collections
import itertools
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import _broken  # noqa: E402
import chordq.verify as verify_mod  # noqa: E402
from chordq.errors import CheckFailed, InputError  # noqa: E402
from chordq.report import format_summary  # noqa: E402
from chordq.shards import open_checkpoint, read_tensor  # noqa: E402
from chordq.verify import (  # noqa: E402
    INT4_MAX_COS_DIFF,
    KERNEL_MAX_COS_DIFF,
    VERIFY_JSON,
    _sample,
    parse_layers,
    verify_checkpoint,
)

SAMPLE = 2  # experts per layer through the MoE compute check in the broken-checkpoint tests
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton compiled on a GPU, else interpreted


def _messages(report, check: str | None = None) -> list[str]:
    return [f.message for f in report.failures if check is None or f.check == check]


def _check_kernel(report, row) -> None:
    """The Triton kernel matched the INT4 reference, or (interpreter off in this process, see the
    module docstring) verify said it could not run it."""
    if verify_mod._ensure_interpreter(torch.device(DEVICE)) is None:
        assert row["cos_diff_kernel"] <= KERNEL_MAX_COS_DIFF, format_summary(report)
    else:
        assert row["cos_diff_kernel"] is None
        assert any("Triton kernel not run" in w.message for w in report.warnings)


# --------------------------------------------------------------------------------------------
# good conversions


@pytest.mark.parametrize("flavour,experts", [("fp8", None), ("bf16", 4), ("int4", 4)])
def test_good_conversion_passes(converted, tiny, tmp_path, flavour, experts):
    report = verify_checkpoint(converted[flavour], source=tiny[flavour], experts_per_layer=experts,
                               device=DEVICE, json_path=tmp_path / VERIFY_JSON)
    assert report.passed, format_summary(report)
    report.raise_if_failed()  # no exception
    data = json.loads((tmp_path / VERIFY_JSON).read_text())
    assert data["passed"] is True and data["failures"] == []
    assert [r["layer"] for r in data["layers"]] == [1, 2]
    for row in data["layers"]:
        assert {"layer", "experts_checked", "sqnr_min_db", "sqnr_mean_db", "cos_diff", "status"} <= set(row)
        assert row["experts_checked"] == 16 and row["experts_computed"] == (experts or 16)
        assert row["cos_diff_source"] <= INT4_MAX_COS_DIFF
        _check_kernel(report, row)
    fid = data["fidelity"]
    assert fid["experts_compared"] == 96
    if flavour == "int4":  # native INT4: copied bit for bit; QAT codes never use -8
        assert fid["bit_exact"] == 96 and data["layers"][0]["sqnr_min_db"] is None
        assert data["layers"][0]["status"] == "warn" and not data["layers"][0]["code0_used"]
        assert any("code 0 (q = -8) is never used" in w["message"] and "float4e0m3" in w["message"]
                   for w in data["warnings"])
        assert fid["non_expert"]["identical"] == fid["non_expert"]["checked"]
    else:
        assert 17 < data["layers"][0]["sqnr_min_db"] < 30
        assert data["codes"]["layers"][0]["code0_used"]
        assert not [w for w in data["warnings"] if w["check"] != "compute.kernel"]
    if flavour == "fp8":
        assert fid["non_expert"]["fp8_dequantized"] > 0 and fid["non_expert"]["files"]["checked"] == 4
        assert all(r["chord_layout"] == {"w13 (gate+up)": "ok", "w2 (down)": "ok"} for r in data["compute"]["layers"])
    assert (tmp_path / "chordq_verify.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    table = format_summary(report)
    assert "PASSED" in table and "sqnr min" in table


def test_structure_only_and_layer_selection(converted, tmp_path):
    report = verify_checkpoint(converted["k25"], layers="2", experts_per_layer=1, device=DEVICE,
                               json_path=tmp_path / "v.json")
    assert report.passed, format_summary(report)
    assert [r["layer"] for r in report.layers] == [2] and report.layers[0]["sqnr_min_db"] is None
    assert report.fidelity == {"checked": False} and report.timing["source_bytes_read"] == 0
    assert parse_layers("1,3-5") == [1, 3, 4, 5]
    with pytest.raises(InputError, match="not a MoE layer"):
        verify_checkpoint(converted["k25"], layers=[0], json_path=tmp_path / "v.json")


def test_unusable_input_is_input_error(tmp_path):
    with pytest.raises(InputError) as e:
        verify_checkpoint(tmp_path / "nope")
    assert e.value.exit_code == 2
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(InputError, match="no \\*.safetensors"):
        verify_checkpoint(tmp_path / "empty")


# --------------------------------------------------------------------------------------------
# broken checkpoints: builder, verify with --source?, the failing check, words in its message

BROKEN = {
    "reversed_nibbles": (_broken.reversed_nibbles, True, "fidelity.sqnr",
                         ["layer 1 expert 3 gate_proj", "below plain RTN", "nibble order flipped"]),
    "signed_codes": (_broken.signed_codes, False, "codes.signed",
                     ["layer 2 expert 5 down_proj", "two's complement", "offset binary"]),
    "other_experts_scales": (_broken.other_experts_scales, True, "fidelity.sqnr",
                             ["layer 1 expert 6 up_proj", "below plain RTN"]),
    "missing_expert": (_broken.missing_expert, False, "structure.experts",
                       ["layer 2 expert 9 gate_proj", "weight_packed", "missing"]),
    "wrong_group_size": (_broken.wrong_group_size, False, "config.quantization",
                         ["group_size is 64", "group 32"]),
    "attention_not_ignored": (_broken.attention_not_ignored, False, "config.ignore",
                              ["does not cover model.layers.*.self_attn.q_a_proj", "vLLM"]),
    "nan_scales": (_broken.nan_scales, False, "structure.scales",
                   ["layer 1 expert 2 down_proj", "weight_scale[3, 1] = nan", "finite and non-zero"]),
    "missing_shard": (_broken.missing_shard, False, "structure.files",
                      ["model-00002-of-00003.safetensors", "listed in model.safetensors.index.json", "missing"]),
    "index_wrong_shard": (_broken.index_wrong_shard, False, "structure.index",
                          ["model.layers.1.mlp.experts.0.down_proj.weight_scale", "but it is stored in"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_fails(converted, tiny, tmp_path, case):
    build, with_source, check, needles = BROKEN[case]
    out = _broken.copy_checkpoint(converted["fp8"], tmp_path / case)
    build(out)
    report = verify_checkpoint(out, source=tiny["fp8"] if with_source else None, experts_per_layer=0, plot=False)
    assert not report.passed
    messages = _messages(report, check)
    assert messages, f"no {check} failure; got {_messages(report)}"
    assert any(all(n in m for n in needles) for m in messages), messages
    with pytest.raises(CheckFailed) as e:
        report.raise_if_failed()
    assert e.value.exit_code == 1 and "verification failed" in str(e.value)
    assert json.loads((out / VERIFY_JSON).read_text())["passed"] is False


def test_broken_layer_fails_compute_and_keeps_others(converted, tiny, tmp_path):
    """Flipped nibbles in a sampled expert also fail the MoE output check of its layer only; the
    Triton kernel still matches the INT4 reference (both read the same, wrong, words)."""
    out = _broken.copy_checkpoint(converted["fp8"], tmp_path / "flipped")
    victim = _sample(16, SAMPLE, 1)[0]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        _broken.reversed_nibbles(out, layer=1, e=victim, proj=proj)
    report = verify_checkpoint(out, source=tiny["fp8"], experts_per_layer=SAMPLE, device=DEVICE, plot=False)
    by_layer = {r["layer"]: r for r in report.layers}
    assert by_layer[1]["status"] == "fail" and by_layer[2]["status"] != "fail", format_summary(report)
    assert by_layer[1]["cos_diff_source"] > INT4_MAX_COS_DIFF
    _check_kernel(report, by_layer[1])
    assert any("layer 1: INT4 MoE output vs the source-weight MoE" in m for m in _messages(report, "compute.fidelity"))
    assert len(_messages(report, "fidelity.sqnr")) == 3
    assert report.failure_counts.keys() == {"fidelity.sqnr", "compute.fidelity"}


def test_reads_every_tensor_once_through_any_source_object(converted, tiny, tmp_path, monkeypatch):
    """Structure + fidelity stream each output tensor once and each source tensor once; a source
    is any object giving a Checkpoint (here with its own reader, as a Hub source would have)."""
    out_reads: collections.Counter = collections.Counter()
    real = verify_mod.read_tensor

    def counting(root, info):
        out_reads[info.name] += 1
        return real(root, info)

    monkeypatch.setattr(verify_mod, "read_tensor", counting)

    class FakeHubSource:
        def __init__(self, root):
            self.checkpoint = open_checkpoint(root)
            self.reads = collections.Counter()

        def read_tensor(self, info):
            self.reads[info.name] += 1
            return read_tensor(self.checkpoint.root, info)

    src, calls = FakeHubSource(tiny["fp8"]), []
    report = verify_checkpoint(converted["fp8"], source=src, experts_per_layer=0, json_path=tmp_path / "v.json",
                               plot=False, progress=lambda done, total: calls.append((done, total)))
    assert report.passed, format_summary(report)
    assert calls[-1][0] == calls[-1][1] and all(a <= b for a, b in itertools.pairwise(calls))
    assert set(src.reads) == set(src.checkpoint.tensors) and max(src.reads.values()) == 1
    out_ckpt = open_checkpoint(converted["fp8"])
    assert set(out_reads) == set(out_ckpt.tensors) and max(out_reads.values()) == 1
    assert report.timing["output_bytes_read"] == out_ckpt.total_bytes
    assert report.timing["source_bytes_read"] == src.checkpoint.total_bytes


def test_stale_report_does_not_outlive_an_unusable_rerun(converted, tmp_path):
    out = _broken.copy_checkpoint(converted["int4"], tmp_path / "out")
    assert verify_checkpoint(out, experts_per_layer=0, plot=False).passed
    assert json.loads((out / VERIFY_JSON).read_text())["passed"] is True
    (out / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="invalid JSON"):
        verify_checkpoint(out, experts_per_layer=0)
    assert not (out / VERIFY_JSON).exists()  # `chordq push` finds no stale "passed": true
