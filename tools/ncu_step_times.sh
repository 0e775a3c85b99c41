#!/usr/bin/env bash
# Every kernel of one experts forward + backward, timed by Nsight Compute with the GPU's clocks
# locked at base (--clock-control base), for moeblaze or a peer on the same inputs: which GEMM is
# slower at equal clocks. Under the power limit the clocks differ between implementations (the
# benchmark's sm_mhz and joules fields), so this separates a kernel's cycles from its energy.
# Run from the repository root on a GPU machine with a built library:
#   MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so bash tools/ncu_step_times.sh \
#       [tests/cuda/profile_kernels.py arguments, e.g. --impl sonicmoe $(python3 tools/shape_args.py qwen3-30b-a3b)]
# profile_kernels.py --profiler-range warms up (3 steps; SonicMoE compiles its kernels there), then
# runs the one step ncu sees. Kernels are listed in launch order with their GEMM tag, then the
# total; the raw CSV is ${OUT:-./ncu_step_times_out}/times.csv.
set -u -o pipefail
out="${OUT:-./ncu_step_times_out}"
mkdir -p "$out"
: "${MOEBLAZE_LIBRARY:?set MOEBLAZE_LIBRARY to the built libmoeblaze.so}"
timeout "${NCU_TIMEOUT:-400}" ncu --profile-from-start off --clock-control base \
  --metrics gpu__time_duration.sum --csv \
  python3 tests/cuda/profile_kernels.py --profiler-range "$@" >"$out/times.csv" 2>"$out/ncu.log"
echo "ncu rc=$?"
python3 - "$out/times.csv" <<'EOF'
import csv, sys
sys.path.insert(0, "tools")
from kernel_tags import kernel_tag
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 2:
    sys.exit("no kernel times (see ncu.log)")
header, data = rows[0], rows[1:]
name, value, unit = (header.index(c) for c in ("Kernel Name", "Metric Value", "Metric Unit"))
scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
total = 0.0
for r in data:
    ms = float(r[value].replace(",", "")) * scale[r[unit]]
    total += ms
    print("%9.3f ms  %-3s %s" % (ms, kernel_tag(r[name]) or "-", r[name][:100]))
print("%9.3f ms  total of %d kernels (clocks locked at base)" % (total, len(data)))
EOF
