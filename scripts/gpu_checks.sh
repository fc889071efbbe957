#!/usr/bin/env bash
# One H200 session: GPU correctness (kernels + fused quantizer), kernel benchmark, convert benchmark.
# Usage (repo root, on the GPU machine):  OUT=/some/dir bash scripts/gpu_checks.sh [MODE]
#   quick: tests + kernel benchmark; convert: quantizer tests + convert benchmark; all: everything
#   humming: chordq vs humming-kernels side by side, EP8, T = 1..8192 (no tests; ~5-7 min)
#   humming-tp8: the same at TP8 shapes (384 experts)
#   ab: the same-process A/Bs of switches built but off (bench --alt; each row's verdict decided
#       before it ran, bench_humming.alt_verdict), after their GPU tests (~8 min); everything
#       lands in $OUT/summary.txt and $OUT/ab.tgz (the device returns at most 8 files)
#   The humming modes need the wheel: HUMMING_WHEEL=path, else the newest .whl/humming_kernels-*.whl
#   (carry .whl to the GPU machine); extra flags for scripts/bench_kernels.py in HUMMING_ARGS.
set -uo pipefail
OUT=${OUT:-/tmp/chordq-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
[ -e chordq/kernels ] || ln -s ../kernels chordq/kernels   # the package-dir mapping, without pip
log() { echo "=== $*" | tee -a "$OUT/summary.txt"; }
log "$(date -u) $(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader)"
python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)" | tee -a "$OUT/summary.txt"
MODE=${1:-all}
WHL=${HUMMING_WHEEL:-$(ls .whl/humming_kernels-*.whl 2>/dev/null | tail -1)}  # ab, humming*
case "$MODE" in
  ab)
    AB=$(mktemp -d)
    B() {  # B NAME MINUTES ARGS..: one bench process, its alt lines into the summary
      local name=$1 minutes=$2; shift 2
      log "ab $name: $*"
      timeout $((minutes * 60 + 90)) python3 scripts/bench_kernels.py --against humming \
        ${WHL:+--humming-wheel "$WHL"} --no-do-bench --no-fused --max-minutes "$minutes" \
        --out "$AB/$name" "$@" > "$AB/$name.txt" 2>&1
      log "ab $name exit $?"
      grep -A40 "^chordq alt" "$AB/$name/bench_humming.md" 2>/dev/null | grep "^- \|^alt verdicts" \
        | tee -a "$OUT/summary.txt"
      grep -A30 "^Failures" "$AB/$name/bench_humming.md" 2>/dev/null | tee -a "$OUT/summary.txt"
    }
    log "pytest: the switches' GPU tests (halved 16-row decode blocks, stream-K walks)"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gluon.py \
      tests/test_kernels_gluon_prefill.py -k "halved or stream_k" 2>&1 | tail -15 \
      | tee -a "$OUT/summary.txt"
    # variant 63 where rows per expert are in (4, 6]: TP8 gate_up T=256; T=128 a control
    B h0 2 --layouts TP8 EP8 --tokens 32 128 256 --alt GLUON_DECODE_HALVE_RPE=4.0,6.0
    # stream-K on the 96- and 128-row tiles (gate_up 1-5% ahead across three processes)
    B s0 3 --layouts EP8 TP8 --tokens 512 1024 2048 8192 --alt GLUON_PREFILL_STREAM_K_ROWS=64,96,128
    # the 8-row decode tile's stream-K at 2-2.6 expected waves (EP8 gate_up T=8)
    B d0 1 --layouts EP8 --tokens 8 20 --alt GLUON_STREAM_K_WAVES=0.9,1.25,2.0,2.6
    # variant 64, the 32-bit walk, on the shipped 64-row stream-K row (EP8 down T=256)
    B w32 1 --layouts EP8 --tokens 256 --alt GLUON_PREFILL_STREAM_K_WALK32_ROWS=64
    tar czf "$OUT/ab.tgz" -C "$AB" .
    log "$(date -u) $(nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader)"
    exit 0
    ;;
  humming|humming-tp8)
    LAYOUT=EP8; [ "$MODE" = humming-tp8 ] && LAYOUT=TP8
    log "bench_kernels --against humming --layouts $LAYOUT (wheel: ${WHL:-none found})"
    # --max-minutes: start no new shape after 6 min; rows already measured are written as they finish
    timeout 460 python3 scripts/bench_kernels.py --against humming ${WHL:+--humming-wheel "$WHL"} \
      --layouts "$LAYOUT" --max-minutes 6 --out "$OUT/$MODE" ${HUMMING_ARGS:-} > "$OUT/$MODE.txt" 2>&1
    rc=$?
    tail -45 "$OUT/$MODE.txt"
    log "bench_kernels --against humming exit $rc (0 ok, 1 cos_diff failure, 2 Humming side missing, 124 timeout)"
    log "$(date -u) $(nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader)"
    exit 0
    ;;
esac
log "pytest gpu"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py 2>&1 | tail -8 | tee "$OUT/pytest_gpu.txt"
if [ "$MODE" != convert ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_triton.py tests/test_kernels_gluon.py tests/test_kernels_gluon_prefill.py 2>&1 | tail -25 | tee -a "$OUT/pytest_gpu.txt"
  log "bench_kernels"
  timeout 200 python3 scripts/bench_kernels.py --out "$OUT/kernels" 2>&1 | tail -40 | tee "$OUT/bench_kernels.txt"
fi
if [ "$MODE" != quick ]; then
  log "bench_convert cuda"
  timeout 330 python3 scripts/bench_convert.py --layers 4 --experts 16 --device cuda --extra-workers 2 --work /tmp/cb --out "$OUT/convert" 2>&1 | tail -14 | tee "$OUT/bench_convert.txt"
fi
log "$(date -u) $(nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader)"
