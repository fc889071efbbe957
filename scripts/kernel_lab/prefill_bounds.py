"""Variants 52-53 (lab): what bounds the Gluon prefill tile's 64-row form at 43 rows an expert.

Why: EP8 T=256 and TP8 gate_up T=2048 (43 rows an expert) run 1.10-1.26 of Humming, whose tile
there is 56 rows (``(56,512,64) wgmma x1 ws sk``). A 56-row wgmma needs a non-power-of-two
accumulator, so inline PTX: worth building only if the tile's time moves with its wgmma work.
Variant 32 ablated the tile before its words and scales went by TMA (the copies bounded it
then); this ablates today's. Each copy is ``kernels/gluon_prefill.py`` with one part changed
(timing only, the results are wrong but for ``_pfx``), timed in one process beside the shipped
tile by ``gluon_prefill.py``'s ``PREFILL_AB``:

- ``gluon_prefill_n32``: the wgmmas over the block's first 32 token rows only (half the MMA
  work, copies and dequantization as shipped). A 56-row wgmma would save 1/4 of what this
  saves, were wgmma time proportional to N;
- ``gluon_prefill_nox``: the loader copies no X rows (the wgmmas read stale slots);
- ``gluon_prefill_nodq``: the consumers neither read nor dequantize words and scales (A is
  zeros; copies, turns and wgmmas as shipped);
- ``gluon_prefill_copies``: the consumers only wait for each slot and free it (the copies
  alone); ``_copies_nox``: without the X rows;
- ``gluon_prefill_c8k`` (and ``_copies_c8k``): each step's words one contiguous 8 KB TMA box
  (the unblocked words read as if row-blocked in 128-deep pieces: a layout that does not exist,
  in its access pattern), against the shipped boxes of 64 bytes from each of 128 rows;
- variant 53, ``gluon_prefill_pfx`` (and ``_copies_pfx``): the X rows also prefetched into L2
  with the evict_last priority (one ``prefetch.global.L2::evict_last`` a 128-byte line and
  step; Triton 3.6's ``cp.async`` drops an eviction policy), so that a token's row would stay
  in L2 for its other experts' blocks while the weights stream past.

Measured (H100, session 29, docs/performance.md §24): the copies alone take 0.77-0.91 of the
tile's time; no X rows 0.86-0.95; half the wgmma work 0.84-0.92; the contiguous boxes and the
prefetch change nothing (within 2%).

``python scripts/kernel_lab/prefill_bounds.py`` writes the copies (each edit must match once),
then on the GPU: ``OUT=/tmp/lab GLUON_HUMMING=.whl PREFILL_BLOCKED=1 PREFILL_TILES=""
PREFILL_PP="64,128,5" PREFILL_T="EP8/256 TP8/2048" PREFILL_AB="gluon_prefill_n32
gluon_prefill_nox gluon_prefill_copies gluon_prefill_copies_nox" python3
scripts/kernel_lab/gluon_prefill.py`` (``PREFILL_BLOCKED=1``: on row-blocked words, as the
bench runs the tile; the ``*c8k`` copies take the unblocked words).
"""

from __future__ import annotations

import dataclasses
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels")

ACC0 = "    acc0 = gl.zeros([ROWS, BT0], gl.float32, mma0)\n"
MMA0 = ("                    acc0 = warpgroup_mma(a0, _x_part(x0_bufs, slot, q, BK, KSPLIT), "
        "acc0,\n                                         is_async=True)\n")
NOX = ("            _cp_async(x0_bufs.index(slot), x0_ptrs + i * BK)\n", "")


@dataclasses.dataclass(frozen=True)
class Span:
    """An edit's old text given by its ends: from ``head`` up to ``tail`` (not included)."""
    head: str
    tail: str


WAIT = "        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)\n"
# the consumers' loop body cut to waiting for a slot and freeing it
CUT = (Span(WAIT, "        mbarrier.arrive(empty.index(slot))\n"), WAIT)
# unblocked words read as if each step's 128 rows x 16 words were one contiguous 8 KB piece
C8K = [("        _tma_load(desc, [row, col], bar, dst)\n",
        "        if INNER == 32:\n"
        "            _tma_load(desc, [((row // 128) * 2 * KB + col // 16) * 128 + row % 128, 0],"
        " bar, dst)\n"
        "        else:\n"
        "            _tma_load(desc, [row, col], bar, dst)\n"),
       ("w_packed.view(-1, 32 if blocked else k // 8)",
        "w_packed.view(-1, 32 if blocked else 16)")]
# the gathered X rows also prefetched into L2 with the evict_last priority (one prefetch per
# 128-byte line and step; cp.async in Triton 3.6 drops its eviction policy), so that the rows
# a token's other experts read later are still in L2 after the weights streamed past
PREFETCH = ("gl.inline_asm_elementwise(\"prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;\", "
            "\"=r,l\", [{ptrs} + i * BK], dtype=gl.int32, is_pure=False, pack=1)\n")
