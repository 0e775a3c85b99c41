#!/usr/bin/env bash
# THE test command: installs what the tests need (only what is missing: Debian packages, and the
# Python test dependencies into the project's virtual environment .venv, see scripts/setup.sh),
# configures with every component (CUDA when nvcc exists, bindings, docs), builds, and runs the
# whole CTest suite: labels api, cpu, cuda and ep (the GPU parts skip visibly without a GPU),
# bindings, examples, bench, docs, scripts. The tools' self-tests (label tools) are not registered
# here: tools/README.md.
#
#   bash scripts/test.sh [extra ctest arguments, e.g. -L cpu]
#
# Then, unless MOEBLAZE_SANITIZE=0, the CPU and expert-parallel suites once more in a second build
# ($MOEBLAZE_BUILD_DIR-sanitize: CPU only, AddressSanitizer + UndefinedBehaviorSanitizer, any report
# fails the phase; about 4 minutes on 2 cores).
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
  cmake --build "$dir" -j "$MOEBLAZE_JOBS" --target moeblaze_tests_cpu moeblaze_tests_ep || return 1
  # alloc_dealloc_mismatch=0: the no-allocation test replaces operator new/delete with counting
  # versions over malloc/free, which ASan would report inside libstdc++'s temporary buffers.
  local suite
  for suite in moeblaze_tests_cpu moeblaze_tests_ep; do
    echo "== $suite (ASan + UBSan)"
    ASAN_OPTIONS=detect_leaks=1:alloc_dealloc_mismatch=0:abort_on_error=0 \
      UBSAN_OPTIONS=print_stacktrace=1 "$dir/tests/$suite" --no-version=true || return 1
  done
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
