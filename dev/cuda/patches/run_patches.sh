#!/usr/bin/env bash
# One device call for the patches in this folder (README.md here): the patches applied to the
# tree, then dev/cuda/run_library_ab.sh: tools/device_check.sh on the patched tree (CUDA suite with
# the sm90 kernels and without, EP suite, CPU suite, memcheck and racecheck over the CUDA suite,
# memcheck over the EP suite) and per-kernel times of the patched library against the unpatched
# sources (.ab) on the shapes below, same process per shape. The summary and table come last.
#   bash dev/cuda/patches/run_patches.sh            (carry .deps; ~7 minutes)
#   CHECK=0 bash dev/cuda/patches/run_patches.sh    (times only, no suites or sanitizers; ~3 min)
#   PATCHES="rows-warp-index" bash dev/cuda/patches/run_patches.sh   (a subset; the default: all)
# The patches stay applied in the device's copy of the tree; land each here (git apply) only if
# its checks passed.
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
export MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a}"
here=dev/cuda/patches
# BEFORE: the tree as it is (every CUDA source the patches touch: all of src/cuda).
rm -rf .ab && mkdir -p .ab/src && cp -r src/cuda .ab/src/
for name in ${PATCHES-rows-warp-index}; do
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$name.patch" 2>/dev/null; then
    git apply "$here/$name.patch"
  else
    patch -p1 -s <"$here/$name.patch" || { echo "$name: does not apply"; exit 1; }
  fi
  echo "applied: $name"
done
# B4 (K = 2h, MN-major B) on the shapes where v15 moved it (conf4, mixtral) and where it did not
# (conf3, qwen3); B1's 4-stage form (d <= 512: 8 k-steps) on conf1 and conf5; F2 and the rest as
# controls.
PROFILE_SHAPES="${PROFILE_SHAPES:-conf1 swiglu|--T 65536 --d 512 --h 2048 --E 4 --k 1 --act swiglu
conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu
conf3 swiglu|--act swiglu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
qwen3 swiglu|--T 16384 --d 2048 --h 768 --E 128 --k 8 --act swiglu
mixtral swiglu|--T 16384 --d 4096 --h 14336 --E 8 --k 2 --act swiglu}" \
  OUT="$out" AB_DIR=.ab bash dev/cuda/run_library_ab.sh
