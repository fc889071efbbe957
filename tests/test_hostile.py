"""Hostile input: every case fails with a one-line message naming the file or tensor, exit != 0,
no traceback, and no config.json / index in the output."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from make_tiny_kimi import make_tiny_kimi

SHARD2 = "model-00002-of-00003.safetensors"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chordq", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.fixture
def src(tmp_path, tiny) -> Path:
    """A private copy of the tiny FP8 model to break."""
    return Path(shutil.copytree(tiny["fp8"], tmp_path / "src"))


def assert_refused(src: Path, out: Path, *needles: str, args: tuple[str, ...] = ()) -> None:
    r = run("convert", str(src), "-o", str(out), *args)
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chordq: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    if out.exists():
        assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()


def rewrite(path: Path, fn) -> None:
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_truncated_shard(src, tmp_path):
    p = src / SHARD2
    p.write_bytes(p.read_bytes()[:-1000])
    assert_refused(src, tmp_path / "o", SHARD2, "truncated")


def test_corrupt_header(src, tmp_path):
    p = src / SHARD2
    raw = bytearray(p.read_bytes())
    raw[8:12] = b"#!@$"
    p.write_bytes(bytes(raw))
    assert_refused(src, tmp_path / "o", SHARD2, "corrupt")


def test_oversized_header(src, tmp_path):
    p = src / SHARD2
    raw = bytearray(p.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    p.write_bytes(bytes(raw))
    assert_refused(src, tmp_path / "o", SHARD2, "header")


def test_index_names_missing_shard(src, tmp_path):
    (src / SHARD2).unlink()
    assert_refused(src, tmp_path / "o", SHARD2, "missing")


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_path_escapes(src, tmp_path, bad):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = bad
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(src, tmp_path / "o", "escapes")


def test_nan_in_expert(src, tmp_path):
    name = "model.layers.2.mlp.experts.3.up_proj.weight"

    def poison(t):
        w = t[name].float()
        w[1, 2] = float("nan")
        t[name] = w.to(torch.float8_e4m3fn)

    rewrite(src / "model-00003-of-00003.safetensors", poison)
    assert_refused(src, tmp_path / "o", name, "NaN")


def test_k_not_divisible_by_32(tmp_path):
    src = make_tiny_kimi(tmp_path / "src", "bf16")
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48  # down_proj K = 48

    def shrink(t):
        for name in list(t):
            if ".experts." in name:
                t[name] = (t[name][:48] if "down_proj" not in name else t[name][:, :48]).contiguous()

    for f in src.glob("*.safetensors"):
        rewrite(f, shrink)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = 0
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path / "o", "down_proj.weight", "K=48")


def test_fp8_weight_without_scale(src, tmp_path):
    name = "model.layers.1.mlp.experts.4.down_proj.weight_scale_inv"
    rewrite(src / SHARD2, lambda t: t.pop(name))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(src, tmp_path / "o", "experts.4.down_proj.weight", "weight_scale_inv")


def test_pickle_only(tmp_path):
    d = tmp_path / "pk"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.pt").write_bytes(b"\x80\x04junk")
    assert_refused(d, tmp_path / "o", "model.pt", "never unpickles")


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]", "{}"])
def test_missing_or_invalid_config(src, tmp_path, content):
    if content is None:
        (src / "config.json").unlink()
    else:
        (src / "config.json").write_text(content)
    assert_refused(src, tmp_path / "o", "config.json")


def test_no_routed_experts(tmp_path):
    d = tmp_path / "dense"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 32)}, str(d / "model.safetensors"))
    assert_refused(d, tmp_path / "o", "no routed-expert tensors")


def test_source_does_not_exist(tmp_path):
    assert_refused(tmp_path / "nowhere", tmp_path / "o", "nowhere")


def test_output_equals_source(src):
    r = run("convert", str(src), "-o", str(src))
    assert r.returncode != 0 and "source" in r.stderr and "Traceback" not in r.stderr


def test_output_holds_unrelated_files(src, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert_refused(src, out, str(out), "not made by chordq")
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


ENOSPC_SCRIPT = textwrap.dedent('''
    import sys
    from pathlib import Path
    from chordq import convert_checkpoint
    from chordq.cli import _one_line
    src, out, filler = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    seen = []
    def fill_disk(n):
        seen.append(n)
        if len(seen) == 20:  # the first shard is done: now the disk fills up
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"x" * (1 << 16))
                except OSError:
                    pass
    try:
        convert_checkpoint(src, out, progress=fill_disk)
    except BaseException as e:
        msg, code = _one_line(e)
        print(msg)
        filler.unlink()
        sys.exit(code)
''')


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_disk_fills_up_mid_run_then_resume(src, tmp_path):
    """A 12 MB tmpfs in a private mount namespace: it fills mid-run, the run stops with one line,
    and after space is freed the same command resumes and completes."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "enospc.py"
    script.write_text(ENOSPC_SCRIPT)
    out, filler = mnt / "out", mnt / "filler"
    cmd = (f"mount -t tmpfs -o size=12m tmpfs {mnt} && {sys.executable} {script} {src} {out} {filler}; "
           f"rc=$?; ls {out} > {tmp_path}/listing; "
           f"{sys.executable} -m chordq convert {src} -o {out} --json > {tmp_path}/resume.json; echo $rc $?")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=600)
    if "mount" in r.stderr and "permission" in r.stderr.lower():
        pytest.fail(f"cannot mount tmpfs in a user namespace here: {r.stderr}")
    first_rc, resume_rc = (int(x) for x in r.stdout.split()[-2:])
    message = r.stdout.strip().splitlines()[0]
    assert first_rc != 0, r.stdout
    assert "no space left" in message.lower() or "free disk space" in message, message
    listing = (tmp_path / "listing").read_text().split()
    assert "config.json" not in listing and "model.safetensors.index.json" not in listing
    assert resume_rc == 0, r.stderr
    summary = json.loads((tmp_path / "resume.json").read_text())
    assert summary["shards_skipped"] >= 1 and summary["shards_converted"] >= 1


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_preflight_refuses_when_output_cannot_fit(src, tmp_path):
    """A 2 MB tmpfs cannot hold the 5 MB output: refused before any shard is written."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = mnt / "out"
    cmd = (f"mount -t tmpfs -o size=2m tmpfs {mnt} && {sys.executable} -m chordq convert {src} -o {out}; "
           f"echo rc=$?; ls -A {out}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert "rc=2" in r.stdout, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert "chordq: error:" in line and "free disk space" in line and "Traceback" not in r.stderr
    assert ".safetensors" not in r.stdout.split("rc=2", 1)[1]
