#!/usr/bin/env bash
# One device call for the patches in this folder (README.md here): their CPU-side models, the
# patches applied to the tree, then dev/cuda/run_library_ab.sh: tools/device_check.sh on the
# patched tree (CUDA suite with the sm90 kernels and without, EP suite, CPU suite, memcheck and
# racecheck over the CUDA suite, memcheck over the EP suite) and per-kernel times of the patched
# library against the unpatched sources (.ab) on the shapes below. The summary and table come last.
#   bash dev/cuda/patches/run_patches.sh       (carry .deps; ~7 minutes)
# b1-epilogue-warps touches src/cuda/sm90/rows_gemm.cu, judged by B1's time and the CUDA suite's
# da/db/dg checks (mixtral, d > 2048, keeps the 4-stage form: not profiled). The patches stay
# applied in the device's copy of the tree; land each here (git apply) only if its checks passed.
#   PATCHES="b1-epilogue-warps" bash dev/cuda/patches/run_patches.sh    (a subset)
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
export MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a}"
here=dev/cuda/patches
python3 "$here/b1_epilogue_warps_model.py" || exit 1
# BEFORE: the tree as it is (the files the patches touch).
rm -rf .ab && mkdir -p .ab/src/cuda && cp src/cuda/sm90/rows_gemm.cu .ab/ &&
  cp src/cuda/experts.cu .ab/src/cuda/
for name in ${PATCHES:-b1-epilogue-warps}; do
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$name.patch" 2>/dev/null; then
    git apply "$here/$name.patch"
  else
    patch -p1 -s <"$here/$name.patch" || { echo "$name: does not apply"; exit 1; }
  fi
  echo "applied: $name"
done
PROFILE_SHAPES="${PROFILE_SHAPES:-conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
conf7 swiglu|--T 8192 --d 2048 --h 8192 --E 8 --k 4 --act swiglu
qwen3 swiglu|--T 16384 --d 2048 --h 768 --E 128 --k 8 --act swiglu}" \
  OUT="$out" AB_DIR=.ab bash dev/cuda/run_library_ab.sh
