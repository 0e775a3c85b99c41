#!/usr/bin/env bash
# One device call for the patches in this folder (README.md here): the patches applied to the
# tree, then dev/cuda/run_library_ab.sh: tools/device_check.sh on the patched tree (CUDA suite with
# the sm90 kernels and without, EP suite, CPU suite, memcheck and racecheck over the CUDA suite,
# memcheck over the EP suite) and per-kernel times of the patched library against the unpatched
# sources (.ab) on the shapes below. The summary and table come last.
#   bash dev/cuda/patches/run_patches.sh            (carry .deps; ~8-9 minutes)
#   CHECK=0 bash dev/cuda/patches/run_patches.sh    (times only, no suites or sanitizers; ~4 min)
#   PATCHES="warp-uniform" bash dev/cuda/patches/run_patches.sh    (one of the two)
#   STAGE=b1-epi-min bash dev/cuda/patches/run_patches.sh   (a second, short call; ~4 min;
#     once the patches have landed: PATCHES= STAGE=b1-epi-min ..., an empty list applies none)
# STAGE=b1-epi-min: with the patches applied to both sides, B1's epilogue-warp form from
# MIN_KTILES k-steps (kB1EpiWarpsMinKTiles 17 -> MIN_KTILES, default 1) against today's bound,
# times only, on the d <= 1024 shapes: 16 k-steps (conf2, conf3, conf6) and 8 (conf5). The README
# here says why the two patches may move that bound.
# The patches stay applied in the device's copy of the tree; land each here (git apply) only if
# its checks passed.
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
export MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a}"
here=dev/cuda/patches
# BEFORE: the tree as it is (every CUDA source the patches touch: all of src/cuda).
rm -rf .ab && mkdir -p .ab/src && cp -r src/cuda .ab/src/
for name in ${PATCHES-warp-uniform epilogue-lean}; do
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$name.patch" 2>/dev/null; then
    git apply "$here/$name.patch"
  else
    patch -p1 -s <"$here/$name.patch" || { echo "$name: does not apply"; exit 1; }
  fi
  echo "applied: $name"
done
if [ "${STAGE:-patches}" = b1-epi-min ]; then
  rm -rf .ab && mkdir -p .ab/src && cp -r src/cuda .ab/src/  # BEFORE: patched, bound 17
  grep -q '^constexpr int kB1EpiWarpsMinKTiles = 17;' src/cuda/sm90/rows_gemm.cu ||
    { echo "kB1EpiWarpsMinKTiles is not 17 here"; exit 1; }
  min="${MIN_KTILES:-1}"
  sed -i "s/^constexpr int kB1EpiWarpsMinKTiles = 17;/constexpr int kB1EpiWarpsMinKTiles = $min;/" \
    src/cuda/sm90/rows_gemm.cu
  echo "AFTER: kB1EpiWarpsMinKTiles = $min"
  PROFILE_SHAPES="conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf2 swiglu|--T 65536 --d 1024 --h 4096 --E 8 --k 2 --act swiglu
conf6 swiglu|--T 16384 --d 1024 --h 4096 --E 16 --k 4 --act swiglu
conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu" \
    CHECK=0 OUT="$out" AB_DIR=.ab bash dev/cuda/run_library_ab.sh
  exit $?
fi
# One shape per k-step class of B1's tiles (d / 64): 8 (conf1), 16 (conf3, both activations),
# 32 (conf4, qwen3), 64 (mixtral); every gathered kernel runs on each. (~100 s; the call stays
# under the 600 s limit: add shapes with CHECK=0.)
PROFILE_SHAPES="${PROFILE_SHAPES:-conf1 swiglu|--T 65536 --d 512 --h 2048 --E 4 --k 1 --act swiglu
conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
qwen3 swiglu|--T 16384 --d 2048 --h 768 --E 128 --k 8 --act swiglu
mixtral swiglu|--T 16384 --d 4096 --h 14336 --E 8 --k 2 --act swiglu}" \
  OUT="$out" AB_DIR=.ab bash dev/cuda/run_library_ab.sh
