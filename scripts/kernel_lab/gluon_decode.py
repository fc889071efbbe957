"""Variant 26 (lab): an 8-row W4A16 decode tile in Gluon, on ``mma.sync`` (MMAv2), not wgmma.

Why: the shipped decode loop is issue-bound (docs/kernel_notes.md, item 4): of ~404
instructions per warp and K step (16x64x256), ~96 are wgmma bookkeeping (descriptors,
``WARPGROUP.ARRIVE``/``DEPBAR``) and more are cp.async addressing and stage bookkeeping, and
``tl.dot`` cannot go below 16 rows. Humming's decode runs 8-row ``mma.sync`` tiles at 90-95% of
the bandwidth floor. Gluon (Triton's explicit-layout dialect, in Triton 3.6) lets the words go
from global memory straight into the registers that are the MMA's A fragment, with no shared
memory, no wgmma and 8 token rows.

The "lab order" of the words (``lab_order``) is chosen so every load is 16 bytes wide: within
each 256-wide K block, lane ``t`` (of the 4 that share an MMA row) owns K ``[64 t, 64 t + 64)``:
its 8 words of a row are contiguous (2 x LDG.128), its 64 X values of a token are contiguous
(8 x LDG.128), and its 2 scales of a row are adjacent. MMA position ``p = 16 s + 8 q + 2 t + h``
(k16 slice ``s``, fragment half ``q``) holds K ``64 t + 4 s + 2 q + h``; word ``8 t + g`` holds
slices ``2 g`` and ``2 g + 1``: its nibble ``j + 4 h`` is K ``64 t + 8 g + 4 (j >> 1) +
2 (j & 1) + h``. The scales keep the checkpoint order (times 2**129, as "subnormal").

``FRAG`` reads the shipped fragment-order words instead (``chordq.layout.fragment_order``,
X in natural K): a thread's words are then 4 apart, so every load is 4 bytes wide. ``PREFETCH``
loads step ``i + 1`` before computing step ``i`` (X carried as int32 pairs: BF16 loop phis
cost a PRMT per pair).

GPU only (Gluon has no interpreter); the CPU compiles it for sm_90 (Triton 3.6 on PYTHONPATH):
``BN=128 BT=8 python scripts/kernel_lab/gluon_decode.py --sass`` prints the loop length and
registers. On the GPU: ``OUT=/tmp/lab [GLUON_HUMMING=.whl] [GLUON_T="8 20"]
[GLUON_TILES="128,8,2,0,0 ..."] python scripts/kernel_lab/gluon_decode.py`` checks every tile
against the reference (cos_diff) and times it against the shipped kernel (and Humming, from
the wheel in that folder), interleaved, with CUDA graphs. Tiles are ``BN,BT,warps,prefetch,frag``.
"""

from __future__ import annotations

import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from chordq.kernels import gluon_w4a16 as G
from chordq.kernels.triton_w4a16 import _DEQUANT_SUBNORMAL_ASM
from chordq.layout import pack_codes, unpack_codes

BK = gl.constexpr(256)  # K per step

_ASM = gl.constexpr(_DEQUANT_SUBNORMAL_ASM.value)


def lab_source() -> torch.Tensor:
    """``src[p]`` = the K offset (within a 256 block) that lab-order code ``p`` holds, for
    ``p = 8 * word + nibble``."""
    src = torch.empty(BK.value, dtype=torch.long)
    for t in range(4):
        for g in range(8):
            for j in range(4):
                for h in range(2):
                    k = 64 * t + 8 * g + 4 * (j >> 1) + 2 * (j & 1) + h
                    src[8 * (8 * t + g) + j + 4 * h] = k
    return src


def lab_order(words: torch.Tensor) -> torch.Tensor:
    """Checkpoint words ``[..., K/8]`` (K % 256 == 0) -> lab order."""
    codes = unpack_codes(words)
    codes = codes.reshape(*codes.shape[:-1], -1, BK.value)[..., lab_source().to(words.device)]
    return pack_codes(codes.flatten(-2))


