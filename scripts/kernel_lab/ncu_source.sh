#!/usr/bin/env bash
# Per-instruction warp-stall samples (SASS) of one kernel under Nsight Compute (GPU machine):
# the CSV to $OUT/ncu_source_<kernel>.csv and its 40 most-sampled instructions on stdout.
# usage: OUT=dir bash scripts/kernel_lab/ncu_source.sh KERNEL_REGEX python3 SCRIPT ARGS...
set -u
k=$1; shift
f="$OUT/ncu_source_${k//[^A-Za-z0-9_]/_}.csv"
timeout 200 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 2 --launch-count 1 --section SourceCounters \
  --page source --csv --print-source sass "$@" 2>/dev/null | grep -v "^==PROF==" > "$f"
python3 - "$f" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
if not rows:
    sys.exit("no rows")
print("columns:", ", ".join(rows[0])[:600])
key = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
tot = sum(float(r[key] or 0) for r in rows)
reasons = [c for c in rows[0] if c.startswith("stall_") or "Stall" in c and c != key]
for r in sorted(rows, key=lambda r: -float(r[key] or 0))[:40]:
    print(f"{100 * float(r[key] or 0) / tot:5.1f}% {r.get('Address', '')} {r.get('Source', '')[:90]}")
PY
