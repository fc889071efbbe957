#!/usr/bin/env bash
# Time one plan under variants of the K loop of _w4a16_tile, patched into a scratch copy of
# the kernel (the repo file is restored afterwards): Triton's warp specialization, loop
# unrolling, and `tl.assume(num_steps > 0)` (removes the zero-trip path whose accumulator
# copies make ptxas serialize the 64-row tiles' wgmmas, C7515; see docs/kernel_notes.md).
# usage (repo root, GPU machine):
#   OUT=/tmp/lab [VARIANTS="base assume"] bash scripts/kernel_lab/loop_variants.sh PLAN
set -u
plan=$1
src=kernels/triton_w4a16.py
cp "$src" /tmp/triton_w4a16.orig.py
loop='for _ in range(0, num_steps):'
declare -A variants=(
  [base]="$loop"
  [ws]='for _ in tl.range(0, num_steps, warp_specialize=True):'
  [unroll2]='for _ in tl.range(0, num_steps, loop_unroll_factor=2):'
  [assume]="tl.assume(num_steps > 0)\n    $loop"
)
for name in ${VARIANTS:-base ws unroll2 assume}; do
  cp /tmp/triton_w4a16.orig.py "$src"
  sed -i "s/$loop/${variants[$name]}/" "$src"
  grep -q "${variants[$name]%%\\n*}" "$src" || { echo "== $name: patch did not apply"; continue; }
  echo "== $name"
  OUT=$OUT/$name LAB_BUDGET_S=${LAB_BUDGET_S:-150} python3 scripts/kernel_lab/run_plan.py "$plan" 2>&1 \
    | grep -v Warning | sed 's/ cos=[^ ]*//' | tail -40
done
cp /tmp/triton_w4a16.orig.py "$src"