PFX = [("        x0_ptrs = _x_ptrs(",
        "        xl0_ptrs = _x_line_ptrs(x_ptr, sorted_ids_ptr, row0, num_routes, stride_xm,"
        " TOP_K, BT0, BK, num_warps)\n"
        "        x0_ptrs = _x_ptrs("),
       ("            _cp_async(x0_bufs.index(slot), x0_ptrs + i * BK)\n",
        "            _cp_async(x0_bufs.index(slot), x0_ptrs + i * BK)\n"
        "            " + PREFETCH.format(ptrs="xl0_ptrs")
        + "            if BT1 > 0:\n"
        "                " + PREFETCH.format(ptrs="xl1_ptrs")),
       ("            x1_ptrs = _x_ptrs(",
        "            xl1_ptrs = _x_line_ptrs(x_ptr, sorted_ids_ptr, row0 + BT0, num_routes,"
        " stride_xm, TOP_K, BT1, BK, num_warps)\n"
        "            x1_ptrs = _x_ptrs("),
       ("@gluon.jit\ndef _tile_count(", """@gluon.jit
def _x_line_ptrs(x_ptr, sorted_ids_ptr, row0, num_routes, stride_xm, TOP_K: gl.constexpr,
                 BT: gl.constexpr, BK: gl.constexpr, LW: gl.constexpr):
    LINES: gl.constexpr = BK // 64
    l_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // LINES, LINES], [LW, 1], [1, 0])
    xr = gl.arange(0, BT, layout=gl.SliceLayout(1, l_l))
    xc = gl.arange(0, LINES, layout=gl.SliceLayout(0, l_l)) * 64
    routes = gl.load(sorted_ids_ptr + row0 + xr)
    routes = gl.where(routes < num_routes, routes, 0)
    return x_ptr + (routes // TOP_K).to(gl.int64)[:, None] * stride_xm + xc[None, :]


@gluon.jit
def _tile_count(""")]
DEQUANT = "                    a = _dequant(w, s, s3_l, ROWS, BK)\n"
EDITS = {
    "gluon_prefill_n32": [
        ("    mma0: gl.constexpr = _mma_layout(BT0, num_warps)\n",
         "    mma0: gl.constexpr = _mma_layout(BT0 // 2, num_warps)\n"),
        (ACC0, "    acc0 = gl.zeros([ROWS, BT0 // 2], gl.float32, mma0)\n"),
        (MMA0, "                    acc0 = warpgroup_mma(a0, x0_bufs.index(slot).slice(0, BT0 // 2)"
               ".permute((1, 0)), acc0, is_async=True)\n"),
        ("            _store(acc0, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, "
         "stride_om, WGR,\n                   BT0, GATED, 4, ok)\n",
         "            _store(acc0, out_ptr, sorted_ids_ptr, row0, n_out, num_routes, "
         "stride_om, WGR,\n                   BT0 // 2, GATED, 4, ok)\n"),
    ],
    "gluon_prefill_nox": [
        NOX,
    ],
    "gluon_prefill_nodq": [
        (DEQUANT, "                    a = gl.zeros([ROWS, BK], gl.bfloat16, a0_l)\n"),
    ],
    "gluon_prefill_copies": [CUT],
    "gluon_prefill_copies_nox": [CUT, NOX],
    "gluon_prefill_copies_c8k": [CUT] + C8K,
    "gluon_prefill_c8k": C8K,
    "gluon_prefill_pfx": PFX,
    "gluon_prefill_copies_pfx": [CUT] + PFX,
}


def edited(edits, name: str) -> str:
    """Today's ``kernels/gluon_prefill.py`` (imports made absolute) with ``edits``, pairs of
    old text (a string or a ``Span``) and new; each old text must occur exactly once."""
    with open(os.path.join(ROOT, "gluon_prefill.py")) as f:
        text = f.read().replace("from .", "from chordq.kernels.")
    for old, new in edits:
        if isinstance(old, Span):
            if text.count(old.head) != 1:
                raise SystemExit(f"{name}: edit does not match once: {old.head.strip()[:70]}")
            i = text.index(old.head)
            old = text[i:text.index(old.tail, i)]
        if text.count(old) != 1:
            raise SystemExit(f"{name}: edit does not match once: {old.strip()[:70]}")
        text = text.replace(old, new)
    return text


def copies() -> dict[str, str]:
    """Each copy's source, from today's ``kernels/gluon_prefill.py``."""
    return {name: edited(edits, name) for name, edits in EDITS.items()}

def main() -> None:
    for name, text in copies().items():
        with open(os.path.join(ROOT, name + ".py"), "w") as f:
            f.write(text)
        print("wrote", name)

if __name__ == "__main__":
    main()
