#!/usr/bin/env bash
# Shared setup for scripts/test.sh and scripts/run.sh: system packages (only the missing ones),
# configure and build. Source it for the functions, or run it to set up and build:
#
#   bash scripts/setup.sh                 # packages + configure + build into $MOEBLAZE_BUILD_DIR
#
# Environment:
#   MOEBLAZE_BUILD_DIR    build folder (default: build)
#   MOEBLAZE_CUDA_ARCHS   GPU architectures (default: "80;90a")
#   MOEBLAZE_NO_APT=1     never call apt-get (report what is missing instead)
#   MOEBLAZE_JOBS         parallel build jobs (default: nproc)
#   MOEBLAZE_CMAKE_ARGS   extra arguments for the configure step

MOEBLAZE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOEBLAZE_BUILD_DIR="${MOEBLAZE_BUILD_DIR:-build}"
case "$MOEBLAZE_BUILD_DIR" in /*) ;; *) MOEBLAZE_BUILD_DIR="$MOEBLAZE_ROOT/$MOEBLAZE_BUILD_DIR" ;; esac
MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-80;90a}"
MOEBLAZE_JOBS="${MOEBLAZE_JOBS:-$(nproc 2>/dev/null || echo 2)}"

# Debian packages the build and the test suites use. Tools that are missing make their tests skip
# visibly or not register; the CPU library, its tests and the ABI tests need only cmake and g++.
MOEBLAZE_APT_PACKAGES=(cmake g++ pkg-config doctest-dev doxygen swig bindgen junit4
  libhamcrest-java python3-dev python3-numpy python3-pytest python3-torch)

declare -a MOEBLAZE_PHASES=()

mb_log() { printf '\n==> %s\n' "$*"; }

# mb_phase <name> <command...>: runs the command and records how long it took.
mb_phase() {
  local name="$1" start rc
  shift
  mb_log "$name"
  start=$SECONDS
  "$@"
  rc=$?
  MOEBLAZE_PHASES+=("$(printf '%-12s %5ds  %s' "$name" $((SECONDS - start)) \
    "$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)")")")
  return $rc
}

mb_print_phases() {
  mb_log "time per phase"
  local line
  for line in "${MOEBLAZE_PHASES[@]}"; do echo "  $line"; done
}

mb_missing_packages() {
  local pkg missing=()
  for pkg in "${MOEBLAZE_APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  echo "${missing[*]}"
}

mb_install_packages() {
  if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "not a Debian-like system: install cmake, a C++17 compiler and (optionally) ${MOEBLAZE_APT_PACKAGES[*]} yourself"
    return 0
  fi
  local missing
  missing="$(mb_missing_packages)"
  if [[ -z "$missing" ]]; then
    echo "all packages present: ${MOEBLAZE_APT_PACKAGES[*]}"
    return 0
  fi
  echo "missing: $missing"
  if [[ "${MOEBLAZE_NO_APT:-0}" == 1 ]]; then
    echo "MOEBLAZE_NO_APT=1: not installing; the tests that need them will skip or fail"
    return 0
  fi
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then sudo=(sudo); else
      echo "not root and no sudo: cannot install $missing; continuing without them"
      return 0
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  # apt-get update only when the package lists are empty, or when the install fails on stale lists.
  if ! compgen -G "/var/lib/apt/lists/*_Packages" >/dev/null; then
    "${sudo[@]}" apt-get update -q || return 1
  fi
  # shellcheck disable=SC2086
  if ! "${sudo[@]}" apt-get install -y -q --no-install-recommends $missing; then
    "${sudo[@]}" apt-get update -q || return 1
    # shellcheck disable=SC2086
    "${sudo[@]}" apt-get install -y -q --no-install-recommends $missing || return 1
  fi
}

# The Python that has numpy (and, for the torch tests, torch): Debian's, where apt put them.
mb_find_python() {
  local py
  for py in /usr/bin/python3 python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c "import numpy" >/dev/null 2>&1; then
      command -v "$py"
      return 0
    fi
  done
  command -v python3 || true
}

mb_python_packages() {
  local py
  py="$(mb_find_python)"
  [[ -n "$py" ]] || { echo "no python3: the Python binding tests will not run"; return 0; }
  if "$py" -c "import numpy, pytest" >/dev/null 2>&1; then
    echo "$py has numpy and pytest"
    return 0
  fi
  echo "$py lacks numpy/pytest; trying pip"
  "$py" -m pip install --user -q --retries 1 --timeout 15 numpy pytest 2>/dev/null ||
    "$py" -m pip install --user -q --retries 1 --timeout 15 --break-system-packages numpy pytest ||
    echo "pip failed: the Python binding tests will skip or fail"
}

# A machine without a package mirror still builds and tests what its tools allow: a failed install
# is a warning, and the tests that need the missing tools skip or fail visibly.
mb_setup_packages() {
  if ! mb_install_packages; then
    echo "WARNING: could not install: $(mb_missing_packages); continuing without them"
  fi
  mb_python_packages
  return 0
}

mb_find_nvcc() {
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return 0; fi
  local candidate
  for candidate in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    [[ -x "$candidate" ]] && { echo "$candidate"; return 0; }
  done
  return 1
}

mb_configure() {
  local args=(-S "$MOEBLAZE_ROOT" -B "$MOEBLAZE_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
    -DMOEBLAZE_CUDA=AUTO "-DMOEBLAZE_CUDA_ARCHS=$MOEBLAZE_CUDA_ARCHS"
    -DMOEBLAZE_BUILD_TESTS=ON -DMOEBLAZE_BUILD_EXAMPLES=ON
    -DMOEBLAZE_BUILD_BINDINGS=ON -DMOEBLAZE_BUILD_DOCS=ON)
  local nvcc py
  if nvcc="$(mb_find_nvcc)"; then
    args+=("-DCMAKE_CUDA_COMPILER=$nvcc")
    echo "nvcc: $nvcc ($("$nvcc" --version | tail -n 2 | head -n 1))"
  else
    echo "nvcc not found: the CUDA backend will not be built"
  fi
  py="$(mb_find_python)"
  [[ -n "$py" ]] && args+=("-DPython3_EXECUTABLE=$py")
  if command -v ninja >/dev/null 2>&1 && [[ ! -f "$MOEBLAZE_BUILD_DIR/CMakeCache.txt" ]]; then
    args+=(-G Ninja)
  fi
  # shellcheck disable=SC2206
  args+=(${MOEBLAZE_CMAKE_ARGS:-})
  echo "cmake ${args[*]}"
  cmake "${args[@]}"
}

mb_build() {
  cmake --build "$MOEBLAZE_BUILD_DIR" -j "$MOEBLAZE_JOBS"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  mb_phase setup mb_setup_packages || exit 1
  mb_phase configure mb_configure || exit 1
  mb_phase build mb_build || exit 1
  mb_print_phases
fi
