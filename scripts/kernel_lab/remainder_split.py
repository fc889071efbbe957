"""Variant 54 (lab): split K for the 32-row Triton remainder piece under the 96-row Gluon tile.

Why: at 85 rows an expert (EP8 T=512) gate_up runs as 96-row Gluon blocks plus, for the ~10%
of experts past 96 rows, a 32-row Triton block (``choose_row_tiles`` -> ``(96, 32)``, variant
30). ``choose_split_k`` splits a grid only under one tile an SM, so the remainder piece of 3
blocks (96 tiles) took 4 splits in run S's seed 0 and the piece of 5-6 blocks (160-192 tiles,
1.2-1.5 an SM, 28 K steps each) none in seed 1, where the row was 1.14 of Humming against
1.06. Here the mixed launch with the remainder piece at 1, 2 and 4 splits, per routing draw.

Measured (H100, session 29, docs/performance.md §24): unsplit on all four draws (4-7
remainder blocks), 0.95-0.98 of 2 or 4 splits' time, plain and fused; shipped
(``triton_w4a16.indexed_config`` splits no remainder piece).

``OUT=/tmp/lab GLUON_HUMMING=.whl LAB_SEED=1 python3 scripts/kernel_lab/remainder_split.py``
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

SPLITS = [int(v) for v in os.environ.get("SPLITS", "1 2 4").split()]
ROWS = [("EP8", "gate_up", 512)]


def gpu_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contest
    from chordq.kernels.align import align_row_tiles
    from chordq.kernels.triton_config import choose_row_tiles
    from chordq.kernels.triton_w4a16 import indexed_config, moe_gemm_indexed_triton

    def contestants(c, add):
        sms = torch.cuda.get_device_properties(c.x.device).multi_processor_count
        for act in (None, "silu_mul"):
            n = c.p.n // (2 if act else 1)
            tiles = choose_row_tiles(c.rows / c.p.num_experts, n, c.p.k, gated=bool(act),
                                     gluon_experts=c.p.num_experts, num_sms=sms)
            pieces = align_row_tiles(c.topk, tiles, c.p.num_experts)
            print("  pieces:", act, [(bs, int(a[1].numel())) for bs, a in pieces])
            for split in SPLITS:
                def launch(out, _a, _nb, split=split, act=act, tiles=tiles, pieces=pieces, n=n):
                    for bs, aligned in pieces:
                        cfg = None
                        if bs == tiles[-1] and len(pieces) > 1:
                            cfg = indexed_config(
                                c.rows, c.p.num_experts, n, c.p.k, bs,
                                activation=act, w_order="subnormal", device=c.x.device,
                                live_blocks=int(aligned[1].numel()))
                            cfg = dataclasses.replace(cfg, split_k=split)
                        moe_gemm_indexed_triton(c.x, c.wf, c.sf, *aligned, c.p.top_k, bs,
                                                activation=act, out=out, config=cfg,
                                                w_order="subnormal")
                add(f"rest S{split}" + (" fused" if act else ""), tiles[0], launch, act=act)

    contest.run(ROWS, "", os.path.join(os.environ.get("OUT", "/tmp/lab"), "remainder.json"),
                contestants)


if __name__ == "__main__":
    gpu_main()
