#!/usr/bin/env bash
# One-call check of the CUDA backend on a GPU machine: build, the CUDA and CPU test suites,
# compute-sanitizer (memcheck, racecheck) over the CUDA suite, SASS facts of the GEMM kernels, then
# the benchmark (bench/run_bench.py) if it exists. Full logs go to $OUT (default ./device-check-out),
# packed into $OUT/logs.tar.gz at the end beside summary.txt and the benchmark's bench/*.json; a
# short summary table is printed last.
#
# Usage: tools/device_check.sh [--no-bench] [--no-sanitizer] [--no-profile] [--no-sass] [--jobs N]
#                              [-- <run_bench.py args>]
# The profile step runs tests/cuda/profile_kernels.py (torch.profiler, per-kernel times of one
# experts fwd+bwd) once per tensor-core warp layout (MOEBLAZE_CUDA_MMA_WARPS=4 and 8).
# Needs doctest: /usr/include/doctest, or .deps/doctest/doctest/doctest.h in the checkout (the GPU
# machine has no network: copy it there and carry .deps).
#
# Environment: MOEBLAZE_CUDA_ARCHS (default "90a;80"), BUILD_DIR (default build-device).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/device-check-out}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-device}"
ARCHS="${MOEBLAZE_CUDA_ARCHS:-90a;80}"
JOBS="$(nproc 2>/dev/null || echo 8)"
RUN_BENCH=1
RUN_SANITIZER=1
RUN_PROFILE=1
RUN_SASS=1
BENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) RUN_BENCH=0 ;;
    --no-sanitizer) RUN_SANITIZER=0 ;;
    --no-profile) RUN_PROFILE=0 ;;
    --no-sass) RUN_SASS=0 ;;
    --jobs) JOBS="$2"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
cd "$ROOT" || exit 1
# MOEBLAZE_COMMIT names the tree's commit in the build info and the benchmark's json. Written as
# $(git rev-parse HEAD) inside the device command it reads the device copy's .git, which may be
# stale (a copied tree with an old .git): say so when the tracked files differ from it.
if [ -n "${MOEBLAZE_COMMIT:-}" ] && git rev-parse --git-dir >/dev/null 2>&1; then
  case "$(git rev-parse HEAD 2>/dev/null)" in
    "$MOEBLAZE_COMMIT"*)
      if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        echo "warning: MOEBLAZE_COMMIT=$MOEBLAZE_COMMIT is this copy's .git HEAD, but tracked files" \
          "differ from it (a stale .git?): pass the commit of the tree you sent, as a literal" >&2
      fi
      ;;
  esac
fi

declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-28s %-8s %s' "$1" "$2" "$3")"); }
section() { echo; echo "===== $* ($(date -u +%H:%M:%S)) ====="; }
tail_line() { grep -E "$2" "$1" | tail -n 1; }

# ---- machine ---------------------------------------------------------------------------------------
{
  section "machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  nvcc --version 2>&1 | tail -n 1
  cmake --version | head -n 1
} >"$OUT/build.log" 2>&1

