"""Variant 49 (lab): the Gluon ``mma.sync`` decode tile on 16- and 32-row blocks.

Why: at 10-21 rows per expert (EP8 T=128, TP8 T=512-1024) the shipped tiles are Triton's
32-row wgmma tile (EP8 T=128 down 1.01-1.04 of Humming, TP8 gate_up T=1024 1.02) or 8-row
Gluon blocks, two or three an expert, each of which dequantizes the expert's weights again.
With ``block_m`` 16 or 32 the Gluon tile dequantizes once per block and issues 2 or 4
``HMMA.16816`` per slice (the token rows past 8 are further n8 fragments in registers;
sm_90 build: 118 / 170 registers, no spills). Whether ``mma.sync`` at 4 fragments a slice
keeps up with wgmma is what this measures.

``OUT=/tmp/lab GLUON_HUMMING=.whl [GLUON_T="128"] [TILES="8,2 32,3 64,2,128,8"] python3
scripts/kernel_lab/decode_rows.py`` (``block_m,stages[,block_n,warps[,halve]]``; default 128
weight rows, 4 warps; ``halve`` 1: 16-row blocks of up to 8 routes run as 8 rows, variant 63).

Variant 63: at TP8 gate_up T=256 (5.3 routes per expert) 43 of 383 experts hold 9-12 routes,
so 8-row blocks make 426 blocks (1704 tiles, 3.23 rounds of 528 program slots, the fourth
round about one tile an SM) where Humming's stream-K evens them out; halved 16-row blocks make
383 (2.90 rounds), 43 of them at the 16-row cost:
``GLUON_T="TP8/256 TP8/128 EP8/32" TILES="8,2 16,2 16,2,128,4,1"``.
"""

from __future__ import annotations

import os
import sys

ROWS = [("EP8", "gate_up", 128), ("EP8", "down", 128), ("EP8", "gate_up", 256),
        ("EP8", "down", 256), ("TP8", "gate_up", 256), ("TP8", "gate_up", 512),
        ("TP8", "gate_up", 1024), ("EP8", "gate_up", 32), ("TP8", "gate_up", 128)]
TILES = [(tuple(int(v) for v in c.split(",")) + (128, 4, 0)[len(c.split(",")) - 2:])[:5]
         for c in os.environ.get("TILES", "8,2 16,2 32,2 32,3 32,2,128,8 64,2,128,8 64,2,64,4"
                                 ).split()]


def gpu_main() -> None:
    from chordq.kernels.align import align_row_tiles
    from chordq.kernels.triton_config import choose_row_tiles
    from chordq.kernels.triton_w4a16 import moe_gemm_mixed_triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contest

    def contestants(c, add):
        wb, sb = c.extra
        tiles = choose_row_tiles(c.rows / c.p.num_experts, c.p.n, c.p.k)
        pieces = align_row_tiles(c.topk, tiles, c.p.num_experts)
        add("triton blocked", tiles[0], lambda out, a, nb: moe_gemm_mixed_triton(
            c.x, wb, sb, pieces, c.p.top_k, out=out, w_order="blocked"))
        for bm, stages, bn, warps, halve in TILES:
            add(f"G{bm}{'h' if halve else ''} s{stages} {bn}x{warps}", bm, contest.gluon_decode(
                c, wb, sb, block_n=bn, num_warps=warps, num_stages=stages, gated=False,
                blocked=True, block_m=bm, halve=bool(halve)))

    contest.run(ROWS, os.environ.get("GLUON_T", ""),
                os.path.join(os.environ.get("OUT", "/tmp/lab"), "decode_rows.json"),
                contestants, extra_weights=contest.blocked_weights)


if __name__ == "__main__":
    gpu_main()
