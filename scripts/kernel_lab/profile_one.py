"""Run one indexed W4A16 GEMM config four times, for ``ncu.sh`` to profile the third call.

usage: python scripts/kernel_lab/profile_one.py PROJ T BM BN BK WARPS STAGES K_ORDER
       [SPLIT [MAXREG [ACT]]]
"""

import sys

import torch

from chordq.kernels import bench as B
from chordq.kernels.align import moe_align_block_size
from chordq.kernels.bench_humming import convert_weights
from chordq.kernels.triton_config import W_ORDER_OF, W4A16Config
from chordq.kernels.triton_w4a16 import moe_gemm_indexed_triton

proj, tokens = sys.argv[1], int(sys.argv[2])
bm, bn, bk, warps, stages = (int(v) for v in sys.argv[3:8])
order = sys.argv[8]
split = int(sys.argv[9]) if len(sys.argv) > 9 else 1
regs = int(sys.argv[10]) if len(sys.argv) > 10 and int(sys.argv[10]) else None
act = sys.argv[11] if len(sys.argv) > 11 else None
gen = torch.Generator(device="cuda").manual_seed(0)
w, s = B._make_weights(gen)[proj]
topk = B._routing(tokens, gen)
k = B._projections()[proj]["k"]
x = torch.randn(tokens if proj == "gate_up" else 8 * tokens, k, generator=gen,
                device="cuda").to(torch.bfloat16)
cfg = W4A16Config(bm, bn, bk, warps, stages, k_order=order, split_k=split, max_registers=regs)
w_order = W_ORDER_OF.get(order, "checkpoint")
w, s = convert_weights(w, s, w_order)
aligned = moe_align_block_size(topk, bm, 48)
for _ in range(4):
    moe_gemm_indexed_triton(x, w, s, *aligned, 8 if proj == "gate_up" else 1, bm, activation=act,
                            config=cfg, w_order=w_order)
torch.cuda.synchronize()