@gluon.constexpr_function
def _layouts(BN, BT, num_warps, FRAG=False):
    reps = BN // (16 * num_warps)
    rows = [[16 * num_warps * (1 << i), 0] for i in range(reps.bit_length() - 1)]
    warp_rows = [[16 << i, 0] for i in range((num_warps).bit_length() - 1)]
    if FRAG:  # the shipped words (fragment order), read as gluon_w4a16 reads them (BT = 8)
        words, scales3, x = G._layouts(BN, num_warps)
        return words, gl.SliceLayout(2, scales3), x, None, scales3
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + rows,
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp_rows, block_bases=[], shape=[BN, 32])
    scales = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]] + rows,
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp_rows, block_bases=[], shape=[BN, 8])
    x = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32]]
        + [[8 << i, 0] for i in range((BT // 8).bit_length() - 1)],
        lane_bases=[[0, 64], [0, 128], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0]] * ((num_warps).bit_length() - 1), block_bases=[], shape=[BT, BK.value])
    xi = gl.DistributedLinearLayout(  # x as int32 pairs
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]]
        + [[8 << i, 0] for i in range((BT // 8).bit_length() - 1)],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0]] * ((num_warps).bit_length() - 1), block_bases=[],
        shape=[BT, BK.value // 2])
    return words, scales, x, xi, None


@gluon.jit
def _step(w, s, x, acc, a_layout: gl.constexpr, b_layout: gl.constexpr, BN: gl.constexpr,
          BT: gl.constexpr, FRAG: gl.constexpr, s3_layout: gl.constexpr):
    if FRAG:  # the shipped tile's step
        acc = G._dequant_mma(w, s, x, acc, a_layout, b_layout, s3_layout, BN)
    else:
        acc = _lab_step(w, s, x, acc, a_layout, b_layout, BN, BT)
    return acc


@gluon.jit
def _lab_step(w, s, x, acc, a_layout: gl.constexpr, b_layout: gl.constexpr, BN: gl.constexpr,
              BT: gl.constexpr):
    """One K step on lab-order words (module docstring)."""
    s4 = gl.join(gl.join(s, s), gl.join(s, s))  # [BN, 8, 2, 2]: each group's scale per word
    s4 = gl.reshape(s4, [BN, 32])
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        _ASM, "=r,=r,=r,=r,r,r,r", [gl.join(w, w), gl.join(s4, s4)],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=2)
    pairs = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [BN, word, h, j & 1, j >> 1]
    a = gl.reshape(pairs, [BN, 4, 8, 2, 2, 2])  # [BN, t, g, h, jl, jh]
    a = gl.reshape(gl.permute(a, [0, 2, 5, 4, 1, 3]), [BN, BK])  # p = 32g + 16jh + 8jl + 2t + h
    a = gl.convert_layout(a, a_layout, assert_trivial=True)
    if x.dtype == gl.int32:  # [BT, BK/2] words of two BF16 (prefetch: no 16-bit loop phis)
        x = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(x, x)],
                                      dtype=gl.bfloat16, is_pure=True, pack=2)
    b = gl.reshape(x, [BT, 4, 16, 2, 2])  # [n, t, s, q, h]
    b = gl.reshape(gl.permute(b, [2, 3, 1, 4, 0]), [BK, BT])  # p = 16s + 8q + 2t + h
    b = gl.convert_layout(b, b_layout, assert_trivial=True)
    return mma_v2(a, b, acc)


@gluon.jit
def w4a16_decode8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr,
                         N, K, K8, KS, num_routes, stride_xm, stride_om,
                         TOP_K: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr,
                         PREFETCH: gl.constexpr, FRAG: gl.constexpr,
                         num_warps: gl.constexpr):
    w_l: gl.constexpr = _layouts(BN, BT, num_warps, FRAG)[0]
    s_l: gl.constexpr = _layouts(BN, BT, num_warps, FRAG)[1]
    x_l: gl.constexpr = _layouts(BN, BT, num_warps, FRAG)[2]
    s3_l: gl.constexpr = _layouts(BN, BT, num_warps, FRAG)[4]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)

    pid_n = gl.program_id(0)
    pid_b = gl.program_id(1)
    expert = gl.load(expert_ids_ptr + pid_b).to(gl.int64)
    if expert >= 0:
        n0 = pid_n * BN
        # weights and scales: row offsets, then per-step columns
        wr = gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
        wc = gl.arange(0, 32, layout=gl.SliceLayout(0, w_l))
        w_ptrs = (w_ptr + expert * N * K8 + (n0 + wr)[:, None] * K8 + wc[None, :])
        sr = gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
        sc = gl.arange(0, 8, layout=gl.SliceLayout(0, s_l))
        s_ptrs = (s_ptr + expert * N * KS + (n0 + sr)[:, None] * KS + sc[None, :])
        xr = gl.arange(0, BT, layout=gl.SliceLayout(1, x_l))
        xc = gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
        routes = gl.load(sorted_ids_ptr + pid_b * BT + xr)
        routes = gl.where(routes < num_routes, routes, 0)  # sentinels read row 0, not stored
        x_ptrs = x_ptr + (routes // TOP_K).to(gl.int64)[:, None] * stride_xm + xc[None, :]

        acc = gl.zeros([BN, BT], gl.float32, mma)
        if PREFETCH:
            xi_l: gl.constexpr = _layouts(BN, BT, num_warps, FRAG)[3]
            xir = gl.arange(0, BT, layout=gl.SliceLayout(1, xi_l))
            xic = gl.arange(0, BK // 2, layout=gl.SliceLayout(0, xi_l))
            r2 = gl.load(sorted_ids_ptr + pid_b * BT + xir)
            r2 = gl.where(r2 < num_routes, r2, 0)
            xi_ptrs = (x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
                       + (r2 // TOP_K).to(gl.int64)[:, None] * (stride_xm // 2) + xic[None, :])
            w = gl.load(w_ptrs)
            s = gl.load(s_ptrs)
            x = gl.load(xi_ptrs)
            for step in range(1, K // BK):
                w_n = gl.load(w_ptrs + step * 32)
                s_n = gl.load(s_ptrs + step * 8)
                x_n = gl.load(xi_ptrs + step * (BK // 2))
                acc = _step(w, s, x, acc, a_l, b_l, BN, BT, FRAG, s3_l)
                w, s, x = w_n, s_n, x_n
            acc = _step(w, s, x, acc, a_l, b_l, BN, BT, FRAG, s3_l)
        else:
            for step in range(K // BK):
                acc = _step(gl.load(w_ptrs + step * 32), gl.load(s_ptrs + step * 8),
                            gl.load(x_ptrs + step * BK), acc, a_l, b_l, BN, BT, FRAG, s3_l)

        orow = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        ocol = gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
        oroutes = gl.load(sorted_ids_ptr + pid_b * BT + ocol)
        o_ptrs = out_ptr + oroutes.to(gl.int64)[None, :] * stride_om + (n0 + orow)[:, None]
        gl.store(o_ptrs, acc.to(gl.bfloat16), mask=(oroutes < num_routes)[None, :])


def decode_gemm(x, w_lab, s_sub, sorted_ids, expert_ids, num_blocks, top_k, out, bn=64, bt=8,
                warps=4, prefetch=False, frag=False):
    """``out[r] = x[r // top_k] @ W_e^T`` over the ``bt``-row blocks of
    ``moe_align_block_size(.., bt)``: words in lab order, scales as ``subnormal_scales``."""
    _, n, k8 = w_lab.shape
    w4a16_decode8_kernel[(n // bn, num_blocks)](
        x, w_lab, s_sub, out, sorted_ids, expert_ids, n, 8 * k8, k8, k8 // 4, out.shape[0],
        x.stride(0), out.stride(0), TOP_K=top_k, BN=bn, BT=bt, PREFETCH=prefetch, FRAG=frag,
        num_warps=warps)
    return out


def compile_sm90(bn=64, bt=8, warps=4, prefetch=False, frag=False, stages=0):
    """Compile for sm_90 with no GPU (the CPU check): returns the compiled kernel
    (``stages`` > 0: the shipped kernel, ``gluon_w4a16.compile_sm90``)."""
    if stages:
        return G.compile_sm90(bn, warps, stages)
    return G.compile_kernel_sm90(w4a16_decode8_kernel, {
        "TOP_K": 8, "BN": bn, "BT": bt, "PREFETCH": prefetch, "FRAG": frag, "num_warps": warps})


def sass_summary(kern) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sass import summary

    return "\n".join(summary(kern))


if __name__ == "__main__" and "--sass" in sys.argv:
    kern = compile_sm90(int(os.environ.get("BN", 64)), int(os.environ.get("BT", 8)),
                        prefetch=os.environ.get("PREFETCH") == "1")
    if os.environ.get("DUMP"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from sass import sass_of
        open(os.environ["DUMP"], "w").write(sass_of(kern))
    print(sass_summary(kern))


# (layout, projection, tokens per GPU)
ROWS = ([("EP8", "gate_up", t) for t in (1, 8, 20, 32, 128)]
        + [("EP8", "down", t) for t in (1, 8, 20, 32, 128)]
        + [("TP8", "gate_up", t) for t in (1, 8, 20, 32, 128, 256, 512)]
        + [("TP8", "down", t) for t in (1, 8, 20, 32, 128, 256)])
TILES = [tuple(int(v) for v in t.split(",")) for t in os.environ.get(
    "GLUON_TILES", "128,8,2,0,0"
).split()]  # BN,BT,warps,prefetch,fragment-order words
SMEM_TILES = [tuple(int(v) for v in t.split(",")) for t in os.environ.get(
    "GLUON_SMEM", "128,8,4,2 128,8,4,3 64,8,4,2 128,8,8,2"
).split()]  # BN,BT,warps,stages: the shipped kernel (chordq.kernels.gluon_w4a16), BT = 8


def gpu_main() -> None:
    from chordq.kernels.gluon_w4a16 import moe_gemm_indexed_gluon
    from chordq.layout import subnormal_scales

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contest

    def contestants(c, add):
        wl, sl = c.extra
        for bn, bt, warps, pf, fr in TILES:
            if c.p.n % bn == 0:
                add(f"gluon {bn}x{bt}x{warps}" + (" pf" if pf else "") + (" frag" if fr else ""),
                    bt, lambda out, a, nb, bn=bn, bt=bt, warps=warps, pf=pf, fr=fr: decode_gemm(
                        c.x, c.wf if fr else wl, sl, a[0], a[1], nb, c.p.top_k, out, bn=bn,
                        bt=bt, warps=warps, prefetch=bool(pf), frag=bool(fr)))
        for bn, bt, warps, stages in SMEM_TILES:
            if c.p.n % bn == 0:
                add(f"smem {bn}x{bt}x{warps} s{stages}", bt,
                    lambda out, a, nb, bn=bn, warps=warps, stages=stages: moe_gemm_indexed_gluon(
                        c.x, c.wf, c.sf, *a, c.p.top_k, out, num_routes=c.rows, grid_m=nb,
                        block_n=bn, num_warps=warps, num_stages=stages, gated=False))

    contest.run(ROWS, os.environ.get("GLUON_T", ""),
                os.path.join(os.environ.get("OUT", "/tmp/lab"), "gluon_decode.json"),
                contestants, extra_weights=lambda w, sc: (lab_order(w), subnormal_scales(sc)))


if __name__ == "__main__" and "--sass" not in sys.argv:
    gpu_main()