# ---- build -----------------------------------------------------------------------------------------
DOCTEST_DIR=""
[ -f "$ROOT/.deps/doctest/doctest/doctest.h" ] && DOCTEST_DIR="$ROOT/.deps/doctest"
GEN=()
[ ! -f "$BUILD_DIR/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
BUILD_OK=0
{
  section "configure"
  cmake -S "$ROOT" -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
    "-DMOEBLAZE_CUDA_ARCHS=$ARCHS" -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF \
    ${DOCTEST_DIR:+-DMOEBLAZE_DOCTEST_DIR=$DOCTEST_DIR} &&
  section "build (-j$JOBS)" &&
  start=$(date +%s) &&
  cmake --build "$BUILD_DIR" -j "$JOBS" --target moeblaze moeblaze_tests_cuda moeblaze_tests_cpu &&
  { cmake --build "$BUILD_DIR" -j "$JOBS" --target moeblaze_tests_ep_cuda ||
      echo "(no EP CUDA suite in this build)"; } &&
  echo "build seconds: $(( $(date +%s) - start ))"
} >>"$OUT/build.log" 2>&1 && BUILD_OK=1
if [ "$BUILD_OK" = 1 ]; then
  note "build" "OK" "$(tail_line "$OUT/build.log" 'build seconds')"
else
  note "build" "FAIL" "see build.log"
  tail -n 40 "$OUT/build.log"
fi

LIB="$BUILD_DIR/src/libmoeblaze.so"
CUDA_TESTS="$BUILD_DIR/tests/moeblaze_tests_cuda"
CPU_TESTS="$BUILD_DIR/tests/moeblaze_tests_cpu"

# ---- tests -----------------------------------------------------------------------------------------
: >"$OUT/tests.log"
if [ "$BUILD_OK" = 1 ]; then
  {
    section "CUDA suite"
    timeout 600 "$CUDA_TESTS" --no-version=true --duration=true 2>&1
    echo "exit status: $?"
  } >>"$OUT/tests.log" 2>&1
  st=$(grep -E '^exit status' "$OUT/tests.log" | tail -n 1 | awk '{print $3}')
  note "tests: cuda" "$([ "$st" = 0 ] && echo OK || echo FAIL)" \
    "$(grep -E '^\[doctest\] (test cases|assertions)' "$OUT/tests.log" | tail -n 2 | tr -s ' ' | paste -sd ';')"
  # The portable path (mma.sync engine, what sm_80 runs) on this device too: every sm90 kernel off.
  {
    section "CUDA suite, MOEBLAZE_CUDA_SM90=0 (portable mma.sync path)"
    MOEBLAZE_CUDA_SM90=0 timeout 600 "$CUDA_TESTS" --no-version=true 2>&1
    echo "exit status: $?"
  } >>"$OUT/tests.log" 2>&1
  st=$(grep -E '^exit status' "$OUT/tests.log" | tail -n 1 | awk '{print $3}')
  note "tests: cuda, sm90 off" "$([ "$st" = 0 ] && echo OK || echo FAIL)" \
    "$(grep -E '^\[doctest\] test cases' "$OUT/tests.log" | tail -n 1 | tr -s ' ')"
  # Expert parallelism on this one GPU: NCCL at world size 1 and the LOCAL transport at world
  # size 2 on the CUDA backend. NVLink multicast stays off in every run.
  if [ -x "$BUILD_DIR/tests/moeblaze_tests_ep_cuda" ]; then
    {
      section "EP CUDA suite (NCCL_NVLS_ENABLE=0)"
      NCCL_NVLS_ENABLE=0 timeout 300 "$BUILD_DIR/tests/moeblaze_tests_ep_cuda" --no-version=true 2>&1
      echo "exit status: $?"
    } >>"$OUT/tests.log" 2>&1
    st=$(grep -E '^exit status' "$OUT/tests.log" | tail -n 1 | awk '{print $3}')
    note "tests: ep cuda" "$([ "$st" = 0 ] && echo OK || echo FAIL)" \
      "$(grep -E '^\[doctest\] test cases' "$OUT/tests.log" | tail -n 1 | tr -s ' ')"
  fi
  {
    section "CPU suite"
    timeout 600 "$CPU_TESTS" --no-version=true 2>&1
    echo "exit status: $?"
  } >>"$OUT/tests.log" 2>&1
  st=$(grep -E '^exit status' "$OUT/tests.log" | tail -n 1 | awk '{print $3}')
  note "tests: cpu" "$([ "$st" = 0 ] && echo OK || echo FAIL)" \
    "$(grep -E '^\[doctest\] test cases' "$OUT/tests.log" | tail -n 1 | tr -s ' ')"
fi

# ---- per-kernel profile ----------------------------------------------------------------------------
if [ "$BUILD_OK" = 1 ] && [ "$RUN_PROFILE" = 1 ] && python3 -c "import torch" >/dev/null 2>&1; then
  for warps in 4 8; do
    {
      section "profile_kernels.py, MOEBLAZE_CUDA_MMA_WARPS=$warps ${PROFILE_ARGS:-}"
      MOEBLAZE_CUDA_MMA_WARPS=$warps MOEBLAZE_LIBRARY="$LIB" PYTHONUNBUFFERED=1 timeout 180 \
        python3 "$ROOT/tests/cuda/profile_kernels.py" ${PROFILE_ARGS:-} 2>&1
      echo "exit status: $?"
    } >>"$OUT/profile.log" 2>&1
    note "profile: warps=$warps" "info" "$(grep -E '^fwd\+bwd' "$OUT/profile.log" | tail -n 1)"
  done
fi

# ---- compute-sanitizer -----------------------------------------------------------------------------
: >"$OUT/sanitizer.log"
if [ "$BUILD_OK" = 1 ] && [ "$RUN_SANITIZER" = 1 ]; then
  for tool in memcheck racecheck; do
    {
      section "compute-sanitizer --tool $tool (MOEBLAZE_TEST_QUICK=1)"
      MOEBLAZE_TEST_QUICK=1 timeout "${SANITIZER_TIMEOUT:-900}" compute-sanitizer --tool "$tool" --error-exitcode 17 \
        "$CUDA_TESTS" --no-version=true 2>&1
      echo "exit status: $?"
    } >>"$OUT/sanitizer.log" 2>&1
    # The sanitizer's own verdict (the suite's test failures are reported above): exit code 17
    # means it found errors; a summary of 0 errors and no timeout is OK.
    st=$(grep -E '^exit status' "$OUT/sanitizer.log" | tail -n 1 | awk '{print $3}')
    summary_line=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -n 1)
    verdict=FAIL
    if [ "$st" != 17 ] && [ "$st" != 124 ] && echo "$summary_line" | grep -qE '(SUMMARY: 0 errors|\(0 errors)'; then
      verdict=OK
    fi
    note "sanitizer: $tool" "$verdict" "$summary_line (suite exit $st)"
  done
