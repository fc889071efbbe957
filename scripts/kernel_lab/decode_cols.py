"""Variant 48 (lab): the 8-row Gluon decode tile looping over column tiles, for TP8 down.

Why: TP8 down has K = 256, one 256-deep step per tile, so the decode tile's copy ring has
nothing to overlap inside a program and every one of a block's 56 column tiles copies the
block's X rows again. Run O (H100) had these rows at 1.07-1.14 of Humming at T=128-512. The
column-looping form (``moe_gemm_indexed_gluon(.., n_tiles=L)``) copies X once per program and
keeps ``stages - 1`` column tiles' words in flight, as variant 12 did for the Triton tiles.

Timed against the shipped 8-row tile (``L1``), the Triton tiles and Humming in one process:
``OUT=/tmp/lab GLUON_HUMMING=.whl [GLUON_T="20 128"] [COLS="1,2 7,2 7,3"] python3
scripts/kernel_lab/decode_cols.py`` (``n_tiles,stages`` pairs; 128-row column tiles, 4 warps).
"""

from __future__ import annotations

import os
import sys

ROWS = [("TP8", "down", t) for t in (1, 8, 20, 32, 128, 256, 512)]
COLS = [tuple(int(v) for v in c.split(",")) for c in os.environ.get(
    "COLS", "1,2 2,2 4,2 7,2 14,2 4,3 7,3 14,3").split()]


def gpu_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contest

    def contestants(c, add):
        for n_tiles, stages in COLS:
            add(f"L{n_tiles} s{stages}", 8, contest.gluon_decode(
                c, c.wf, c.sf, block_n=128, num_warps=4, num_stages=stages, gated=False,
                blocked=False, n_tiles=n_tiles))

    contest.run(ROWS, os.environ.get("GLUON_T", ""),
                os.path.join(os.environ.get("OUT", "/tmp/lab"), "decode_cols.json"),
                contestants)


if __name__ == "__main__":
    gpu_main()
