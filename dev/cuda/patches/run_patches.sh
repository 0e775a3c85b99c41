#!/usr/bin/env bash
# The device calls for the patches in this folder (README.md here), one STAGE per call (each
# ~5-8 minutes; carry .deps). Every stage runs dev/cuda/run_b1_forms.sh on the patched tree: the
# build, the CUDA suite, the B1-forms test case under memcheck and racecheck, then B1's per-kernel
# times of two variants on the shapes below, same process per shape. Summary and tables last;
# logs under $OUT.
#   STAGE=split2 (the default): b1-split2.patch; the split form against split2, both forced by
#     MOEBLAZE_CUDA_B1_FORM on one library; the consumers' form against split2 at 8 k-steps
#     (conf5, conf1); then (NCU=0 skips it) Nsight Compute on conf3 with the default policy (the
#     split form): which side of B1 waits now.
#   STAGE=early: b1-split2.patch on both sides, b1-split-early-loads.patch on the AFTER side; both
#     in the form MOEBLAZE_CUDA_B1_FORM names if exported (e.g. split2 if call 1 adopted it),
#     else the policy.
# The patches stay applied in the device's copy of the tree; land each here (git apply) only if
# its checks passed and it gains.
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
# 16 k-steps a B1 tile (conf2, conf3, conf6) and 32 (conf4, qwen3): the split forms' range.
export FORMS_SHAPES="${FORMS_SHAPES:-conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf2 swiglu|--T 65536 --d 1024 --h 4096 --E 8 --k 2 --act swiglu
conf6 swiglu|--T 16384 --d 1024 --h 4096 --E 16 --k 4 --act swiglu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
qwen3 swiglu|--T 32768 --d 2048 --h 768 --E 128 --k 8 --act swiglu}"
case "${STAGE:-split2}" in
  split2)
    apply b1-split2
    BEFORE_FORM=split AFTER_FORM=split2 OUT="$out/forms" timeout 360 \
      bash dev/cuda/run_b1_forms.sh
    # 8 k-steps (d = 512), where the policy runs the consumers' form: does split2 pay there too?
    CHECK=0 AB_DIR=env BEFORE_ENV=MOEBLAZE_CUDA_B1_FORM=consumers \
      AFTER_ENV=MOEBLAZE_CUDA_B1_FORM=split2 OUT="$out/short" \
      PROFILE_SHAPES="conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu
conf1 swiglu|--T 65536 --d 512 --h 2048 --E 4 --k 1 --act swiglu" \
      timeout 90 bash dev/cuda/run_library_ab.sh >"$out/short.log" 2>&1
    echo "== B1, 8 k-steps: before = MOEBLAZE_CUDA_B1_FORM=consumers, after = split2"
    sed -n '/^== per-kernel/,$p' "$out/short.log"
    if [ "${NCU:-1}" = 1 ]; then
      OUT="$out/ncu" NCU_TIMEOUT=110 MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so \
        timeout 150 bash tools/ncu_kernels.sh --act swiglu >"$out/ncu_table.txt" 2>&1
      echo "== Nsight Compute, conf3 SwiGLU, the default policy (B1 in the split form)"
      grep -E "^metric|gpu__time_duration|dram__bytes_(read|write).sum.per_second|sm__throughput" \
        "$out/ncu_table.txt"
      sed -n '/top stall locations/,$p' "$out/ncu_table.txt" |
        grep -A7 "sm90_rows_kernel<__nv_bfloat16, (int)2"
    fi
    ;;
  early)
    apply b1-split2
    rm -rf .ab && mkdir -p .ab && cp src/cuda/sm90/rows_gemm.cu .ab/
    apply b1-split-early-loads
    AB_DIR=.ab OUT="$out/early" timeout 560 bash dev/cuda/run_b1_forms.sh
    ;;
  s12)
    # Session 12, one call: the working tree already holds b1-split2 with the consumers' dg write
    # fixed (a split writes part 0 alone). BEFORE = that tree; AFTER = it + b1-split-early-loads.
    # The AFTER build is checked (the B1-forms case in full, memcheck and racecheck quick), the
    # BEFORE library builds meanwhile; then split vs split2 at 8 k-steps (the AFTER library) and
    # the early-loads A/B under the policy (the split form at 16 k-steps).
    rm -rf .ab /tmp/moeblaze_before && mkdir -p .ab && cp src/cuda/sm90/rows_gemm.cu .ab/
    tar --exclude=./build-device --exclude=./.git -cf - . | (mkdir -p /tmp/moeblaze_before &&
      tar -xf - -C /tmp/moeblaze_before)
    apply b1-split-early-loads
    doctest="-DMOEBLAZE_DOCTEST_DIR=$(pwd)/.deps/doctest"
    t0=$(date +%s)
    { cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
        -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF $doctest &&
      cmake --build build-device -j 16 --target moeblaze moeblaze_tests_cuda; } \
      >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
    echo "after build: $(( $(date +%s) - t0 )) s"
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
    CHECK=0 AB_DIR=env BEFORE_ENV=MOEBLAZE_CUDA_B1_FORM=split \
      AFTER_ENV=MOEBLAZE_CUDA_B1_FORM=split2 OUT="$out/k8" \
      PROFILE_SHAPES="conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu
conf1 swiglu|--T 65536 --d 512 --h 2048 --E 4 --k 1 --act swiglu" \
      timeout 100 bash dev/cuda/run_library_ab.sh >"$out/k8.log" 2>&1
    echo "== B1, 8 k-steps, early loads in: before = MOEBLAZE_CUDA_B1_FORM=split, after = split2"
    sed -n '/^== per-kernel/,$p' "$out/k8.log"
    wait "$before_pid" || { tail -20 "$out/build_before.log"; exit 1; }
    echo "before build done at $(( $(date +%s) - t0 )) s"
    # run_library_ab's BEFORE build is ours (same sources): point it at /tmp/moeblaze_before.
    CHECK=0 AB_DIR=prebuilt OUT="$out/early" PROFILE_SHAPES="conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf2 swiglu|--T 65536 --d 1024 --h 4096 --E 8 --k 2 --act swiglu
conf6 swiglu|--T 16384 --d 1024 --h 4096 --E 16 --k 4 --act swiglu" \
      timeout 200 bash dev/cuda/run_library_ab.sh >"$out/early.log" 2>&1
    echo "== B1 early loads: before = split2 fixed (policy), after = + early loads (policy)"
    sed -n '/^== per-kernel/,$p' "$out/early.log"
    ;;
  *) echo "unknown STAGE: ${STAGE}" >&2; exit 2 ;;
esac
