#!/usr/bin/env bash
# Warp-stall reasons, occupancy limits, pipe use and DRAM and L2 throughput of the CUDA C++
# W4A16 kernels (csrc/w4a16_mma.cu, csrc/w4a16_wgmma.cu) under Nsight Compute, on an NVIDIA
# machine whose runtime lets ncu read the counters: one launch per (M, layer, variant, rows per
# block, kernel) of scripts/profile_w4a16_mma.py (rows omitted: the kernel's choice; kernel
# mma, the default, or wgmma).
#   scripts/ncu_w4a16_mma.sh ["M LAYER VARIANT [ROWS [KERNEL]]" ...]
#   (default: "1 gate_up 0" "8 gate_up 0")
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # as gpu_check.sh: gguf for the imports
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
metrics="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
metrics+=",sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
metrics+=",launch__registers_per_thread,launch__occupancy_limit_registers"
metrics+=",launch__occupancy_limit_shared_mem,lts__throughput.avg.pct_of_peak_sustained_elapsed"
metrics+=",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",smsp__issue_active.avg.pct_of_peak_sustained_active"
metrics+=",l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"
for stall in long_scoreboard barrier short_scoreboard math_pipe_throttle lg_throttle \
             mio_throttle wait not_selected selected dispatch_stall no_instruction membar \
             tex_throttle imc_miss drain sleeping branch_resolving; do
  metrics+=",smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio"
done
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=("1 gate_up 0" "8 gate_up 0")
for cfg in "${configs[@]}"; do
  read -r m layer variant rows kernel <<< "$cfg"
  echo "== M=$m $layer variant $variant rows ${rows:-chosen} kernel ${kernel:-mma}"
  # --clock-control none: leave the clocks as they are (the device notes say why).
  timeout 120 ncu --clock-control none -k "regex:rows_kernel|wgmma_kernel" --launch-skip 3 \
    --launch-count 1 --metrics "$metrics" python3 scripts/profile_w4a16_mma.py --m "$m" \
    --layer "$layer" --variant "$variant" ${rows:+--rows "$rows"} ${kernel:+--kernel "$kernel"} 2>&1 | grep -E "^\s+(gpu__|dram__|sm__|smsp__|launch__|lts__|l1tex__)" \
    | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
done
