#!/usr/bin/env bash
# Every kernel of one experts forward + backward under Nsight Compute with the GPU's clocks
# locked at base (--clock-control base), for moeblaze or a peer on the same inputs: each kernel's
# time, instructions and L2 / DRAM bytes (tools/ncu_step_table.py), so a kernel's cycles are seen
# apart from the power limit's clock differences (the benchmark's sm_mhz and joules fields), and
# the work that costs energy (instructions, bytes) beside them.
# Run from the repository root on a GPU machine with a built library:
#   MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so bash tools/ncu_step_times.sh \
#       [tests/cuda/profile_kernels.py arguments,
#        e.g. --impl sonicmoe $(python3 tools/shape_args.py qwen3-30b-a3b)]
# profile_kernels.py --profiler-range warms up (3 steps; SonicMoE compiles its kernels there), then
# runs the one step ncu sees. Kernels are listed in launch order with their GEMM tag, then the
# sums by tag and by class and the total; the raw CSV is ${OUT:-./ncu_step_times_out}/times.csv.
set -u -o pipefail
out="${OUT:-./ncu_step_times_out}"
mkdir -p "$out"
: "${MOEBLAZE_LIBRARY:?set MOEBLAZE_LIBRARY to the built libmoeblaze.so}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
metrics=gpu__time_duration.sum,smsp__inst_executed.sum,lts__t_bytes.sum
metrics=$metrics,dram__bytes_read.sum,dram__bytes_write.sum
timeout "${NCU_TIMEOUT:-400}" ncu --profile-from-start off --clock-control base \
  --metrics "$metrics" --csv python3 tests/cuda/profile_kernels.py --profiler-range "$@" \
  >"$out/times.csv" 2>"$out/ncu.log"
echo "ncu rc=$?"
python3 "$here/ncu_step_table.py" "$out/times.csv"
