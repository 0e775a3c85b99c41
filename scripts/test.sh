#!/usr/bin/env bash
# THE test command: installs what the tests need (only what is missing: Debian packages, and the
# Python test dependencies into the project's virtual environment .venv, see scripts/setup.sh),
# configures with every component (CUDA when nvcc exists, bindings, docs), builds, and runs the
# whole CTest suite: labels api, cpu, cuda and ep (the GPU parts skip visibly without a GPU),
# bindings, jax, examples, bench, docs, scripts, and tools (the contributor tools' self-tests,
# tools/README.md).
#
#   bash scripts/test.sh [extra ctest arguments, e.g. -L cpu]
#
# Then, unless MOEBLAZE_SANITIZE=0, three CPU-only builds beside $MOEBLAZE_BUILD_DIR, each phase
# timed in the summary:
#   sanitize  the API, bad-input, CPU and expert-parallel suites under AddressSanitizer +
#             UndefinedBehaviorSanitizer ($MOEBLAZE_BUILD_DIR-sanitize; any report fails it);
#   tsan      the CPU suite (every call runs on the worker pool) and the concurrency tests (API,
#             expert parallelism over threads) under ThreadSanitizer ($MOEBLAZE_BUILD_DIR-tsan);
#   fuzz      the libFuzzer targets tests/fuzz/fuzz_layer.cpp and fuzz_ep.cpp against an ASan +
#             UBSan library for MOEBLAZE_FUZZ_SECONDS each (default 60) with clang
#             ($MOEBLAZE_BUILD_DIR-fuzz), each corpus seeded with the inputs that target once
#             failed on (tests/fuzz/regressions/<target>), the mutations from MOEBLAZE_FUZZ_SEED
#             (default 1, so a run repeats the last one's inputs; 0 draws a new seed, for longer
#             runs that look further). clang and its
#             fuzzer runtime (Debian: clang, libclang-rt-14-dev) are installed when missing; where
#             they cannot be, the phase says so and is skipped.
#
# Exits non-zero if any phase or test fails. See scripts/setup.sh for the environment variables.
set -uo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOEBLAZE_ROOT" || exit 1

total_start=$SECONDS
status=0
run_tests() {
  # The CPU backend threads each test; two test processes per core keep the machine busy without
  # thrashing.
  ctest --test-dir "$MOEBLAZE_BUILD_DIR" --output-on-failure -j "$MOEBLAZE_JOBS" "$@"
}

# The CPU backend and the EP layer under ASan + UBSan (the GPU code has compute-sanitizer on the
# GPU machine instead: tools/device_check.sh).
run_sanitized() {
  local dir="$MOEBLAZE_BUILD_DIR-sanitize"
  local san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  local args=(-S "$MOEBLAZE_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEBLAZE_CUDA=OFF
    -DMOEBLAZE_BUILD_TESTS=ON -DMOEBLAZE_BUILD_EXAMPLES=OFF -DMOEBLAZE_BUILD_BINDINGS=OFF
    -DMOEBLAZE_BUILD_DOCS=OFF "-DCMAKE_C_FLAGS=$san" "-DCMAKE_CXX_FLAGS=$san"
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
    "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined")
  if command -v ninja >/dev/null 2>&1 && [[ ! -f "$dir/CMakeCache.txt" ]]; then args+=(-G Ninja); fi
  cmake "${args[@]}" >/dev/null || return 1
  local suites=(moeblaze_tests_api moeblaze_tests_badinput moeblaze_tests_cpu moeblaze_tests_ep
    moeblaze_fuzz_layer_random moeblaze_fuzz_ep_random)
  cmake --build "$dir" -j "$MOEBLAZE_JOBS" --target "${suites[@]}" || return 1
  # alloc_dealloc_mismatch=0: the no-allocation test replaces operator new/delete with counting
  # versions over malloc/free, which ASan would report inside libstdc++'s temporary buffers.
  local suite args
  for suite in "${suites[@]}"; do
    echo "== $suite (ASan + UBSan)"
    args=(--no-version=true)
    [[ "$suite" == moeblaze_fuzz_* ]] && args=()  # not a doctest suite: no options
    ASAN_OPTIONS=detect_leaks=1:alloc_dealloc_mismatch=0:abort_on_error=0 \
      UBSAN_OPTIONS=print_stacktrace=1 "$dir/tests/$suite" "${args[@]}" || return 1
  done
}

