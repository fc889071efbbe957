"""Variant 50 (lab): the Gluon 8-row decode tile with split K, and with a register cap.

Why: at TP8 gate_up (N = 512, K = 7168) a touched expert makes 4 column tiles of 28 K steps,
so T=20's ~135 experts make ~540 long programs. The tile takes 102 registers (4 programs an
SM: 528 slots on 132 SMs), and Humming runs these rows as stream-K (its tile label says
``sk``): run Q had TP8 gate_up T=20 at 1.18-1.21 of Humming, 57% of the floor against 69%.
Split K (``split_k``: each program a share of the steps, FP32 partials summed by
``triton_w4a16._split_k_reduce_kernel``) makes more, shorter programs; a 96-register cap
(``max_registers``) fits a fifth program an SM.

Variant 51, the same tile as stream-K (``stream_k``: persistent programs, 4 an SM under a
128-register cap; a thin last wave shared out by K steps, as ``_w4a16_decode_sk_kernel`` says).

``OUT=/tmp/lab GLUON_HUMMING=.whl [GLUON_T="20 32"] [SPLITS="1,0 2,0 1,96"] [STREAMS="4 3"]
python3 scripts/kernel_lab/decode_split.py`` (``split_k,max_registers`` pairs, 0: no cap;
``stream_k`` programs an SM).
"""

from __future__ import annotations

import os
import sys

ROWS = ([("TP8", "gate_up", t) for t in (1, 8, 20, 32)]
        + [("EP8", proj, t) for proj in ("gate_up", "down") for t in (1, 8, 20, 32)])
SPLITS = [tuple(int(v) for v in c.split(",")) for c in os.environ.get(
    "SPLITS", "1,0 1,96 2,0 3,0 4,0 2,96 3,96").split()]
STREAMS = [int(v) for v in os.environ.get("STREAMS", "4").split()]


def gpu_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contest

    def contestants(c, add):
        wb, sb = c.extra
        for split, regs in SPLITS:
            add(f"G8 S{split}" + (f" R{regs}" if regs else ""), 8, contest.gluon_decode(
                c, wb, sb, block_n=128, num_warps=4, num_stages=2, gated=False, blocked=True,
                split_k=split, max_registers=regs or None))
        for per_sm in STREAMS:
            add(f"G8 K{per_sm}", 8, contest.gluon_decode(
                c, wb, sb, block_n=128, num_warps=4, num_stages=2, gated=False, blocked=True,
                stream_k=per_sm))

    contest.run(ROWS, os.environ.get("GLUON_T", ""),
                os.path.join(os.environ.get("OUT", "/tmp/lab"), "decode_split.json"),
                contestants, extra_weights=contest.blocked_weights)


if __name__ == "__main__":
    gpu_main()
