"""Variant 55 (lab): the Gluon prefill tile over 512 weight rows for 64-row blocks, on today's
tile (words and scales by TMA), written from ``kernels/gluon_prefill.py`` by edits.

Why (variant 52, docs/performance.md §24): at 43 rows an expert the 64-row form's copies alone
take 0.77-0.97 of its time, and the gathered X rows are 22% of them at TP8 gate_up T=2048
(copies without X 0.70 of the tile against 0.91): a 256-row tile reads a block's X once per
256 weight rows, Humming's (56, 512, 64) once per 512. Here each consumer owns 256 rows, two
128-row halves a step (a ``[128, 64]`` accumulator each), so a slot's X serves 512 weight
rows. Variant 38 built this in session 22 and lost (1.12-1.16), when the scales still went by
``cp.async`` and bounded the copies (variant 41 took that away); its halves run as two of the
shipped tile's steps would (dequantize, turn, wgmmas, retire), so what changes is the X
traffic, halved, and the ring: a slot is freed after both halves (56 KB a slot at 128-deep
steps, so 3 slots, 205 KB: as many steps ahead as 6 of the shipped tile's). Plain GEMMs on
64-row blocks only; ``block_n`` is taken as 512. The sm_90 build (Triton 3.6, on the CPU):
168 registers, no spills, 64 HGMMA (two halves of the shipped step's 32).

``python scripts/kernel_lab/prefill_wide.py`` writes ``kernels/gluon_prefill_wide.py`` (each
edit must match once); then on the GPU: ``OUT=/tmp/lab GLUON_HUMMING=.whl PREFILL_BLOCKED=1
PREFILL_TILES="" PREFILL_PP="64,128,5" PREFILL_T="EP8/256 TP8/2048"
PREFILL_AB="gluon_prefill_wide" python3 scripts/kernel_lab/gluon_prefill.py`` (the lab passes
each copy ``PREFILL_PP``'s slots: the wide copy caps them at ``WIDE_STAGES``; its fused rows
are refused and skipped). ``--sass``: the sm_90 build's registers, spills and shared memory.
Not yet run on a GPU (session 29 built it after its device time was spent).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_bounds import ROOT, Span, edited  # noqa: E402

WIDE_STAGES = 3  # 56 KB a slot at 128-deep steps: 4 slots (262 KB) do not fit

LOADER_OLD = Span("                if i % 2 == 0:\n                    mbarrier.expect",
                  "                _cp_async(x0_bufs.index(slot), x0_ptrs + i * BK)\n")
LOADER_NEW = '''\
                if i % 2 == 0:
                    mbarrier.expect(ready.index(slot), 4 * WGR * (BK // 2 + BK // 8))
                    for h in gl.static_range(2):
                        _tma_rows(s_desc, w_row0, n0 + h * WGR, N, i * (BK // 32),
                                  ready.index(slot), s0_bufs.index(slot).slice(h * WGR, WGR),
                                  GATED, BLOCKED, kb, 8)
                        _tma_rows(s_desc, w_row0, n0 + OUT_W + h * WGR, N, i * (BK // 32),
                                  ready.index(slot), s1_bufs.index(slot).slice(h * WGR, WGR),
                                  GATED, BLOCKED, kb, 8)
                else:
                    mbarrier.expect(ready.index(slot), 4 * WGR * (BK // 2))
                for h in gl.static_range(2):
                    _tma_rows(w_desc, w_row0, n0 + h * WGR, N, i * (BK // 8), ready.index(slot),
                              w0_bufs.index(slot).slice(h * WGR, WGR), GATED, BLOCKED, kb, 32)
                    _tma_rows(w_desc, w_row0, n0 + OUT_W + h * WGR, N, i * (BK // 8),
                              ready.index(slot), w1_bufs.index(slot).slice(h * WGR, WGR), GATED,
                              BLOCKED, kb, 32)
'''
MMA_STEPS_NEW = '''@gluon.jit
def _mma_steps(w_bufs, s_bufs, x0_bufs, x1_bufs, ready, empty, g0, num_steps,
               ROWS: gl.constexpr, BK: gl.constexpr, BT0: gl.constexpr, BT1: gl.constexpr,
               STAGES: gl.constexpr, num_warps: gl.constexpr, turn, ME: gl.constexpr,
               PAIRS: gl.constexpr = True):
    """Lab (wide): a consumer's 2 ROWS weight rows as two ROWS-row halves a step, a ``[ROWS,
    BT0]`` accumulator each; each half's wgmmas retire before the next half is dequantized,
    the turns alternate per half, and the slot is freed after both."""
    w_l: gl.constexpr = _operand_layouts(ROWS, BK, num_warps)[0]
    s3_l: gl.constexpr = _operand_layouts(ROWS, BK, num_warps)[1]
    mma0: gl.constexpr = _mma_layout(BT0, num_warps)
    a0_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma0, k_width=2)
    acc_a = gl.zeros([ROWS, BT0], gl.float32, mma0)
    acc_b = gl.zeros([ROWS, BT0], gl.float32, mma0)
    s_l: gl.constexpr = gl.SliceLayout(2, s3_l)
    G: gl.constexpr = BK // 32
    s_next_a = gl.zeros([ROWS, G], gl.bfloat16, s_l)
    s_next_b = gl.zeros([ROWS, G], gl.bfloat16, s_l)
    gl.assume(num_steps > 0)
    for i in range(num_steps):
        g = g0 + i
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        for c in gl.static_range(2):
            w = w_bufs.index(slot).slice(c * ROWS, ROWS).load(w_l)
            sb = s_bufs.index(slot).slice(c * ROWS, ROWS)
            if c == 0:
                if i % 2 == 0:
                    s = sb.slice(0, G, dim=1).load(s_l)
                    s_next_a = sb.slice(G, G, dim=1).load(s_l)
                else:
                    s = s_next_a
            else:
                if i % 2 == 0:
                    s = sb.slice(0, G, dim=1).load(s_l)
                    s_next_b = sb.slice(G, G, dim=1).load(s_l)
                else:
                    s = s_next_b
            a = _dequant(w, s, s3_l, ROWS, BK)
            fence_async_shared()
            h = 2 * g + c
            if ME >= 0:
                mbarrier.wait(turn.index(ME), (h & 1) ^ (1 - ME))
            a0 = gl.convert_layout(a, a0_l, assert_trivial=True)
            if c == 0:
                acc_a = warpgroup_mma(a0, x0_bufs.index(slot).permute((1, 0)), acc_a,
                                      is_async=True)
            else:
                acc_b = warpgroup_mma(a0, x0_bufs.index(slot).permute((1, 0)), acc_b,
                                      is_async=True)
            if ME >= 0:
                mbarrier.arrive(turn.index(1 - ME))
            if c == 0:
                acc_a = warpgroup_mma_wait(0, deps=[acc_a])
            else:
                acc_b = warpgroup_mma_wait(0, deps=[acc_b])
        mbarrier.arrive(empty.index(slot))
    return acc_a, acc_b


'''
STORE_OLD = '''\
            _store(acc0, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om, WGR, BT0,
                   GATED, 4)
            if BT1 > 0:
                _store(acc1, out_ptr, sorted_ids_ptr, row0 + BT0, n_out, num_routes, stride_om,
                       WGR, BT1, GATED, 4)
'''
STORE_NEW = '''\
            _store(acc0, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, stride_om, WGR, BT0,
                   GATED, 4)
            _store(acc1, out_ptr, sorted_ids_ptr, row0, n_out + WGR, num_routes, stride_om, WGR,
                   BT0, GATED, 4)
'''
CHECK_OLD = '''\
    if block_n != (WGR.value if gated else 2 * WGR.value):
        raise ValueError(f"the Gluon prefill tile computes {2 * WGR.value} weight rows: "
                         f"block_n {WGR.value if gated else 2 * WGR.value}, got {block_n}")
'''
CHECK_NEW = f'''    if gated or split_rows(block_m)[1]:
        raise ValueError("lab: the wide tile runs plain GEMMs on power-of-two row blocks")
    block_n, num_stages = 4 * WGR.value, min(num_stages, {WIDE_STAGES})
'''
EDITS = [
    (Span("@gluon.jit\ndef _mma_steps(", "@gluon.jit\ndef _store("), MMA_STEPS_NEW),
    (LOADER_OLD, LOADER_NEW),
    ("    OUT_W: gl.constexpr = WGR // 2 if GATED else WGR  # output columns per warpgroup\n",
     "    OUT_W: gl.constexpr = 2 * WGR  # output columns per warpgroup (lab: plain only)\n"),
    ("    w0_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, WGR, BK // 8], w_sl)\n"
     "    w1_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, WGR, BK // 8], w_sl)\n"
     "    s0_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, WGR, BK // 16], s_sl)\n"
     "    s1_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, WGR, BK // 16], s_sl)\n",
     "    w0_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, 2 * WGR, BK // 8], w_sl)\n"
     "    w1_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, 2 * WGR, BK // 8], w_sl)\n"
     "    s0_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * WGR, BK // 16], s_sl)\n"
     "    s1_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2 * WGR, BK // 16], s_sl)\n"),
    (STORE_OLD, STORE_NEW),
    (CHECK_OLD, CHECK_NEW),
]


def source() -> str:
    """The wide copy's source, from today's ``kernels/gluon_prefill.py``."""
    return edited(EDITS, "gluon_prefill_wide")

def write() -> str:
    path = os.path.join(ROOT, "gluon_prefill_wide.py")
    with open(path, "w") as f:
        f.write(source())
    return path

def sass() -> None:
    """The sm_90 build (the installed Triton; Triton 3.6 on PYTHONPATH for the device's):
    shared memory, HGMMA count, spills, and ptxas's verdict."""
    import importlib

    import sass as S

    mod = importlib.import_module("chordq.kernels.gluon_prefill_wide")
    for stages in (2, 3):
        k = mod.compile_sm90(block_m=64, num_stages=stages, blocked=True)
        code = S.sass_of(k)
        print(f"{stages} slots: shared {k.metadata.shared} B, HGMMA {code.count('HGMMA')}, "
              f"spills {code.count('STL') + code.count('LDL')};",
              "; ".join(S.ptxas_verdict(k)))

if __name__ == "__main__":
    print("wrote", write())
    if "--sass" in sys.argv:
        sass()
