#!/usr/bin/env bash
# The next session's first device call (README.md here; carry .deps; ~8 minutes on a warm
# machine). No patch: it measures what run 19 left open, on main, with the tuning switches, one
# library, same process per shape and side (dev/cuda/run_library_ab.sh AB_DIR=env):
#   1. the new F1 forms case in full (MOEBLAZE_CUDA_F1_FORM forced both ways: every bit the same),
#      and under memcheck (quick): it must pass before the F1 A/B below means anything;
#   2. mixtral SwiGLU kernel by kernel, moeblaze and the grouped_mm baseline
#      (profile_kernels.py --impl): where the 0.99-1.01x parity comes from;
#   3. F1's epilogue form at 64 k-steps (mixtral; consumers -> warps) and at 32 (conf4);
#   4. v19's tile bands against 8 everywhere on conf4, conf7 and mixtral (chosen on conf3 only);
#   5. B1's split against the epilogue-warp form at 32 k-steps (conf4, conf7, qwen3), where
#      session 14 saw warps 2.4 % faster on conf4.
# The device tool returns at most 8 files from $OUT: the logs go to one tarball, the summary to
# summary.txt (and stdout).
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
finish() {
  tar -czf "$out/logs.tar.gz" -C "$work" . 2>/dev/null
  echo "total: $(($(date +%s) - t0)) s"
}
trap finish EXIT
exec > >(tee "$out/summary.txt") 2>&1
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

{ cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
    -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF $doctest &&
  cmake --build build-device -j 16 --target moeblaze moeblaze_tests_cuda; } >"$work/build.log" 2>&1 ||
  { tail -30 "$work/build.log"; exit 1; }
echo "build: $(($(date +%s) - t0)) s"

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
