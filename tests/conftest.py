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