# The threaded CPU backend and the concurrency tests under ThreadSanitizer: every CPU call runs on
# the context's worker pool (4 threads here, more than the cores, for more interleavings), the EP
# suites and the EP fuzz target run ranks as threads, and the API suite creates, uses and destroys
# handles from threads.
run_tsan() {
  local dir="$MOEBLAZE_BUILD_DIR-tsan"
  local san="-fsanitize=thread -fno-omit-frame-pointer"
  local args=(-S "$MOEBLAZE_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEBLAZE_CUDA=OFF
    -DMOEBLAZE_BUILD_TESTS=ON -DMOEBLAZE_BUILD_EXAMPLES=OFF -DMOEBLAZE_BUILD_BINDINGS=OFF
    -DMOEBLAZE_BUILD_DOCS=OFF "-DCMAKE_C_FLAGS=$san" "-DCMAKE_CXX_FLAGS=$san"
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread")
  if command -v ninja >/dev/null 2>&1 && [[ ! -f "$dir/CMakeCache.txt" ]]; then args+=(-G Ninja); fi
  cmake "${args[@]}" >/dev/null || return 1
  local suites=(moeblaze_tests_api moeblaze_tests_cpu moeblaze_tests_ep moeblaze_fuzz_ep_random)
  cmake --build "$dir" -j "$MOEBLAZE_JOBS" --target "${suites[@]}" || return 1
  local suite args
  for suite in "${suites[@]}"; do
    echo "== $suite (ThreadSanitizer, 4 worker threads)"
    args=(--no-version=true)
    [[ "$suite" == moeblaze_fuzz_* ]] && args=()
    MOEBLAZE_NUM_THREADS=4 TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
      "$dir/tests/$suite" "${args[@]}" || return 1
  done
}

# clang and its libFuzzer runtime: present, or installed from Debian; 1 when neither.
fuzz_toolchain() {
  local probe
  probe="$(mktemp -d)" || return 1
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
    >"$probe/probe.cpp"
  local compile=(clang++ -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe")
  if ! command -v clang++ >/dev/null 2>&1 || ! "${compile[@]}" >/dev/null 2>&1; then
    echo "clang++ with libFuzzer not found; installing clang and libclang-rt-14-dev"
    mb_install_packages clang libclang-rt-14-dev || true
  fi
  local rc=0
  command -v clang++ >/dev/null 2>&1 && "${compile[@]}" >/dev/null 2>&1 || rc=1
  rm -rf "$probe"
  return $rc
}

run_fuzz() {
  if ! fuzz_toolchain; then
    echo "SKIPPED: the fuzz phase needs clang++ with libFuzzer (Debian: clang, libclang-rt-14-dev)"
    return 0
  fi
  local dir="$MOEBLAZE_BUILD_DIR-fuzz"
  local san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  local args=(-S "$MOEBLAZE_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEBLAZE_CUDA=OFF
    -DMOEBLAZE_BUILD_TESTS=ON -DMOEBLAZE_BUILD_EXAMPLES=OFF -DMOEBLAZE_BUILD_BINDINGS=OFF
    -DMOEBLAZE_BUILD_DOCS=OFF -DMOEBLAZE_BUILD_FUZZERS=ON -DCMAKE_C_COMPILER=clang
    -DCMAKE_CXX_COMPILER=clang++ "-DCMAKE_C_FLAGS=$san -fsanitize=fuzzer-no-link"
    "-DCMAKE_CXX_FLAGS=$san -fsanitize=fuzzer-no-link"
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
    "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined")
  if command -v ninja >/dev/null 2>&1 && [[ ! -f "$dir/CMakeCache.txt" ]]; then args+=(-G Ninja); fi
  cmake "${args[@]}" >/dev/null || return 1
  cmake --build "$dir" -j "$MOEBLAZE_JOBS" --target moeblaze_fuzz_layer moeblaze_fuzz_ep ||
    return 1
  local seconds="${MOEBLAZE_FUZZ_SECONDS:-60}" seed="${MOEBLAZE_FUZZ_SEED:-1}" target rc=0
  for target in layer ep; do
    local corpus="$dir/fuzz-corpus-$target"
    mkdir -p "$corpus"
    local inputs=("$corpus")
    [[ -d "$MOEBLAZE_ROOT/tests/fuzz/regressions/$target" ]] &&
      inputs+=("$MOEBLAZE_ROOT/tests/fuzz/regressions/$target")
    echo "== moeblaze_fuzz_$target (libFuzzer, ASan + UBSan, ${seconds}s, seed $seed, corpus $corpus)"
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
      "$dir/tests/moeblaze_fuzz_$target" -max_total_time="$seconds" -seed="$seed" \
      -rss_limit_mb=4096 -artifact_prefix="$dir/$target-" -print_final_stats=1 "${inputs[@]}" ||
      rc=1
  done
  return $rc
}

mb_phase setup mb_setup_packages || status=1
if ((status == 0)); then mb_phase python mb_python_env || status=1; fi
if ((status == 0)); then mb_phase configure mb_configure || status=1; fi
if ((status == 0)); then mb_phase build mb_build || status=1; fi
if ((status == 0)); then
  mb_phase test run_tests "$@" || status=1
fi
if ((status == 0)) && [[ "${MOEBLAZE_SANITIZE:-1}" != 0 ]]; then
  mb_phase sanitize run_sanitized || status=1
  mb_phase tsan run_tsan || status=1
  mb_phase fuzz run_fuzz || status=1
fi

mb_print_phases
echo "  total        $((SECONDS - total_start))s"
if [[ -f "$MOEBLAZE_BUILD_DIR/CMakeCache.txt" ]]; then
  echo "  build: $MOEBLAZE_BUILD_DIR ($(grep -E '^MOEBLAZE_CUDA:' "$MOEBLAZE_BUILD_DIR/CMakeCache.txt" | cut -d= -f2) CUDA requested)"
fi
if ((status == 0)); then
  mb_log "moeblaze tests: ALL PASSED"
else
  mb_log "moeblaze tests: FAILED (see the output above; rerun one test with ctest --test-dir $MOEBLAZE_BUILD_DIR -R <name> -V)"
fi
exit $status