fi

if [ "$BUILD_OK" = 1 ] && [ "$RUN_SANITIZER" = 1 ] && [ -x "$BUILD_DIR/tests/moeblaze_tests_ep_cuda" ]; then
  {
    section "compute-sanitizer --tool memcheck, EP CUDA suite"
    # --report-api-errors no: ncclCommInitAll probes its kernels with cudaFuncGetAttributes and
    # handles the "no kernel image" answers itself; memory errors are still reported.
    NCCL_NVLS_ENABLE=0 timeout "${SANITIZER_TIMEOUT:-900}" compute-sanitizer --tool memcheck --error-exitcode 17 \
      --report-api-errors no "$BUILD_DIR/tests/moeblaze_tests_ep_cuda" --no-version=true 2>&1
    echo "exit status: $?"
  } >>"$OUT/sanitizer.log" 2>&1
  st=$(grep -E '^exit status' "$OUT/sanitizer.log" | tail -n 1 | awk '{print $3}')
  summary_line=$(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 1)
  verdict=FAIL
  if [ "$st" != 17 ] && [ "$st" != 124 ] && echo "$summary_line" | grep -qE 'SUMMARY: 0 errors'; then
    verdict=OK
  fi
  note "sanitizer: memcheck ep" "$verdict" "$summary_line (suite exit $st)"
fi

