#!/usr/bin/env bash
# Time two or more copies of kernels/ against Humming, one process each, interleaved in rounds.
# Usage (repo root, GPU machine): OUT=dir bash scripts/kernel_lab/ab_kernels.sh kernels oldk [...]
#   Make an old copy with: git archive COMMIT kernels | tar -x -C /tmp && cp -r /tmp/kernels oldk
#   AB_ARGS: extra flags for bench_kernels.py (default: TP8, 5 token counts, graphs only)
#   AB_ROUNDS: rounds over the copies (default 1). Each copy's table: $OUT/<copy>.r<round>/
set -uo pipefail
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
WHL=${HUMMING_WHEEL:-$(ls .whl/humming_kernels-*.whl | tail -1)}
ARGS=${AB_ARGS:---layouts TP8 --tokens 1 20 512 2048 8192 --no-do-bench --no-fused --reps 3}
for r in $(seq 1 "${AB_ROUNDS:-1}"); do
  for v in "$@"; do
    ln -sfn "../$v" chordq/kernels
    timeout 150 python3 scripts/bench_kernels.py --against humming --humming-wheel "$WHL" \
      --humming-target /tmp/hum $ARGS --out "$OUT/$v.r$r" > "$OUT/$v.r$r.txt" 2>&1
    echo "=== $v round $r exit $? $(nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader)"
    grep "^| [ET]P8" "$OUT/$v.r$r/bench_humming.md" | cut -d'|' -f2-6,9-12
  done
done
ln -sfn ../kernels chordq/kernels
