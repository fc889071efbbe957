"""Compile one indexed W4A16 config for sm_90 on any machine (no GPU) and summarize its SASS.

Prints the instruction count of each loop body (a backward branch closes one), the opcode
histogram of the longest, the wgmma waits in it (``gsb0, 0x0``: wait for all; ``0x1``: one
group kept in flight), and ptxas's own verdict on the PTX (registers, and "C7515 Potential
Performance Loss: wgmma.mma_async instructions are serialized ..." with its reason), so
variants can be compared before spending GPU time. Triton and ptxas here may be newer than on
the GPU machine: compare variants, not absolute counts.

usage: python scripts/kernel_lab/sass.py BM BN BK WARPS STAGES K_ORDER [GATED] [N_TILES]
       [--maxnreg R] [--stream-k] [--dump FILE]
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


def compile_kernel(bm, bn, bk, warps, stages, k_order, gated=False, n_tiles=1, maxnreg=None,
                   stream_k=False):
    wide = n_tiles > 1
    fn = (tw._w4a16_indexed_wide_kernel if wide else tw._w4a16_indexed_streamk_kernel
          if stream_k else tw._w4a16_indexed_kernel)
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16",
            "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "ntp_ptr": "*i32",
            "parts_ptr": "*fp32", "arrivals_ptr": "*i32"}
    consts = dict(TOP_K=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_ORDER=K_ORDERS.index(k_order),
                  EVEN_N=True, COMPUTE_F32=False)
    if wide:
        consts.update(N_TILES=n_tiles, GATED=False)
    elif stream_k:
        consts.update(GATED=gated)
    else:
        consts.update(GATED=gated, SPLIT_K=1)
    for param in fn.params:  # constexprs left at their defaults (else they'd compile as i32)
        if param.is_constexpr and param.name not in consts and param.has_default:
            consts[param.name] = param.default
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else ptrs.get(name, "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v
                                                      for c, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)


def sass_of(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    return subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                          check=True).stdout


def ptxas_verdict(kernel) -> list[str]:
    """ptxas -v on the kernel's PTX: register count and wgmma serialization warnings (the
    bundled ``ptxas-blackwell`` also targets sm_90a and reads newer PTX than ``ptxas``)."""
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(kernel.asm["ptx"])
        for name in ("ptxas-blackwell", "ptxas"):
            r = subprocess.run([_tool(name), "-arch=sm_90a", "-v", ptx, "-o",
                                os.path.join(d, "k.cubin")], capture_output=True, text=True)
            if r.returncode == 0:
                break
    lines = (r.stdout + r.stderr).splitlines()
    return [re.sub(r"^ptxas\S*\s+info\s+:\s+", "", ln).split(" in the function")[0]
            for ln in lines if "Performance Loss" in ln or "Used" in ln or "fatal" in ln]


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


def summary(kernel, sass: str | None = None) -> list[str]:
    """Loop lengths, the longest loop's opcode histogram and wgmma waits, and ptxas's verdict."""
    bodies = loops(sass_of(kernel) if sass is None else sass)
    lines = [f"{len(bodies)} loops, instructions per body: {[len(b) for b in bodies]}"]
    if bodies:
        big = max(bodies, key=len)
        ops = collections.Counter(re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?", "", ln)
                                  .split()[0].split(".")[0] for ln in big)
        lines.append(" ".join(f"{op}:{c}" for op, c in ops.most_common(24)))
        body = "\n".join(big)
        lines.append(f"wgmma waits in the loop: {body.count('gsb0, 0x0')} for all, "
                     f"{body.count('gsb0, 0x1')} keeping one group in flight")
    return lines + ["ptxas: " + line for line in ptxas_verdict(kernel)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cfg", nargs="+")
    ap.add_argument("--dump")
    ap.add_argument("--maxnreg", type=int)
    ap.add_argument("--stream-k", action="store_true", help="the stream-K kernel")
    a = ap.parse_args()
    bm, bn, bk, warps, stages = (int(v) for v in a.cfg[:5])
    gated = len(a.cfg) > 6 and a.cfg[6] == "1"
    n_tiles = int(a.cfg[7]) if len(a.cfg) > 7 else 1
    kernel = compile_kernel(bm, bn, bk, warps, stages, a.cfg[5], gated, n_tiles, a.maxnreg,
                            a.stream_k)
    sass = sass_of(kernel)
    if a.dump:
        open(a.dump, "w").write(sass)
    print("\n".join(summary(kernel, sass)))


if __name__ == "__main__":
    main()
