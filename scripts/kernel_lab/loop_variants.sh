#!/usr/bin/env bash
# Time one plan under variants of the K loop of _w4a16_tile, patched into a scratch copy of
# the kernel (the repo file is untouched): Triton's warp specialization and loop unrolling.
# usage (repo root, GPU machine): OUT=/tmp/lab bash scripts/kernel_lab/loop_variants.sh PLAN
set -u
plan=$1
src=kernels/triton_w4a16.py
cp "$src" /tmp/triton_w4a16.orig.py
loop='for _ in range(0, num_steps):'
declare -A variants=(
  [base]="$loop"
  [ws]='for _ in tl.range(0, num_steps, warp_specialize=True):'
  [unroll2]='for _ in tl.range(0, num_steps, loop_unroll_factor=2):'
)
for name in base ws unroll2; do
  cp /tmp/triton_w4a16.orig.py "$src"
  sed -i "s/$loop/${variants[$name]}/" "$src"
  echo "== $name"
  OUT=$OUT/$name LAB_BUDGET_S=150 python3 scripts/kernel_lab/run_plan.py "$plan" 2>&1 \
    | grep -v Warning | sed 's/ cos=[^ ]*//' | tail -12
done
cp /tmp/triton_w4a16.orig.py "$src"
