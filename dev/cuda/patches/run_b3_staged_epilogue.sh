#!/usr/bin/env bash
# One device call: b3-staged-epilogue.patch (README.md here) applied to the tree, then
# dev/cuda/run_library_ab.sh: tools/device_check.sh on the patched tree (CUDA suite with the sm90
# kernels and without, EP and CPU suites, memcheck, racecheck), a BEFORE build of the unpatched
# wgrad_gemm.cu, and per-kernel times of both on the shapes below. The verdict table comes last.
#   bash dev/cuda/patches/run_b3_staged_epilogue.sh     (carry .deps; ~6-7 minutes)
# The patch stays applied in this tree (the device's copy): commit it here only if every check
# passed and B3 is faster.
set -u -o pipefail
out="${OUT:-./b3_patch_out}"
mkdir -p "$out"
export MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a}"
python3 dev/cuda/patches/b3_staged_epilogue_model.py || exit 1
mkdir -p .ab && rm -f .ab/* && cp src/cuda/sm90/wgrad_gemm.cu .ab/  # BEFORE: the tree as it is
if command -v git >/dev/null 2>&1 && git apply --check dev/cuda/patches/b3-staged-epilogue.patch; then
  git apply dev/cuda/patches/b3-staged-epilogue.patch
else
  patch -p1 -s <dev/cuda/patches/b3-staged-epilogue.patch || { echo "patch does not apply"; exit 1; }
fi
PROFILE_SHAPES='mixtral swiglu|--T 16384 --d 4096 --h 14336 --E 8 --k 2 --act swiglu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
conf7 swiglu|--T 8192 --d 2048 --h 8192 --E 8 --k 4 --act swiglu
conf3 swiglu|--act swiglu
qwen3 swiglu|--T 16384 --d 2048 --h 768 --E 128 --k 8 --act swiglu' \
  OUT="$out" AB_DIR=.ab bash dev/cuda/run_library_ab.sh
