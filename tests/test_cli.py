"""The CLI as a user runs it: help with examples, one-line errors, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def chordq(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chordq", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.mark.parametrize("cmd", [[], ["convert"], ["inspect"]])
def test_help_shows_examples(cmd):
    r = chordq(*cmd, "--help")
    assert r.returncode == 0
    assert "Examples:" in r.stdout and "$ chordq " in r.stdout


def test_convert_then_inspect_json(tiny, tmp_path):
    out = tmp_path / "out"
    r = chordq("convert", str(tiny["fp8"]), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["source_format"] == "fp8-block" and summary["tensors_quantized"] == 96
    assert summary["sqnr_mean_db"] > 17
    r = chordq("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["source_format"] == "int4-ct" and info["plan"]["quantize"] == 0


def _assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chordq: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_source(tmp_path):
    _assert_one_line_error(chordq("convert", str(tmp_path / "nope"), "-o", str(tmp_path / "o")), "nope")


def test_pickle_only_checkpoint_is_refused(tmp_path):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    _assert_one_line_error(chordq("inspect", str(src)), "pytorch_model.bin", "never unpickles")


def test_unknown_model(tmp_path, tiny):
    src = tmp_path / "dense"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    from safetensors.torch import save_file
    import torch

    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 32)}, str(src / "model.safetensors"))
    _assert_one_line_error(chordq("convert", str(src), "-o", str(tmp_path / "o")), "no routed-expert tensors")
    assert not (tmp_path / "o").exists()


def test_debug_shows_traceback(tmp_path):
    r = chordq("inspect", str(tmp_path / "nope"), env={"CHORDQ_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_bench_needs_a_gpu_or_runs():
    import torch

    r = chordq("bench", "--tokens", "1", "--quick")
    if torch.cuda.is_available():
        assert r.returncode == 0, r.stderr
    else:
        _assert_one_line_error(r, "CUDA")
