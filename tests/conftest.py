"""Shared fixtures: tiny Kimi K2.x checkpoints built by scripts/make_tiny_kimi.py (no downloads)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported (compressed-tensors imports it
# during collection): without a GPU, every Triton kernel in the suite runs interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent

# The repo root holds kernels/ (installed as chordq.kernels). With the root on sys.path
# (`python -m pytest`, PYTHONPATH=$PWD) that directory shadows the Hugging Face `kernels`
# package, which transformers >= 5.25 imports when compressed-tensors loads it, and the import
# fails. Import the installed package first, without the root, so that sys.modules holds it.
_saved_path = list(sys.path)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
try:
    import kernels  # noqa: F401
except ImportError:  # not installed: nothing to shadow
    pass
finally:
    sys.path[:] = _saved_path

sys.path.insert(0, str(REPO / "scripts"))

from make_tiny_kimi import FLAVOURS, make_tiny_kimi  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """One tiny source checkpoint per flavour: bf16, fp8, int4, k25."""
    root = tmp_path_factory.mktemp("tiny-src")
    return {f: make_tiny_kimi(root / f, f) for f in FLAVOURS}


@pytest.fixture(scope="session")
def converted(tiny, tmp_path_factory) -> dict[str, Path]:
    """Each tiny flavour converted once with the default options."""
    from chordq import convert_checkpoint

    root = tmp_path_factory.mktemp("tiny-out")
    return {f: convert_checkpoint(src, root / f).output for f, src in tiny.items()}


# Triton's interpreter (3.9, runtime/interpreter.py: InterpretedFunction.__call__) patches
# triton.language.core's builtins whenever an interpreted kernel calls one of Triton's own @jit
# helpers (tl.cdiv, tl.sum, ...), and never restores them; Triton first imports Gluon inside such
# a launch, and Gluon keeps the builtins it wraps. Interpreted launches repatch what they need,
# but a real compile afterwards (the sm_90 build tests) lowers through the interpreter's builder
# and fails. So Gluon is imported, and the namespaces are taken, before any kernel runs.
try:
    import triton.language as tl

    import chordq.kernels.gluon_prefill  # noqa: F401 - and the Gluon modules it imports
except ImportError:  # no Triton, or one without Gluon: nothing compiles for sm_90 here
    tl = None
_PRISTINE = [] if tl is None else [
    (ns, dict(vars(ns))) for ns in (tl, tl.core, tl.math, tl.core.tensor, tl.core.condition,
                                    tl.core.dtype, tl.core.tensor_descriptor_base)]


@pytest.fixture
def real_triton_compile(tmp_path, monkeypatch):
    """For a test that compiles for real in this (interpreting) process: triton.language as it
    was before any kernel ran, and an empty cache, so the compile runs as on a fresh CI machine
    instead of loading an earlier run's cubin."""
    for ns, attrs in _PRISTINE:
        for name, value in attrs.items():
            if vars(ns).get(name) is not value:
                setattr(ns, name, value)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
