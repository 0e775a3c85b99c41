#!/usr/bin/env bash
# One device call for the patches in this folder (README.md here): their CPU-side models, the
# patches applied to the tree, then dev/cuda/run_library_ab.sh: tools/device_check.sh on the
# patched tree (CUDA suite with the sm90 kernels and without, EP suite, CPU suite, memcheck and
# racecheck over the CUDA suite, memcheck over the EP suite) and per-kernel times of the patched
# library against the unpatched sources (.ab) on the shapes below. The summary and table come last.
#   bash dev/cuda/patches/run_patches.sh       (carry .deps; ~8-9 minutes)
#   CHECK=0 bash dev/cuda/patches/run_patches.sh   (times only, no suites or sanitizers; ~4 min)
# b1-epilogue-pipelined (src/cuda/sm90/rows_gemm.cu) is judged by B1's time per shape and the
# CUDA suite's da/db/dg checks; k1-direct-rows (experts.cu, gemm.cuh, rows_gemm.cu/.hpp, ...) by
# the new "k = 1 direct rows" test case, the EP suite (its expert side runs with k = 1) and conf1's
# F2, B4 and token_reduce times; gather-lean (wgrad_gemm.cu, primitives.cuh) by B2's and B3's
# times (F1's and B1's gather change by a few instructions) and every gathered GEMM's checks. They
# apply together in any order. The patches stay applied in
# the device's copy of the tree; land each here (git apply) only if its checks passed.
#   PATCHES="k1-direct-rows" bash dev/cuda/patches/run_patches.sh    (a subset)
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
export MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a}"
here=dev/cuda/patches
python3 dev/cuda/b1_epilogue_warps_model.py || exit 1
# BEFORE: the tree as it is (every CUDA source the patches touch: all of src/cuda).
rm -rf .ab && mkdir -p .ab/src && cp -r src/cuda .ab/src/
for name in ${PATCHES:-b1-epilogue-pipelined k1-direct-rows gather-lean}; do
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$name.patch" 2>/dev/null; then
    git apply "$here/$name.patch"
  else
    patch -p1 -s <"$here/$name.patch" || { echo "$name: does not apply"; exit 1; }
  fi
  echo "applied: $name"
done
# One shape per k-step class of B1's tiles (d / 64): 8 (conf1), 16 (conf3, both activations),
# 32 (conf4, qwen3), 64 (mixtral); conf1 is also the k = 1 shape for direct rows. (~100 s; the
# call stays under the 600 s limit: add shapes with CHECK=0.)
PROFILE_SHAPES="${PROFILE_SHAPES:-conf1 swiglu|--T 65536 --d 512 --h 2048 --E 4 --k 1 --act swiglu
conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
qwen3 swiglu|--T 16384 --d 2048 --h 768 --E 128 --k 8 --act swiglu
mixtral swiglu|--T 16384 --d 4096 --h 14336 --E 8 --k 2 --act swiglu}" \
  OUT="$out" AB_DIR=.ab bash dev/cuda/run_library_ab.sh
echo "== token reductions and zero_dropped (profiler, a step), from profile.log:"
awk '/^=== /{shape=$0} /token_reduce|zero_dropped/{print shape ": " $0}' "$out/profile.log" |
  sed -E 's/ +/ /g' | cut -c1-170
