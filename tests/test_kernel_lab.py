"""The kernel lab's generated copies of the prefill tile (scripts/kernel_lab/prefill_bounds.py,
prefill_wide.py) still apply to today's kernels/gluon_prefill.py: each edit matches once, and
the wide form builds for sm_90 within an SM's shared memory. (Their timings need the GPU.)"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parent.parent / "scripts" / "kernel_lab"
sys.path.insert(0, str(LAB))

import prefill_bounds  # noqa: E402
import prefill_wide  # noqa: E402

SHIPPED = (LAB.parent.parent / "kernels" / "gluon_prefill.py").read_text()
SMEM_PER_BLOCK = 232448  # sm_90: the most shared memory one block can take


def test_every_ablation_edits_the_shipped_tile():
    copies = prefill_bounds.copies()
    assert set(copies) == set(prefill_bounds.EDITS)
    for name, text in copies.items():
        ast.parse(text, name)
        assert text != SHIPPED.replace("from .", "from chordq.kernels."), name


def test_wide_tile_builds_for_sm90_within_shared_memory(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    path = tmp_path / "gluon_prefill_wide.py"
    path.write_text(prefill_wide.source())
    spec = importlib.util.spec_from_file_location("gluon_prefill_wide_lab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernel = mod.compile_sm90(block_m=64, num_stages=prefill_wide.WIDE_STAGES)
    assert kernel.metadata.shared <= SMEM_PER_BLOCK
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in kernel.asm["ptx"]
    wider = mod.compile_sm90(block_m=64, num_stages=prefill_wide.WIDE_STAGES + 1)
    assert wider.metadata.shared > SMEM_PER_BLOCK  # why WIDE_STAGES is the most
