#!/usr/bin/env bash
# One device call: the F1 epilogue-warp patches (README.md here), in order, each applied to the
# tree, built, put through the CUDA / EP / CPU suites and compute-sanitizer (memcheck, racecheck)
# by tools/device_check.sh; the first whose summary has no FAIL is kept applied and its per-kernel
# times measured (tests/cuda/profile_kernels.py via dev/cuda/run_library_ab.sh, AB_DIR=none).
#   bash dev/cuda/patches/run_f1_patches.sh     (carry .deps; ~4-7 minutes; the verdict last)
# Logs under $OUT/<variant>/. VARIANTS overrides the order (patch names without .patch).
set -u -o pipefail
out="${OUT:-./f1_patches_out}"
mkdir -p "$out"
export MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a}"
# apply_patch FILE, apply_patch -R FILE: git apply, or patch(1) where the machine has no git.
apply_patch() {
  if command -v git >/dev/null 2>&1; then
    git apply "$@"
  elif [ "$1" = -R ]; then
    patch -p1 -s -R <"$2"
  else
    patch -p1 -s <"$1"
  fi
}
kept=""
for v in ${VARIANTS:-f1-epilogue-warps f1-epilogue-warps-named-barriers}; do
  patch_file="dev/cuda/patches/$v.patch"
  apply_patch "$patch_file" || { echo "$v: does not apply"; continue; }
  OUT="$out/$v" bash tools/device_check.sh --no-bench --no-sass --no-profile >"$out/$v.log" 2>&1
  summary=$(sed -n '/device_check summary/,$p' "$out/$v.log")
  echo "== $v"
  echo "$summary" | tail -n +2
  if [ -n "$summary" ] && ! echo "$summary" | grep -q FAIL; then
    kept="$v"
    break
  fi
  apply_patch -R "$patch_file"
done
if [ -n "$kept" ]; then
  echo "== kept: $kept (applied in this tree); per-kernel times:"
  OUT="$out/profile" CHECK=0 AB_DIR=none bash dev/cuda/run_library_ab.sh 2>&1 | tail -6
else
  echo "== no variant passed every check: the library's F1 stays as it is"
fi
