#!/usr/bin/env bash
# The device calls for the patch in this folder (README.md here), one STAGE per call (carry .deps;
# the summary and tables last, logs under $OUT).
#   STAGE=ab (the default, ~7-8 minutes): BEFORE = the working tree (main); AFTER = it +
#     b1-four-epilogue-warps.patch. The AFTER library and CUDA tests are built and checked (the
#     B1-forms case in full, then memcheck and racecheck over it, quick) while the BEFORE library
#     builds beside them; then B1's per-kernel times of both libraries under the default policy,
#     same process per shape (run_library_ab.sh AB_DIR=prebuilt): the split form at 16 k-steps
#     (conf3 SwiGLU and SiLU) and 32 (conf4), split2 at 8 (conf5), the epilogue-warp form at 64
#     (mixtral); then, on the patched library with the forms forced, split2 against split at 8
#     k-steps (conf5) and the split against the epilogue-warp form at 16 (conf3).
#   STAGE=ncu (~3 minutes): the patch applied, tools/ncu_kernels.sh --act swiglu on conf3 (the
#     stall samples by code region at the end: which side of B1 waits with four epilogue warps).
# The patch stays applied in the device's copy of the tree; land it here (git apply) only if its
# checks passed and it gains.
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
here=dev/cuda/patches
apply() {
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$1.patch" 2>/dev/null; then
    git apply "$here/$1.patch"
  else
    patch -p1 -s <"$here/$1.patch" || { echo "$1: does not apply"; exit 1; }
  fi
  echo "applied: $1"
}
doctest=""
[ -f .deps/doctest/doctest/doctest.h ] && doctest="-DMOEBLAZE_DOCTEST_DIR=$(pwd)/.deps/doctest"
build_after() {
  { cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
      -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF $doctest &&
    cmake --build build-device -j 16 --target moeblaze "$@"; } >"$out/build.log" 2>&1 ||
    { tail -30 "$out/build.log"; exit 1; }
}
# The patched library under two forced B1 forms, same process per shape (run_library_ab.sh
# AB_DIR=env): forms_ab NAME BEFORE_FORM AFTER_FORM TIMEOUT_S SHAPES.
forms_ab() {
  CHECK=0 AB_DIR=env BEFORE_ENV="MOEBLAZE_CUDA_B1_FORM=$2" AFTER_ENV="MOEBLAZE_CUDA_B1_FORM=$3" \
    OUT="$out/$1" PROFILE_SHAPES="$5" timeout "$4" bash dev/cuda/run_library_ab.sh \
    >"$out/$1.log" 2>&1
  echo "== patched, $1: before = MOEBLAZE_CUDA_B1_FORM=$2, after = $3"
  sed -n '/^== per-kernel/,$p' "$out/$1.log"
}
t0=$(date +%s)
case "${STAGE:-ab}" in
  ab)
    rm -rf /tmp/moeblaze_before && mkdir -p /tmp/moeblaze_before
    tar --exclude=./build-device --exclude=./.git -cf - . | tar -xf - -C /tmp/moeblaze_before
    apply b1-four-epilogue-warps
    build_after moeblaze_tests_cuda
    echo "after build: $(($(date +%s) - t0)) s"
    (cd /tmp/moeblaze_before && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DMOEBLAZE_CUDA=ON -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_BUILD_EXAMPLES=OFF \
      -DMOEBLAZE_BUILD_TESTS=OFF >"$out/build_before.log" 2>&1 &&
      cmake --build build-before -j 12 --target moeblaze >>"$out/build_before.log" 2>&1) &
    before_pid=$!
    tests=build-device/tests/moeblaze_tests_cuda
    timeout 150 "$tests" --no-version=true -tc='*epilogue forms*' >"$out/forms_test.log" 2>&1
    echo "forms test (full): exit $? | $(grep -E '^\[doctest\] (test cases|assertions)' \
      "$out/forms_test.log" | tr -s ' ' | tr '\n' ' ')"
    for tool in memcheck racecheck; do
      MOEBLAZE_TEST_QUICK=1 timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 17 \
        "$tests" --no-version=true -tc='*epilogue forms*' >"$out/$tool.log" 2>&1
      echo "$tool (B1 forms, quick): exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
        "$out/$tool.log" | tail -n 1) | $(grep -E '^\[doctest\] test cases' "$out/$tool.log")"
    done
    wait "$before_pid" || { tail -20 "$out/build_before.log"; exit 1; }
    echo "before build done at $(($(date +%s) - t0)) s"
    CHECK=0 AB_DIR=prebuilt OUT="$out/ab" PROFILE_SHAPES="conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu
mixtral swiglu|--T 16384 --d 4096 --h 14336 --E 8 --k 2 --act swiglu" \
      timeout 300 bash dev/cuda/run_library_ab.sh >"$out/ab.log" 2>&1
    echo "== B1: before = main, after = + b1-four-epilogue-warps (the default policy)"
    sed -n '/^== per-kernel/,$p' "$out/ab.log"
    # With four epilogue warps the balance between the forms moves: the patched library, forms
    # forced (same process per shape). 8 k-steps: split2 (the policy) against split; 16: the
    # split (the policy) against the epilogue-warp form.
    forms_ab k8 split2 split 60 "conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu"
    forms_ab k16 split warps 70 "conf3 swiglu|--act swiglu"
    ;;
  ncu)
    apply b1-four-epilogue-warps
    build_after
    OUT="$out/ncu" NCU_TIMEOUT=110 MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so \
      timeout 150 bash tools/ncu_kernels.sh --act swiglu >"$out/ncu_table.txt" 2>&1
    echo "== Nsight Compute, conf3 SwiGLU, B1 with four epilogue warps (the split form)"
    grep -E "^metric|gpu__time_duration|dram__bytes_(read|write).sum.per_second|sm__throughput" \
      "$out/ncu_table.txt"
    sed -n '/stall samples by code region/,$p' "$out/ncu_table.txt"
    ;;
  *) echo "unknown STAGE: ${STAGE}" >&2; exit 2 ;;
esac
echo "total: $(($(date +%s) - t0)) s"
