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


def _language_namespaces() -> list:
    try:
        import triton.language as tl
    except ImportError:
        return []
    try:  # Gluon wraps triton.language.core's builtins when first imported: let it wrap these
        import chordq.kernels.gluon_prefill  # noqa: F401 - and the Gluon modules it imports
    except ImportError:
        pass
    core = tl.core
    return [tl, core, tl.math, core.tensor, core.condition, core.dtype,
            core.tensor_descriptor_base]


# Triton's interpreter (3.9, runtime/interpreter.py: InterpretedFunction.__call__) patches
# triton.language.core's builtins whenever an interpreted kernel calls one of Triton's own @jit
# helpers (tl.cdiv, tl.sum, ...), and never restores them. Interpreted launches repatch what they
# need, but a real compile later in the same process (the sm_90 build tests) then lowers through
# the interpreter's builder and fails, as does Gluon if first imported after such a kernel (it
# keeps the builtins it wraps). Taken before any kernel runs, restored after every test.
_PRISTINE = [(ns, dict(vars(ns))) for ns in _language_namespaces()]


@pytest.fixture(autouse=True)
def _pristine_triton_language():
    yield
    for ns, attrs in _PRISTINE:
        for name, value in attrs.items():
            if vars(ns).get(name) is not value:
                setattr(ns, name, value)


@pytest.fixture
def fresh_triton_cache(tmp_path, monkeypatch):
    """Compile for real instead of loading an earlier run's cubin, as on a fresh CI machine."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
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
