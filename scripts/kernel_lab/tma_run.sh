#!/usr/bin/env bash
# Variant 35 on the H200 (kernel_notes): the Gluon prefill tile with its words by TMA
# (patches/tma_words.patch), checked and timed against the shipped tile in one process.
# Usage (repo root, GPU machine, .whl carried): OUT=dir bash scripts/kernel_lab/tma_run.sh PHASE
#   tests: every GPU test of the three kernel files on the shipped kernels (~4 min)
#   tma:   apply the patch (the shipped file kept as gluon_prefill_base, a 224-register copy as
#          gluon_prefill_r224), the prefill tile's GPU tests on it, then the lab at 96 rows
#          (T = 512 2048 8192) with Humming alongside (~6 min)
#   tmatests, tmalab: the two halves of tma, to fit a call's 10 minutes next to tests
#   ab:    the 2x2 of words by TMA or cp.async and 216 or 224 consumer registers, 96 rows at
#          T = 512-8192, then 48 rows (4, 6 slots) and 64 (4, 5; 6 is over 227 KB of shared
#          memory) by TMA or not at 43 rows per expert (~7 min)
#   tma64: as tma, the 64-row form at 43 rows per expert (EP8 T=256; TP8 gate_up T=2048
#          comes with T=2048's rows), where the Triton 64-row tile is still 1.27-1.37x Humming
# Each phase starts from the carried tree: run one phase per call, or tests then tma in one.
set -uo pipefail
OUT=${OUT:-/tmp/tma}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
[ -e chordq/kernels ] || ln -s ../kernels chordq/kernels
smi() { nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
echo "=== $(date -u) $(smi)"
tests() {
  timeout "${1:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu "${@:2}" 2>&1 | tail -12
}
patch_tma() {
  [ -e kernels/gluon_prefill_base.py ] && return 0
  cp kernels/gluon_prefill.py kernels/gluon_prefill_base.py
  git apply scripts/kernel_lab/patches/tma_words.patch || { echo "patch failed"; exit 1; }
  sed 's/^CONSUMER_REGS = 216/CONSUMER_REGS = 224/' kernels/gluon_prefill.py \
    > kernels/gluon_prefill_r224.py
}
lab() {  # $1: PREFILL_PP tiles, $2: token counts (or layout/T rows)
  GLUON_HUMMING=.whl PREFILL_AB="${AB:-gluon_prefill_base gluon_prefill_r224}" PREFILL_TILES="" \
    PREFILL_PP="$1" PREFILL_T="$2" timeout "${LAB_TIMEOUT:-290}" \
    python3 scripts/kernel_lab/gluon_prefill.py > "$OUT/lab_${1//[ ,]/_}.txt" 2>&1
  echo "lab exit $?"; tail -60 "$OUT/lab_${1//[ ,]/_}.txt"
}
for phase in "$@"; do
  echo "=== phase $phase"
  case "$phase" in
    tests) tests 300 tests/test_kernels_triton.py tests/test_kernels_gluon.py \
             tests/test_kernels_gluon_prefill.py | tee "$OUT/tests.txt" ;;
    tma) patch_tma; tests 150 tests/test_kernels_gluon_prefill.py | tee "$OUT/tma_tests.txt"
         lab "96,128,4,1,1" "${TMA_T:-512 2048 8192}" ;;
    tmatests) patch_tma; tests 150 tests/test_kernels_gluon_prefill.py | tee "$OUT/tma_tests.txt" ;;
    tmalab) patch_tma; lab "96,128,4,1,1" "${TMA_T:-512 2048 8192}" ;;
    ab) patch_tma  # four copies: pp (TMA, 216), base (216), b224, r224 (TMA, 224)
        sed 's/^CONSUMER_REGS = 216/CONSUMER_REGS = 224/' kernels/gluon_prefill_base.py \
          > kernels/gluon_prefill_b224.py
        export AB="gluon_prefill_base gluon_prefill_b224 gluon_prefill_r224"
        lab "96,128,4,1,1" "512 1024 2048 8192"
        AB=gluon_prefill_base lab "48,128,4,1,1 48,128,6,1,1 64,128,4,1,1 64,128,5,1,1" \
          "EP8/256 TP8/2048" ;;
    tma64) patch_tma; lab "64,128,4,1,1" "${TMA_T:-256}" ;;
    *) echo "unknown phase $phase (tests, tma, tmatests, tmalab, ab, tma64)"; exit 2 ;;
  esac
  echo "=== $(date -u) $(smi)"
done
