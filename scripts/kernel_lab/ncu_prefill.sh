#!/usr/bin/env bash
# Stall, pipe and memory metrics of one Gluon prefill tile and the shipped Triton tile, same
# inputs (GPU machine). usage: OUT=dir [KERNELS="regex ..."] bash scripts/kernel_lab/ncu_prefill.sh
# PROJ T TILE (TILE: a lockstep tile, or pp:BM,BK,STAGES[,ORDER[,PERSIST]] for the shipped
# ping-pong one)
set -u
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread,gpu__time_duration.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__cycles_elapsed.avg.per_second'
for k in ${KERNELS:-w4a16_prefill_kernel _w4a16_indexed_kernel}; do
  timeout 150 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 2 --launch-count 1 --metrics "$M" \
    python3 scripts/kernel_lab/gluon_prefill.py --profile "$@" 2>&1 | grep -v "^==PROF==\|Warning" \
    | awk 'NF>=3 && $NF != "0" && $NF != "0.00"' > "$OUT/ncu_${k}${TAG:-}.txt"
done
