#!/usr/bin/env bash
# The next session's device calls (README.md here; carry .deps; each ~7-8 minutes on a warm
# machine). The device tool returns at most 8 files from $OUT: the logs go to one tarball
# (logs.tar.gz), the summary to summary.txt (and stdout).
# STAGE=measure (the default). No patch: it measures what run 19 left open, on main, with the
# tuning switches, one library, same process per shape and side (dev/cuda/run_library_ab.sh
# AB_DIR=env):
#   1. the new F1 forms case in full (MOEBLAZE_CUDA_F1_FORM forced both ways: every bit the same),
#      and under memcheck (quick): it must pass before the F1 A/B below means anything;
#   2. mixtral SwiGLU kernel by kernel, moeblaze and the grouped_mm baseline
#      (profile_kernels.py --impl): where the 0.99-1.01x parity comes from;
#   3. F1's epilogue form at 64 k-steps (mixtral; consumers -> warps) and at 32 (conf4);
#   4. v19's tile bands against 8 everywhere on conf4, conf7 and mixtral (chosen on conf3 only);
#   5. B1's split against the epilogue-warp form at 32 k-steps (conf4, conf7, qwen3), where
#      session 14 saw warps 2.4 % faster on conf4.
# STAGE=dg: b1-deferred-dg-shuffles.patch (BEFORE = the working tree, AFTER = + the patch): the
#   B1 forms case in full, the CUDA suite (quick), memcheck and racecheck over the forms case,
#   every output's digest under both libraries (the patch claims the same bits), then B1's times
#   under the default policy, same process per shape: 16 k-steps (conf3 SwiGLU, SiLU, SAVE_ALL;
#   conf2), 8 (conf5, split2), 32 (conf4, split), 64 (mixtral, epilogue warps).
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
work=/tmp/patches_work
rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)
doctest=""
[ -f .deps/doctest/doctest/doctest.h ] && doctest="-DMOEBLAZE_DOCTEST_DIR=$(pwd)/.deps/doctest"
lib=build-device/src/libmoeblaze.so
tests=build-device/tests/moeblaze_tests_cuda
shapes() { python3 dev/cuda/shape_args.py --lines "$@"; }
# ab NAME BEFORE_ENV AFTER_ENV TIMEOUT_S SPEC...: the library under two environments.
ab() {
  local name=$1 before=$2 after=$3 limit=$4
  shift 4
  CHECK=0 AB_DIR=env BEFORE_ENV="$before" AFTER_ENV="$after" OUT="$work/$name" \
    PROFILE_SHAPES="$(shapes "$@")" timeout "$limit" bash dev/cuda/run_library_ab.sh \
    >"$work/$name.log" 2>&1
  echo "== $name: before = ${before:-(defaults)}, after = ${after:-(defaults)} (exit $?)"
  sed -n '/^== per-kernel/,$p' "$work/$name.log" | tail -n +2
}

