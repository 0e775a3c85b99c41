#!/usr/bin/env bash
# THE test command: installs what the tests need (only what is missing), configures with every
# component (CUDA when nvcc exists, bindings, docs), builds, and runs the whole CTest suite:
# labels api, cpu, cuda (skips visibly without a GPU), bindings, examples.
#
#   bash scripts/test.sh [extra ctest arguments, e.g. -L cpu]
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

mb_phase setup mb_setup_packages || status=1
if ((status == 0)); then mb_phase configure mb_configure || status=1; fi
if ((status == 0)); then mb_phase build mb_build || status=1; fi
if ((status == 0)); then
  mb_phase test run_tests "$@" || status=1
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
