#!/usr/bin/env bash
# THE main job. Sets up and builds like scripts/test.sh, then:
#   - with a GPU (nvidia-smi -L lists one) and a Python whose torch sees it: the benchmark,
#     bench/run_bench.py (moeblaze vs the PyTorch baselines; results in bench/results/);
#   - with a GPU but no CUDA torch: examples/c/train_moe on the CUDA backend;
#   - otherwise: examples/c/train_moe on the CPU backend (SGD on one MoE layer; fails if the loss
#     does not fall).
#
#   bash scripts/run.sh [arguments for the job, e.g. --steps 1000 or --configs conf1 --quick]
set -uo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOEBLAZE_ROOT" || exit 1

total_start=$SECONDS
mb_phase setup mb_setup_packages || exit 1
mb_phase configure mb_configure || exit 1
mb_phase build mb_build || exit 1

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  has_gpu=1
  nvidia-smi -L
fi

# A Python whose torch can use the GPU.
torch_python=""
if ((has_gpu)); then
  for py in python3 /usr/bin/python3 python; do
    if command -v "$py" >/dev/null 2>&1 &&
      "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      torch_python="$(command -v "$py")"
      break
    fi
  done
fi

library="$(ls "$MOEBLAZE_BUILD_DIR"/src/libmoeblaze.so.[0-9]* 2>/dev/null | head -n 1)"
train="$MOEBLAZE_BUILD_DIR/examples/c/train_moe"
run_bench() {
  MOEBLAZE_LIBRARY="$library" PYTHONPATH="$MOEBLAZE_ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$torch_python" "$MOEBLAZE_ROOT/bench/run_bench.py" "$@"
}

status=0
if ((has_gpu)) && [[ -n "$torch_python" && -f bench/run_bench.py ]]; then
  echo "GPU found; benchmark with $torch_python ($("$torch_python" -c 'import torch; print(torch.__version__)'))"
  mb_phase benchmark run_bench "$@" || status=1
elif ((has_gpu)); then
  echo "GPU found but no Python with CUDA-enabled torch: training example on the CUDA backend"
  mb_phase train "$train" --backend cuda "$@" || status=1
else
  echo "no GPU: training example on the CPU backend"
  mb_phase train "$train" --backend cpu "$@" || status=1
fi

mb_print_phases
echo "  total        $((SECONDS - total_start))s"
exit $status
