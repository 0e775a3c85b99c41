#!/usr/bin/env bash
# THE main job.
#   - Without a GPU: builds only the CPU library and examples/c/train_moe in its own build folder
#     ($MOEBLAZE_BUILD_DIR-main-cpu; needs cmake and g++, installs nothing else, no Python
#     environment) and trains the C example on the CPU backend (SGD on one MoE layer; fails if the
#     loss does not fall). A few minutes on 2 cores.
#   - With a GPU (nvidia-smi -L lists one): sets up and builds everything like scripts/test.sh
#     (without its Python environment), then, with a Python whose torch sees the GPU, the benchmark
#     bench/run_bench.py (moeblaze vs the PyTorch baselines; results in bench/results/); with no
#     such Python, examples/c/train_moe on the CUDA backend.
#
#   bash scripts/run.sh [arguments for the job, e.g. --steps 1000 or --configs conf1 --quick]
set -uo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOEBLAZE_ROOT" || exit 1

total_start=$SECONDS
has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  has_gpu=1
  nvidia-smi -L
fi

if ((!has_gpu)); then
  echo "no GPU: the C training example on the CPU backend (CPU-only build in $MOEBLAZE_MAIN_CPU_BUILD_DIR)"
  mb_phase setup mb_setup_packages "${MOEBLAZE_MAIN_APT_PACKAGES[@]}" || mb_fail_phases
  mb_phase configure mb_configure_main_cpu || mb_fail_phases
  mb_phase build mb_build_main_cpu || mb_fail_phases
  status=0
  mb_phase train "$MOEBLAZE_MAIN_CPU_BUILD_DIR/examples/c/train_moe" --backend cpu "$@" || status=1
  mb_print_phases
  echo "  total        $((SECONDS - total_start))s"
  exit $status
fi

mb_phase setup mb_setup_packages || mb_fail_phases
mb_phase configure mb_configure || mb_fail_phases
mb_phase build mb_build || mb_fail_phases

# A Python whose torch can use the GPU.
torch_python=""
for py in python3 /usr/bin/python3 python; do
  if command -v "$py" >/dev/null 2>&1 &&
    "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    torch_python="$(command -v "$py")"
    break
  fi
done

library="$(ls "$MOEBLAZE_BUILD_DIR"/src/libmoeblaze.so.[0-9]* 2>/dev/null | head -n 1)"
run_bench() {
  MOEBLAZE_LIBRARY="$library" PYTHONPATH="$MOEBLAZE_ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$torch_python" "$MOEBLAZE_ROOT/bench/run_bench.py" "$@"
}

status=0
if [[ -n "$torch_python" && -f bench/run_bench.py ]]; then
  echo "GPU found; benchmark with $torch_python ($("$torch_python" -c 'import torch; print(torch.__version__)'))"
  mb_phase benchmark run_bench "$@" || status=1
else
  echo "GPU found but no Python with CUDA-enabled torch: training example on the CUDA backend"
  mb_phase train "$MOEBLAZE_BUILD_DIR/examples/c/train_moe" --backend cuda "$@" || status=1
fi

mb_print_phases
echo "  total        $((SECONDS - total_start))s"
exit $status
