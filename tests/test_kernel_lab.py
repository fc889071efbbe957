"""The kernel lab's generated copies of the prefill tile (scripts/kernel_lab/prefill_bounds.py)
still apply to today's kernels/gluon_prefill.py: each edit matches once and the result parses.
(Their timings need the GPU; the wide form once made here ships: test_kernels_gluon_prefill.)"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAB = Path(__file__).resolve().parent.parent / "scripts" / "kernel_lab"
sys.path.insert(0, str(LAB))

import prefill_bounds  # noqa: E402

SHIPPED = (LAB.parent.parent / "kernels" / "gluon_prefill.py").read_text()


def test_every_ablation_edits_the_shipped_tile():
    copies = prefill_bounds.copies()
    assert set(copies) == set(prefill_bounds.EDITS)
    for name, text in copies.items():
        ast.parse(text, name)
        assert text != SHIPPED.replace("from .", "from chordq.kernels."), name
