"""Compile one indexed W4A16 config for sm_90 on any machine (no GPU) and summarize its SASS.

Prints the instruction count of each loop body (a backward branch closes one) and the
opcode histogram of the longest, so variants can be compared before spending GPU time.
Triton here may be newer than on the GPU machine: compare variants, not absolute counts.

usage: python scripts/kernel_lab/sass.py BM BN BK WARPS STAGES K_ORDER [GATED] [N_TILES]
       [--split-m M2] [--dump FILE]
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from chordq.kernels import triton_w4a16 as tw
from chordq.kernels.triton_config import K_ORDERS


def compile_sass(bm, bn, bk, warps, stages, k_order, gated=False, n_tiles=1, n=4096, k=7168):
    wide = n_tiles > 1
    fn = tw._w4a16_indexed_wide_kernel if wide else tw._w4a16_indexed_kernel
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16",
            "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "ntp_ptr": "*i32"}
    consts = dict(TOP_K=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_ORDER=K_ORDERS.index(k_order),
                  EVEN_N=True, COMPUTE_F32=False)
    if wide:
        consts["N_TILES"] = n_tiles
    else:
        consts.update(GATED=gated, SPLIT_K=1)
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else ptrs.get(name, "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v
                                                      for c, v in consts.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                          check=True).stdout


def loops(sass: str) -> list[list[str]]:
    """Instruction lists of the bodies closed by backward branches (``BRA `(.L_x_N)`` to a
    label defined above the branch)."""
    body, labels, bodies = [], {}, []
    for ln in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", ln)
        if label:
            labels[label.group(1)] = len(body)
        elif re.match(r"\s+/\*[0-9a-f]{4}\*/", ln):
            body.append(ln)
            target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
            if target and target.group(1) in labels:
                bodies.append(body[labels[target.group(1)]:])
    return bodies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cfg", nargs="+")
    ap.add_argument("--dump")
    a = ap.parse_args()
    bm, bn, bk, warps, stages = (int(v) for v in a.cfg[:5])
    gated = len(a.cfg) > 6 and a.cfg[6] == "1"
    n_tiles = int(a.cfg[7]) if len(a.cfg) > 7 else 1
    kw = dict(n=7168, k=256) if n_tiles > 1 else {}
    sass = compile_sass(bm, bn, bk, warps, stages, a.cfg[5], gated, n_tiles, **kw)
    if a.dump:
        open(a.dump, "w").write(sass)
    bodies = loops(sass)
    print(f"{len(bodies)} loops, instructions per body: {[len(b) for b in bodies]}")
    if bodies:
        big = max(bodies, key=len)
        ops = collections.Counter(re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?", "", ln)
                                  .split()[0].split(".")[0] for ln in big)
        print(" ".join(f"{op}:{c}" for op, c in ops.most_common(24)))


if __name__ == "__main__":
    main()
