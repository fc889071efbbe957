#!/usr/bin/env bash
# Issue-stall and pipe metrics of one indexed GEMM config under Nsight Compute (GPU machine).
# usage: OUT=dir bash scripts/kernel_lab/ncu.sh NAME PROJ T BM BN BK WARPS STAGES K_ORDER [SPLIT [MAXREG]]
set -u
name=$1; shift
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,gpu__time_duration.sum,smsp__inst_executed.sum,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active'
timeout 120 ncu --clock-control none --kernel-name regex:_w4a16_indexed --launch-skip 2 --launch-count 1 --metrics "$M" \
  python3 scripts/kernel_lab/profile_one.py "$@" 2>&1 | grep -v "^==PROF==\|Warning" \
  | awk 'NF>=3 && $NF != "0" && $NF != "0.00"' > "$OUT/ncu_$name.txt"
