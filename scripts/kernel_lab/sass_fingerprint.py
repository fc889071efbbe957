"""Fingerprint the sm_90 SASS of every Gluon build the dispatch can reach, on any machine (no GPU).

For refactors meant to change no behaviour: fingerprint before, change, fingerprint again with
``--against`` the first file. Equal SASS text (offsets and registers included) means the GPU runs
the same instructions, so the change needs no device time. Use the GPU machine's Triton (3.6:
``pip install --target /tmp/t36 triton==3.6.0``, then ``PYTHONPATH=/tmp/t36:$PWD``); a build is
deterministic for one Triton, not across versions.

usage: python scripts/kernel_lab/sass_fingerprint.py OUT.json [--against BASE.json] [-k TEXT]
"""

import argparse
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import sass as sass_lab  # this folder's sm_90 build of the Triton kernels
import triton
from chordq.kernels import gluon_prefill, gluon_w4a16
from chordq.kernels.triton_config import GLUON_PREFILL_TILES, GLUON_PREFILL_WIDE_TILES


def builds():
    """``{name: thunk}``: every prefill block size and form (256-row and wide), plain and
    fused, with and without stream-K (2: its 32-bit walk), the unordered 96-row tile, the decode tile on 8-, 16-
    and 32-row blocks, its stream-K form and the Triton stream-K kernel."""
    out = {}
    for (bm, tile), gated, sk in itertools.product(GLUON_PREFILL_TILES.items(), (False, True),
                                                  (False, True, 2)):
        forms = [(1, tile)] + ([(2, GLUON_PREFILL_WIDE_TILES[bm])]
                               if bm in GLUON_PREFILL_WIDE_TILES else [])
        for halves, t in forms:
            kw = {"block_m": bm, "num_stages": t.num_stages, "gated": gated, "stream_k": sk,
                  "halves": halves}
            out["prefill " + ",".join(f"{k}={v}" for k, v in kw.items())] = (
                lambda kw=kw: gluon_prefill.compile_sm90(**kw))
    out["prefill block_m=96,order=False"] = lambda: gluon_prefill.compile_sm90(order=False)
    for bm, gated in itertools.product((8, 16, 32), (False, True)):
        out[f"decode block_m={bm},gated={gated}"] = (
            lambda bm=bm, gated=gated: gluon_w4a16.compile_sm90(gated=gated, block_m=bm))
    for sk, gated in itertools.product((2, 4), (False, True)):
        out[f"decode stream_k={sk},gated={gated}"] = (
            lambda sk=sk, gated=gated: gluon_w4a16.compile_sm90(gated=gated, stream_k=sk))
    for (bm, bn), gated in itertools.product(((16, 64), (32, 128)), (False, True)):
        out[f"triton stream_k block_m={bm},block_n={bn},gated={gated}"] = (
            lambda bm=bm, bn=bn, gated=gated: sass_lab.compile_kernel(
                bm, bn, 256, 4, 3, "subnormal", gated, stream_k=True))
    return out


def sass(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return "\n".join(line for line in text.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--against", help="an earlier fingerprint file: report builds that differ")
    ap.add_argument("-k", default="", help="only builds whose name contains this")
    args = ap.parse_args()
    prints = {}
    for name, build in builds().items():
        if args.k in name:
            text = sass(build())
            prints[name] = [hashlib.sha1(text.encode()).hexdigest()[:16], text.count("\n") + 1]
            print(name, *prints[name], flush=True)
    with open(args.out, "w") as f:
        json.dump({"triton": triton.__version__, "builds": prints}, f, indent=1)
    if not args.against:
        return 0
    with open(args.against) as f:
        base = json.load(f)
    if base["triton"] != triton.__version__:
        print(f"{args.against} was built by Triton {base['triton']}, this by "
              f"{triton.__version__}: not comparable", file=sys.stderr)
        return 2
    differ = [n for n in prints if base["builds"].get(n) != prints[n]]
    print(f"{len(prints) - len(differ)} of {len(prints)} builds the same SASS as {args.against}"
          + "".join(f"\n  differs: {n}" for n in differ))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