# ---- SASS facts ------------------------------------------------------------------------------------
if [ "$BUILD_OK" = 1 ] && [ "$RUN_SASS" = 1 ]; then
  {
    section "SASS: tensor-core instructions per architecture"
    echo "all HMMA instructions: $(cuobjdump --dump-sass "$LIB" 2>/dev/null | grep -c HMMA)"
    for arch in sm_90a sm_80; do
      n=$(cuobjdump --dump-sass -arch "$arch" "$LIB" 2>/dev/null | grep -c HMMA)
      echo "$arch HMMA instructions: $n"
    done
    echo "sm_90a HGMMA instructions: $(cuobjdump --dump-sass -arch sm_90a "$LIB" 2>/dev/null | grep -c HGMMA)"
    echo "sm_90a local-memory instructions (LDL/STL; spills): $(cuobjdump --dump-sass -arch sm_90a "$LIB" 2>/dev/null | grep -cE '\b(LDL|STL)\b')"
    echo "mma_gemm_kernel functions: $(cuobjdump --dump-sass "$LIB" 2>/dev/null | grep -c 'Function : .*mma_gemm_kernel')"
    section "SASS: the Hopper kernels' k-step loops and epilogue loops (bf16; tools/sass_loops.py)"
    python3 "$ROOT/tools/sass_loops.py" "$LIB" --filter bfloat16 || echo "sass_loops failed"
    section "ptxas resource usage (gemm.cu, sm_90a)"
    nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
      -I"$ROOT/include" -I"$ROOT/src" -Xptxas -v -c "$ROOT/src/cuda/engines/portable/gemm.cu" -o "$OUT/gemm_check.o" 2>&1 |
      grep -E "Compiling entry|registers|spill" | sed 's/ptxas info *: //'
  } >>"$OUT/build.log" 2>&1
  hmma=$(grep -E '^(all|sm_90a|sm_80) H(G)?MMA' "$OUT/build.log" | awk '{printf "%s %s=%s ", $1, $2, $4}')
  spills=$(grep -E 'spill' "$OUT/build.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads')
  note "sass" "info" "HMMA: $hmma; gemm functions with spills: $spills"
fi

# ---- benchmark -------------------------------------------------------------------------------------
if [ "$BUILD_OK" = 1 ] && [ "$RUN_BENCH" = 1 ] && [ -f "$ROOT/bench/run_bench.py" ]; then
  mkdir -p "$OUT/bench"
  {
    section "bench/run_bench.py ${BENCH_ARGS[*]}"
    MOEBLAZE_LIBRARY="$LIB" PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-1500}" python3 "$ROOT/bench/run_bench.py" --out "$OUT/bench" \
      "${BENCH_ARGS[@]}" 2>&1
    echo "exit status: $?"
  } >"$OUT/bench.log" 2>&1
  st=$(grep -E '^exit status' "$OUT/bench.log" | tail -n 1 | awk '{print $3}')
  note "bench" "$([ "$st" = 0 ] && echo OK || echo FAIL)" "see bench.log, bench/"
  tail -n 40 "$OUT/bench.log"
fi

# ---- first failures (full text in the logs) --------------------------------------------------------
{
  grep -hE "ERROR:|FAILED|Segmentation|what\(\)|CHECK\( |REQUIRE\( |mismatches" "$OUT/tests.log" | head -n 40
  grep -hE "^========= (Invalid|Race|Error|Program hit|Uninitialized)" "$OUT/sanitizer.log" | sort | uniq -c | head -n 20
} 2>/dev/null

# ---- summary ---------------------------------------------------------------------------------------
{
  echo
  echo "==== device_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ===="
  for line in "${SUMMARY[@]}"; do echo "$line"; done
} | tee "$OUT/summary.txt"
# Keep the summary and the benchmark's files (bench/: the JSON) as they are and pack the logs into
# logs.tar.gz: few files in $OUT, so a remote runner that returns a limited number of files from it
# still returns the results, and a caller has room for its own files beside them.
# Only the logs this script writes: $OUT may hold a caller's files too.
(cd "$OUT" || exit 0
  logs=()
  for f in bench.log build.log profile.log sanitizer.log tests.log; do
    if [ -f "$f" ]; then logs+=("$f"); fi
  done
  if [ ${#logs[@]} -gt 0 ]; then tar -czf logs.tar.gz --remove-files "${logs[@]}" 2>/dev/null; fi)
grep -qE ' FAIL ' "$OUT/summary.txt" && exit 1
exit 0
