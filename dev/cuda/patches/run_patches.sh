#!/usr/bin/env bash
# One device call for the patches in this folder (README.md here): their CPU-side models, then every
# patch applied to the tree, then dev/cuda/run_library_ab.sh: tools/device_check.sh on the patched
# tree (CUDA suite with the sm90 kernels and without, EP suite, CPU suite, memcheck and racecheck
# over the CUDA suite, memcheck over the EP suite) and per-kernel times of the patched library
# against the unpatched sm90 sources (.ab) on the shapes below. The summary and table come last.
#   bash dev/cuda/patches/run_patches.sh       (carry .deps; ~7 minutes)
#   PATCHES="b3-staged-epilogue" bash dev/cuda/patches/run_patches.sh    (a subset)
# Each patch touches its own files (b3-staged-epilogue: src/cuda/sm90/wgrad_gemm.cu;
# ep-cuda-loss-shares: src/ep/, tests/ep/, docs), so the suites tell them apart: the CUDA suite and
# the B2/B3 times judge the first, the EP suite the second. The patches stay applied in the
# device's copy of the tree; land each here (git apply) only if its checks passed.
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
export MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a}"
here=dev/cuda/patches
python3 "$here/b3_staged_epilogue_model.py" || exit 1
mkdir -p .ab && rm -f .ab/* && cp src/cuda/sm90/wgrad_gemm.cu .ab/  # BEFORE: the tree as it is
for name in ${PATCHES:-b3-staged-epilogue ep-cuda-loss-shares}; do
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$name.patch" 2>/dev/null; then
    git apply "$here/$name.patch"
  else
    patch -p1 -s <"$here/$name.patch" || { echo "$name: does not apply"; exit 1; }
  fi
  echo "applied: $name"
done
PROFILE_SHAPES="${PROFILE_SHAPES:-mixtral swiglu|--T 16384 --d 4096 --h 14336 --E 8 --k 2 --act swiglu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
conf7 swiglu|--T 8192 --d 2048 --h 8192 --E 8 --k 4 --act swiglu
conf3 swiglu|--act swiglu
qwen3 swiglu|--T 16384 --d 2048 --h 768 --E 128 --k 8 --act swiglu}" \
  OUT="$out" AB_DIR=.ab bash dev/cuda/run_library_ab.sh
# The EP suite's verdict and its loss-share cases (aux != 0), for ep-cuda-loss-shares.
echo "== EP CUDA suite (patched):"
sed -n '/===== EP CUDA suite/,/^exit status/p' "$out/check/tests.log" 2>/dev/null |
  grep -E "case: .*aux=0\.0[12]|test cases|assertions|ERROR|FAILED|^exit status" | head -24