build_patched() {
  { cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
      -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF $doctest &&
    cmake --build build-device -j 16 --target moeblaze moeblaze_tests_cuda; } >"$work/build.log" 2>&1 ||
    { tail -30 "$work/build.log"; exit 1; }
  echo "build: $(($(date +%s) - t0)) s"
}
run_stage() {
case "${STAGE:-measure}" in
  measure)
    build_patched
    timeout 150 "$tests" --no-version=true -tc="*F1's two epilogue forms*" >"$work/f1_forms.log" 2>&1
    echo "F1 forms case (full): exit $? | $(grep -E '^\[doctest\] (test cases|assertions)' \
      "$work/f1_forms.log" | tr -s ' ' | tr '\n' ' ')"
    MOEBLAZE_TEST_QUICK=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 17 "$tests" \
      --no-version=true -tc="*F1's two epilogue forms*" >"$work/f1_memcheck.log" 2>&1
    echo "memcheck (F1 forms, quick): exit $? | $(grep -E 'ERROR SUMMARY' "$work/f1_memcheck.log" |
      tail -n 1)"

    echo "== mixtral SwiGLU, one step after a synchronise: kernel classes and the largest kernels"
    for impl in moeblaze grouped_mm; do
      # shellcheck disable=SC2046  # the shape's arguments split on purpose
      MOEBLAZE_LIBRARY="$lib" timeout 90 python3 tests/cuda/profile_kernels.py \
        $(python3 dev/cuda/shape_args.py mixtral) --act swiglu --impl "$impl" --rows 14 \
        >"$work/mixtral_$impl.log" 2>&1
      echo "-- $impl: $(grep -E '^fwd\+bwd' "$work/mixtral_$impl.log")"
      grep -E '^kernel classes' "$work/mixtral_$impl.log"
      grep -E '^kernel +[0-9]' "$work/mixtral_$impl.log" | head -14
    done

    ab f1_form "MOEBLAZE_CUDA_F1_FORM=consumers" "MOEBLAZE_CUDA_F1_FORM=warps" 150 \
      mixtral:swiglu mixtral:silu conf4:swiglu
    ab bands "MOEBLAZE_CUDA_BAND_MTILES=8" "" 150 conf4:swiglu conf7:swiglu mixtral:swiglu
    ab b1_k32 "MOEBLAZE_CUDA_B1_FORM=split" "MOEBLAZE_CUDA_B1_FORM=warps" 150 \
      conf4:swiglu conf7:swiglu qwen3-30b-a3b:swiglu
    ;;
  dg)
    rm -rf /tmp/moeblaze_before && mkdir -p /tmp/moeblaze_before
    tar --exclude=./build-device --exclude=./.git -cf - . | tar -xf - -C /tmp/moeblaze_before
    git apply dev/cuda/patches/b1-deferred-dg-shuffles.patch 2>/dev/null ||
      patch -p1 -s <dev/cuda/patches/b1-deferred-dg-shuffles.patch || { echo "does not apply"; exit 1; }
    echo "applied: b1-deferred-dg-shuffles"
    build_patched
    (cd /tmp/moeblaze_before && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DMOEBLAZE_CUDA=ON -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_BUILD_EXAMPLES=OFF \
      -DMOEBLAZE_BUILD_TESTS=OFF >"$work/build_before.log" 2>&1 &&
      cmake --build build-before -j 12 --target moeblaze >>"$work/build_before.log" 2>&1) &
    before_pid=$!
    timeout 150 "$tests" --no-version=true -tc="*B1's epilogue forms*" >"$work/forms_test.log" 2>&1
    echo "B1 forms case (full): exit $? | $(grep -E '^\[doctest\] (test cases|assertions)' \
      "$work/forms_test.log" | tr -s ' ' | tr '\n' ' ')"
    MOEBLAZE_TEST_QUICK=1 timeout 150 "$tests" --no-version=true >"$work/suite.log" 2>&1
    echo "CUDA suite (quick): exit $? | $(grep -E '^\[doctest\] (test cases|assertions)' \
      "$work/suite.log" | tr -s ' ' | tr '\n' ' ')"
    for tool in memcheck racecheck; do
      MOEBLAZE_TEST_QUICK=1 timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 17 \
        "$tests" --no-version=true -tc="*B1's epilogue forms*" >"$work/$tool.log" 2>&1
      echo "$tool (B1 forms, quick): exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
        "$work/$tool.log" | tail -n 1)"
    done
    wait "$before_pid" || { tail -20 "$work/build_before.log"; exit 1; }
    digest_ok=1
    for side in before after; do
      side_lib=$lib
      [ "$side" = before ] && side_lib=/tmp/moeblaze_before/build-before/src/libmoeblaze.so
      MOEBLAZE_LIBRARY="$side_lib" timeout 120 python3 tools/output_digest.py \
        >"$work/digest_$side.txt" 2>&1 || { digest_ok=0; echo "digests ($side): FAILED"; }
    done
    if [ "$digest_ok" = 0 ]; then
      tail -5 "$work/digest_after.txt"
    elif diff "$work/digest_before.txt" "$work/digest_after.txt" >"$work/digest.diff"; then
      echo "digests: $(wc -l <"$work/digest_after.txt") runs, bitwise identical to main"
    else
      echo "digests: DIFFER from main ($(grep -c '^>' "$work/digest.diff") of" \
        "$(wc -l <"$work/digest_after.txt") runs)"
    fi
    CHECK=0 AB_DIR=prebuilt OUT="$work/ab" PROFILE_SHAPES="$(shapes conf3:swiglu conf3:silu \
      conf3:swiglu:--policy=save_all conf2:swiglu conf5:swiglu conf4:swiglu mixtral:swiglu)" \
      timeout 330 bash dev/cuda/run_library_ab.sh >"$work/ab.log" 2>&1
    echo "== B1: before = main, after = + b1-deferred-dg-shuffles (the default policy)"
    sed -n '/^== per-kernel/,$p' "$work/ab.log" | tail -n +2
    ;;
  *) echo "unknown STAGE: ${STAGE}" >&2; exit 2 ;;
esac
echo "total: $(($(date +%s) - t0)) s"
}

run_stage 2>&1 | tee "$out/summary.txt"
status=$?
tar -czf "$out/logs.tar.gz" -C "$work" . 2>/dev/null
exit "$status"
