#!/usr/bin/env bash
# Expert parallelism on a machine with several GPUs, in one script run, after a build by
# tools/device_check.sh (which also runs the C suite moeblaze_tests_ep_cuda at every world size the
# visible GPUs allow):
#   1. the PyTorch NCCL test (bindings/python/tests/test_distributed.py) at the world sizes
#      2, 4, 8 that fit the visible GPUs, against the one-GPU layer on the global batch;
#   2. the weak-scaling benchmark (bench/ep_weak_scaling.py) at W = 1 and every world size that fits,
#      balanced and Zipf-skewed routing, moeblaze against the all_to_all + _grouped_mm baseline.
# Logs and the benchmark's JSON go to $OUT; a short summary is printed last.
#
# Usage: tools/ep_multi_gpu_check.sh [--reps N]     (BUILD_DIR defaults to build-device)
# NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and the like).
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/ep-check-out}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-device}"
REPS=5
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS="$2"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOEBLAZE_LIBRARY="$BUILD_DIR/src/libmoeblaze.so"
mkdir -p "$OUT"
cd "$ROOT" || exit 1
[ -f "$MOEBLAZE_LIBRARY" ] || { echo "no $MOEBLAZE_LIBRARY: run tools/device_check.sh first" >&2; exit 1; }

gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
worlds=""
for w in 2 4 8; do [ "$w" -le "$gpus" ] && worlds="${worlds:+$worlds,}$w"; done
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-28s %-8s %s' "$1" "$2" "$3")"); }

if [ -z "$worlds" ]; then
  note "pytorch nccl test" "SKIP" "$gpus GPU(s) visible"
else
  MOEBLAZE_TEST_DIST_BACKEND=nccl MOEBLAZE_TEST_DIST_WORLDS="$worlds" PYTHONUNBUFFERED=1 \
    timeout 420 python3 -m pytest -q -rA bindings/python/tests/test_distributed.py >"$OUT/pytest_nccl.log" 2>&1
  st=$?
  note "pytorch nccl test W=$worlds" "$([ $st = 0 ] && echo OK || echo FAIL)" \
    "$(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest_nccl.log" | tail -n 1)"
fi

mkdir -p "$OUT/bench"
PYTHONUNBUFFERED=1 timeout 420 python3 bench/ep_weak_scaling.py --out "$OUT/bench" \
  --worlds "1${worlds:+,$worlds}" --reps "$REPS" --skew >"$OUT/weak_scaling.log" 2>&1
st=$?
note "weak scaling W=1${worlds:+,$worlds}" "$([ $st = 0 ] && echo OK || echo FAIL)" "see weak_scaling.log"
tail -n 30 "$OUT/weak_scaling.log"
echo
echo "==== ep_multi_gpu_check summary ($gpus GPU(s)) ===="
for line in "${SUMMARY[@]}"; do echo "$line"; done
