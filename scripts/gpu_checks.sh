#!/usr/bin/env bash
# One H200 session: GPU correctness (kernels + fused quantizer), kernel benchmark, convert benchmark.
# Usage (repo root, on the GPU machine):  OUT=/some/dir bash scripts/gpu_checks.sh [all|quick|convert]
#   quick: tests + kernel benchmark; convert: quantizer tests + convert benchmark; all: everything
set -uo pipefail
OUT=${OUT:-/tmp/chordq-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
[ -e chordq/kernels ] || ln -s ../kernels chordq/kernels   # the package-dir mapping, without pip
log() { echo "=== $*" | tee -a "$OUT/summary.txt"; }
log "$(date -u) $(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader)"
python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)" | tee -a "$OUT/summary.txt"
log "pytest gpu"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py 2>&1 | tail -8 | tee "$OUT/pytest_gpu.txt"
MODE=${1:-all}
if [ "$MODE" != convert ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_triton.py 2>&1 | tail -25 | tee -a "$OUT/pytest_gpu.txt"
  log "bench_kernels"
  timeout 200 python3 scripts/bench_kernels.py --out "$OUT/kernels" 2>&1 | tail -40 | tee "$OUT/bench_kernels.txt"
fi
if [ "$MODE" != quick ]; then
  log "bench_convert cuda"
  timeout 330 python3 scripts/bench_convert.py --layers 4 --experts 16 --device cuda --extra-workers 2 --work /tmp/cb --out "$OUT/convert" 2>&1 | tail -14 | tee "$OUT/bench_convert.txt"
fi
log "$(date -u) $(nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader)"
