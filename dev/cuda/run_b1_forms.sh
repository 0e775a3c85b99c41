#!/usr/bin/env bash
# One device call for B1's epilogue forms (rows_gemm.cu, B1Form; session 11's split form): the
# build, the CUDA suite, the B1-forms test case under memcheck and racecheck (quick), then B1's
# per-kernel times with the epilogue-warp form against the split form, both forced through
# MOEBLAZE_CUDA_B1_FORM on one library, same process per shape (dev/cuda/run_library_ab.sh,
# AB_DIR=env). The summary and the table come last; logs under $OUT.
#   bash dev/cuda/run_b1_forms.sh          (carry .deps; ~6 minutes)
#   FORMS_SHAPES=... : the shapes ("name|profile_kernels.py arguments" lines; default below)
#   BEFORE_FORM=... AFTER_FORM=... : the two forms compared (default: warps, split)
#   AB_DIR=dir : compare the working tree with BEFORE sources instead (run_library_ab.sh's AB_DIR:
#                files by name over src/cuda/sm90/), both in the same form (MOEBLAZE_CUDA_B1_FORM
#                as exported, else the policy)
set -u -o pipefail
out="${OUT:-./b1_forms_out}"
mkdir -p "$out"
doctest=""
[ -f .deps/doctest/doctest/doctest.h ] && doctest="-DMOEBLAZE_DOCTEST_DIR=$(pwd)/.deps/doctest"
start=$(date +%s)
{ cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
    -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF $doctest &&
  cmake --build build-device -j 16 --target moeblaze moeblaze_tests_cuda; } >"$out/build.log" 2>&1 ||
  { tail -30 "$out/build.log"; exit 1; }
summary=("build: $(( $(date +%s) - start )) s")
tests=build-device/tests/moeblaze_tests_cuda
timeout 240 "$tests" --no-version=true --duration=true >"$out/suite.log" 2>&1
summary+=("CUDA suite: exit $? | $(grep -E '^\[doctest\] test cases' "$out/suite.log" | tr -s ' ')")
for tool in memcheck racecheck; do
  MOEBLAZE_TEST_QUICK=1 timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 17 \
    "$tests" --no-version=true -tc="*B1's epilogue forms*" >"$out/$tool.log" 2>&1
  summary+=("$tool (B1 forms, quick): exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
    "$out/$tool.log" | tail -n 1)")
done
FORMS_SHAPES="${FORMS_SHAPES:-$(python3 dev/cuda/shape_args.py --lines conf3:swiglu conf3:silu \
  conf2:swiglu conf4:swiglu qwen3-30b-a3b:swiglu mixtral:swiglu)}"
if [ -n "${AB_DIR:-}" ] && [ "$AB_DIR" != env ]; then
  CHECK=0 AB_DIR="$AB_DIR" PROFILE_SHAPES="$FORMS_SHAPES" OUT="$out" \
    bash dev/cuda/run_library_ab.sh >"$out/ab.log" 2>&1
  echo "== B1: before = the sources in $AB_DIR, after = the working tree" \
    "(MOEBLAZE_CUDA_B1_FORM=${MOEBLAZE_CUDA_B1_FORM:-the policy})"
else
  before_form="${BEFORE_FORM:-warps}"
  after_form="${AFTER_FORM:-split}"
  CHECK=0 AB_DIR=env BEFORE_ENV="MOEBLAZE_CUDA_B1_FORM=$before_form" \
    AFTER_ENV="MOEBLAZE_CUDA_B1_FORM=$after_form" PROFILE_SHAPES="$FORMS_SHAPES" OUT="$out" \
    bash dev/cuda/run_library_ab.sh >"$out/ab.log" 2>&1
  echo "== B1 forms: before = MOEBLAZE_CUDA_B1_FORM=$before_form, after = $after_form"
fi
sed -n '/^== per-kernel/,$p' "$out/ab.log"
printf '%s\n' "${summary[@]}"
