#!/usr/bin/env bash
# The next session's device calls (README.md here; carry .deps; each ~7-8 minutes on a warm
# machine). The device tool returns at most 8 files from $OUT: the logs go to one tarball
# (logs.tar.gz, refreshed after every step, so a run the tool stops at its limit keeps them), the
# summary to summary.txt (and stdout). The exit status is 1 when any check failed, a digest
# differed or a step timed out; the summary names it (FAILED).
# STAGE=measure (the default). No patch: it measures what run 19 left open, on main, with the
# tuning switches, one library, same process per shape and side (dev/cuda/run_library_ab.sh
# AB_DIR=env):
#   1. the new F1 forms case in full (MOEBLAZE_CUDA_F1_FORM forced both ways: every bit the same),
#      and under memcheck (quick): it must pass before the F1 A/B below means anything;
#   2. mixtral SwiGLU kernel by kernel, moeblaze and the grouped_mm baseline
#      (profile_kernels.py --impl): where the 0.99-1.01x parity comes from;
#   3. F1's epilogue form at 64 k-steps (mixtral; consumers -> warps) and at 32 (conf4), after
#      racecheck over the F1 forms case (quick): the epilogue warps at 33 k-steps are new;
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
failed=0
pack() { tar -czf "$out/logs.tar.gz" -C "$work" . 2>/dev/null; }
# step_result NAME STATUS DETAIL: one summary line; a non-zero status marks the run FAILED.
step_result() {
  local verdict=ok
  [ "$2" = 0 ] || { verdict="FAILED (exit $2)"; failed=1; }
  echo "$1: $verdict | $3"
  pack
}
doctest_counts() { grep -E '^\[doctest\] (test cases|assertions)' "$1" | tr -s ' ' | tr '\n' ' '; }
# The profile_kernels.py lines of SPEC... (NAME:ACT[:EXTRA]); fails on an unknown name rather than
# letting run_library_ab.sh fall back to its default shapes.
shapes() { python3 dev/cuda/shape_args.py --lines "$@"; }
# ab NAME BEFORE_ENV AFTER_ENV TIMEOUT_S SPEC...: the library under two environments.
ab() {
  local name=$1 before=$2 after=$3 limit=$4 lines rc
  shift 4
  lines=$(shapes "$@") || { step_result "$name" 2 "bad shape list: $*"; return; }
  CHECK=0 AB_DIR=env BEFORE_ENV="$before" AFTER_ENV="$after" OUT="$work/$name" \
    PROFILE_SHAPES="$lines" timeout "$limit" bash dev/cuda/run_library_ab.sh \
    >"$work/$name.log" 2>&1
  rc=$?
  echo "== $name: before = ${before:-(defaults)}, after = ${after:-(defaults)}"
  sed -n '/^== per-kernel/,$p' "$work/$name.log" | tail -n +2
  step_result "$name" "$rc" "$(grep -E '^profile failed' "$work/$name.log" | tr '\n' ' ')"
}

build_patched() {
  { cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
      -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF $doctest &&
    cmake --build build-device -j 16 --target moeblaze moeblaze_tests_cuda; } >"$work/build.log" 2>&1 ||
    { tail -30 "$work/build.log"; pack; exit 1; }
  echo "build: $(($(date +%s) - t0)) s"
}
# sanitize TOOL CASE_PATTERN LOG TIMEOUT_S: compute-sanitizer over one CUDA case (quick).
sanitize() {
  MOEBLAZE_TEST_QUICK=1 timeout "$4" compute-sanitizer --tool "$1" --error-exitcode 17 "$tests" \
    --no-version=true -tc="$2" >"$work/$3" 2>&1
  step_result "$1 ($2, quick)" $? "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$work/$3" |
    tail -n 1) | $(doctest_counts "$work/$3")"
}

