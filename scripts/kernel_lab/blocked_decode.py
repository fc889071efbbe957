"""Variant 46 (lab): the 8-row Gluon decode tile on row-blocked words and scales.

Why: the decode tile streams its weights at 88-89% of the bandwidth floor against Humming's
94% (docs/performance.md §19). Each K step of a 128-row tile reads 128 B from each of 128
rows that lie K/2 bytes apart (the words' natural ``[E, N, K/8]`` order), so HBM sees 128-byte
pieces scattered over 128 pages per step; Humming's repacked weights are read tile by tile.
Here the words are ``[E, N/128, K/256, 128, 32]`` (and the scales ``[.., 128, 8]``), so one step
of a 128-row tile is one contiguous 16 KB piece (8 KB a half with SiLU-and-mul).

The tile is the shipped ``moe_gemm_indexed_gluon`` with ``blocked=True`` (the lab ran a copy
with the blocked pointer arithmetic before it shipped), timed against the same tile on the
unblocked words and Humming in one process: ``OUT=/tmp/lab GLUON_HUMMING=.whl [GLUON_T="8 20"] [BLK_SMEM="128,4,2 ..."] python
scripts/kernel_lab/blocked_decode.py`` (tiles ``BN,warps,stages``; fused SiLU-and-mul too).
"""

from __future__ import annotations

import os
import sys


ROWS = ([("EP8", "gate_up", t) for t in (8, 20, 32)] + [("EP8", "down", t) for t in (8, 32)]
        + [("TP8", "gate_up", t) for t in (8, 20, 32, 128)]
        + [("TP8", "down", t) for t in (20, 128)])
TILES = [tuple(int(v) for v in t.split(",")) for t in os.environ.get(
    "BLK_SMEM", "128,4,2 128,4,3").split()]


def gpu_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contest

    def contestants(c, add):
        wb, sb = c.extra
        for bn, warps, stages in TILES:
            for gated in (False, True) if c.proj == "gate_up" else (False,):
                act = "silu_mul" if gated else None
                for name, blk, w, s in (("smem", False, c.wf, c.sf), ("blk", True, wb, sb)):
                    add(f"{name} {bn}x{warps} s{stages}" + (" fused" if gated else ""), 8,
                        contest.gluon_decode(c, w, s, block_n=bn, num_warps=warps,
                                             num_stages=stages, gated=gated, blocked=blk),
                        act=act)

    contest.run(ROWS, os.environ.get("GLUON_T", ""),
                os.path.join(os.environ.get("OUT", "/tmp/lab"), "blocked_decode.json"),
                contestants, extra_weights=contest.blocked_weights)


if __name__ == "__main__":
    gpu_main()