run_stage() {
case "${STAGE:-measure}" in
  measure)
    build_patched
    timeout 120 "$tests" --no-version=true -tc="*F1's two epilogue forms*" >"$work/f1_forms.log" 2>&1
    step_result "F1 forms case (full)" $? "$(doctest_counts "$work/f1_forms.log")"
    sanitize memcheck "*F1's two epilogue forms*" f1_memcheck.log 90
    sanitize racecheck "*F1's two epilogue forms*" f1_racecheck.log 120

    echo "== mixtral SwiGLU, one step after a synchronise: kernel classes and the largest kernels"
    mixtral_args=$(python3 dev/cuda/shape_args.py mixtral) || { step_result mixtral 2 "no shape"; }
    for impl in moeblaze grouped_mm; do
      # shellcheck disable=SC2086  # the shape's arguments split on purpose
      MOEBLAZE_LIBRARY="$lib" timeout 60 python3 tests/cuda/profile_kernels.py $mixtral_args \
        --act swiglu --impl "$impl" --rows 14 >"$work/mixtral_$impl.log" 2>&1
      rc=$?
      echo "-- $impl: $(grep -E '^fwd\+bwd' "$work/mixtral_$impl.log")"
      grep -E '^kernel classes' "$work/mixtral_$impl.log"
      grep -E '^kernel +[0-9]' "$work/mixtral_$impl.log" | head -14
      step_result "mixtral profile ($impl)" "$rc" ""
    done

    ab f1_form "MOEBLAZE_CUDA_F1_FORM=consumers" "MOEBLAZE_CUDA_F1_FORM=warps" 120 \
      mixtral:swiglu conf4:swiglu
    ab bands "MOEBLAZE_CUDA_BAND_MTILES=8" "" 130 conf4:swiglu conf7:swiglu mixtral:swiglu
    ab b1_k32 "MOEBLAZE_CUDA_B1_FORM=split" "MOEBLAZE_CUDA_B1_FORM=warps" 130 \
      conf4:swiglu conf7:swiglu qwen3-30b-a3b:swiglu
    ;;
  dg)
    rm -rf /tmp/moeblaze_before && mkdir -p /tmp/moeblaze_before
    tar --exclude=./build-device --exclude=./.git -cf - . | tar -xf - -C /tmp/moeblaze_before
    git apply dev/cuda/patches/b1-deferred-dg-shuffles.patch 2>/dev/null ||
      patch -p1 -s <dev/cuda/patches/b1-deferred-dg-shuffles.patch || { echo "does not apply"; exit 1; }
    echo "applied: b1-deferred-dg-shuffles"
    build_patched
    # Session 15's measure stage saw mixtral's F2 and B4 ~10 % faster at band 8 than at v19's
    # band 1 (band 8 ran first there): the other order here. F2 and B4 do not run B1's code.
    ab bands_mixtral "" "MOEBLAZE_CUDA_BAND_MTILES=8" 100 mixtral:swiglu mixtral:silu
    (cd /tmp/moeblaze_before && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DMOEBLAZE_CUDA=ON -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_BUILD_EXAMPLES=OFF \
      -DMOEBLAZE_BUILD_TESTS=OFF >"$work/build_before.log" 2>&1 &&
      cmake --build build-before -j 12 --target moeblaze >>"$work/build_before.log" 2>&1) &
    before_pid=$!
    timeout 120 "$tests" --no-version=true -tc="*B1's epilogue forms*" >"$work/forms_test.log" 2>&1
    step_result "B1 forms case (full)" $? "$(doctest_counts "$work/forms_test.log")"
    MOEBLAZE_TEST_QUICK=1 timeout 150 "$tests" --no-version=true >"$work/suite.log" 2>&1
    step_result "CUDA suite (quick)" $? "$(doctest_counts "$work/suite.log")"
    sanitize memcheck "*B1's epilogue forms*" memcheck.log 100
    sanitize racecheck "*B1's epilogue forms*" racecheck.log 120
    wait "$before_pid" || { tail -20 "$work/build_before.log"; pack; exit 1; }
    # The patch claims every output's bits: each library's digests (stdout; stderr apart, so a
    # warning from one library cannot read as a difference), then the two compared.
    for side in before after; do
      side_lib=$lib
      [ "$side" = before ] && side_lib=/tmp/moeblaze_before/build-before/src/libmoeblaze.so
      MOEBLAZE_LIBRARY="$side_lib" timeout 120 python3 tools/output_digest.py \
        >"$work/digest_$side.txt" 2>"$work/digest_$side.err"
      rc=$?
      [ "$rc" = 0 ] || step_result "digests ($side library)" "$rc" "$(tail -3 "$work/digest_$side.err")"
    done
    if [ -s "$work/digest_before.txt" ] && [ -s "$work/digest_after.txt" ]; then
      diff "$work/digest_before.txt" "$work/digest_after.txt" >"$work/digest.diff"
      step_result "digests, patch against main" $? \
        "$(wc -l <"$work/digest_after.txt") runs; $(grep -c '^>' "$work/digest.diff") differ"
    fi
    CHECK=0 AB_DIR=prebuilt OUT="$work/ab" PROFILE_SHAPES="$(shapes conf3:swiglu conf3:silu \
      conf5:swiglu conf4:swiglu mixtral:swiglu)" \
      timeout 330 bash dev/cuda/run_library_ab.sh >"$work/ab.log" 2>&1
    rc=$?
    echo "== B1: before = main, after = + b1-deferred-dg-shuffles (the default policy)"
    sed -n '/^== per-kernel/,$p' "$work/ab.log" | tail -n +2
    step_result "A/B" "$rc" "$(grep -E '^profile failed' "$work/ab.log" | tr '\n' ' ')"
    ;;
  *) echo "unknown STAGE: ${STAGE}" >&2; exit 2 ;;
esac
echo "total: $(($(date +%s) - t0)) s"
[ "$failed" = 0 ] || { echo "FAILED: see the lines marked FAILED above"; return 1; }
}

run_stage 2>&1 | tee "$out/summary.txt"
status=$?
pack
exit "$status"
