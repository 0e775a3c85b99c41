#!/usr/bin/env bash
# Shared setup for scripts/test.sh and scripts/run.sh: system packages (only the missing ones), the
# project's Python environment, configure and build. Source it for the functions, or run it to set
# up and build everything that scripts/test.sh builds:
#
#   bash scripts/setup.sh                 # packages + Python env + configure + build
#
# The Python test dependencies (bindings/python/requirements-test.txt: numpy, pytest, torch, ...)
# go into one virtual environment that these scripts own, $MOEBLAZE_VENV (default .venv in the
# checkout), made from Debian's /usr/bin/python3. Nothing is installed into any other interpreter
# or into the user's site; pip runs with --require-virtualenv and keeps no cache.
#
# Environment:
#   MOEBLAZE_BUILD_DIR    build folder (default: build)
#   MOEBLAZE_CUDA_ARCHS   GPU architectures (default: "80;90a")
#   MOEBLAZE_NO_APT=1     never call apt-get (report what is missing instead)
#   MOEBLAZE_APT_LOCK_TIMEOUT  seconds to wait for another process's apt/dpkg lock (default 900)
#   MOEBLAZE_JOBS         parallel build jobs (default: nproc)
#   MOEBLAZE_CMAKE_ARGS   extra arguments for the configure step
#   MOEBLAZE_VENV         the virtual environment (default: <checkout>/.venv)
#   MOEBLAZE_BASE_PYTHON  the interpreter the environment is made from (default: /usr/bin/python3)
#   MOEBLAZE_PYTHON       use this interpreter for the Python tests as it is (no environment is made
#                         and nothing installed; it must have every package of the requirements
#                         file, other versions are reported)

# CDPATH= : a CDPATH in the environment would make cd print the folder (into MOEBLAZE_ROOT) or pick
# another checkout's folder.
MOEBLAZE_ROOT="$(CDPATH='' cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
MOEBLAZE_BUILD_DIR="${MOEBLAZE_BUILD_DIR:-build}"
case "$MOEBLAZE_BUILD_DIR" in /*) ;; *) MOEBLAZE_BUILD_DIR="$MOEBLAZE_ROOT/$MOEBLAZE_BUILD_DIR" ;; esac
MOEBLAZE_CUDA_ARCHS="${MOEBLAZE_CUDA_ARCHS:-80;90a}"
MOEBLAZE_JOBS="${MOEBLAZE_JOBS:-$(nproc 2>/dev/null || echo 2)}"

# Debian packages the build and the test suites use. Tools that are missing make their tests skip
# visibly or not register; the CPU library, its tests and the ABI tests need only cmake and g++.
# python3-dev: headers for the SWIG Python module; python3-venv: the project's Python environment.
MOEBLAZE_APT_PACKAGES=(cmake g++ pkg-config doctest-dev doxygen swig bindgen junit4
  libhamcrest-java python3-dev python3-venv)
# What the CPU main job (scripts/run.sh without a GPU) needs: the library and the C example.
# shellcheck disable=SC2034 # used by scripts/run.sh
MOEBLAZE_MAIN_APT_PACKAGES=(cmake g++)

MOEBLAZE_VENV="${MOEBLAZE_VENV:-$MOEBLAZE_ROOT/.venv}"
case "$MOEBLAZE_VENV" in /*) ;; *) MOEBLAZE_VENV="$MOEBLAZE_ROOT/$MOEBLAZE_VENV" ;; esac
MOEBLAZE_REQUIREMENTS="${MOEBLAZE_REQUIREMENTS:-$MOEBLAZE_ROOT/bindings/python/requirements-test.txt}"
MOEBLAZE_BASE_PYTHON="${MOEBLAZE_BASE_PYTHON:-/usr/bin/python3}"

declare -a MOEBLAZE_PHASES=()

mb_log() { printf '\n==> %s\n' "$*"; }
mb_error() { printf 'ERROR: %s\n' "$*" >&2; }

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

# mb_fail_phases: the summary after a phase failed, then exit 1 (the scripts that stop at a failed
# phase end with it, so the last lines say which phase failed).
mb_fail_phases() {
  local last="${MOEBLAZE_PHASES[${#MOEBLAZE_PHASES[@]} - 1]:-}"
  mb_print_phases
  mb_error "the ${last%% *} phase failed (its output is above)"
  exit 1
}

# mb_check_path <description> <path>: a path CMake and the build cannot use (';' and '\' are CMake's
# list separator and escape, '[' makes the source globs match nothing, '$' reaches the linker's
# shell command) fails here with its name instead of as an unrelated compiler or linker error.
mb_check_path() {
  if [[ "$2" == *[\;\\[\$]* ]]; then
    mb_error "$1 '$2' contains one of ; \\ [ \$, which the CMake build cannot handle: clone or move it to a path without them"
    return 1
  fi
}

# mb_missing_packages <package...>: the ones dpkg does not list as installed.
mb_missing_packages() {
  local pkg missing=()
  for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  echo "${missing[*]}"
}

# mb_apt <apt-get arguments...>: apt-get that waits while another process (unattended-upgrades, a
# second set-up) holds apt's or dpkg's lock, up to MOEBLAZE_APT_LOCK_TIMEOUT seconds, instead of
# failing on it. apt waits for dpkg's frontend lock itself (DPkg::Lock::Timeout) but not for the
# package lists' lock, hence the retry.
mb_apt() {
  local timeout="${MOEBLAZE_APT_LOCK_TIMEOUT:-900}" log rc holder
  local deadline=$((SECONDS + timeout))
  log="$(mktemp)" || return 1
  while :; do
    "${MOEBLAZE_SUDO[@]}" apt-get -o "DPkg::Lock::Timeout=$((deadline > SECONDS ? deadline - SECONDS : 0))" \
      "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if ((rc != 0)) && grep -qE 'Could not get lock|Unable to lock|Unable to acquire the dpkg' "$log"; then
      holder="$(grep -oE 'held by process [0-9]+( \([^)]*\))?' "$log" | head -n 1)"
      if ((SECONDS < deadline)); then
        echo "apt/dpkg lock ${holder:-held by another process}: waiting (up to $((deadline - SECONDS))s more)"
        sleep 10
        continue
      fi
      mb_error "apt-get $*: the apt/dpkg lock was still ${holder:-held} after ${timeout}s" \
        "(MOEBLAZE_APT_LOCK_TIMEOUT)"
    fi
    rm -f "$log"
    return "$rc"
  done
}

# mb_install_packages <package...>: installs the missing ones with apt-get (Debian-like systems).
mb_install_packages() {
  if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "not a Debian-like system: install cmake, a C++17 compiler and (optionally) $* yourself"
    return 0
  fi
  local missing
  missing="$(mb_missing_packages "$@")"
  if [[ -z "$missing" ]]; then
    echo "all packages present: $*"
    return 0
  fi
  echo "missing: $missing"
  if [[ "${MOEBLAZE_NO_APT:-0}" == 1 ]]; then
    echo "MOEBLAZE_NO_APT=1: not installing; the tests that need them will skip or fail"
    return 0
  fi
  MOEBLAZE_SUDO=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then MOEBLAZE_SUDO=(sudo); else
      echo "not root and no sudo: cannot install $missing; continuing without them"
      return 0
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  # apt-get update only when the package lists are empty, or when the install fails on stale lists.
  if ! compgen -G "/var/lib/apt/lists/*_Packages" >/dev/null; then
    mb_apt update -q || return 1
  fi
  # shellcheck disable=SC2086
  if ! mb_apt install -y -q --no-install-recommends $missing; then
    mb_apt update -q || return 1
    # shellcheck disable=SC2086
    mb_apt install -y -q --no-install-recommends $missing || return 1
  fi
}

# A machine without a package mirror still builds and tests what its tools allow: a failed apt
# install is a warning, and the tests that need the missing tools skip or fail visibly.
mb_setup_packages() {
  local packages=("$@")
  ((${#packages[@]})) || packages=("${MOEBLAZE_APT_PACKAGES[@]}")
  if ! mb_install_packages "${packages[@]}"; then
    echo "WARNING: could not install: $(mb_missing_packages "${packages[@]}"); continuing without them"
  fi
  return 0
}

# mb_requirements_unmet <python> <requirements file>: prints each pinned requirement ("name==version"
# lines; pip options such as --find-links are skipped) that the interpreter does not have at
# exactly that version, one a line ("name: not installed ...", "name: X installed, Y required",
# "line: not pinned ..."); silent when every one is met.
mb_requirements_unmet() {
  "$1" - "$2" <<'PY'
import re, sys
from importlib import metadata
for raw in open(sys.argv[1], encoding="utf-8"):
    line = raw.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
        continue
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)", line)
    if not m:
        print(f"{line}: not pinned as name==version")
        continue
    name, want = m.group(1), m.group(3)
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(f"{name}: not installed ({want} required)")
        continue
    if have != want:
        print(f"{name}: {have} installed, {want} required")
PY
}

# The interpreter the Python tests run under: $MOEBLAZE_PYTHON if set, else the environment's.
mb_test_python() {
  if [[ -n "${MOEBLAZE_PYTHON:-}" ]]; then echo "$MOEBLAZE_PYTHON"; else echo "$MOEBLAZE_VENV/bin/python"; fi
}

# mb_python_env: makes (or brings up to date) the project's virtual environment $MOEBLAZE_VENV with
# exactly the pins of $MOEBLAZE_REQUIREMENTS. A complete one costs one interpreter start: the stamp
# holds the hash of the requirements file and the base interpreter's version, and the installed
# versions are checked against the pins. Any failure is an error that names what failed.
# Two set-ups at once take turns (a lock on the environment's parent folder): one's venv --clear
# would delete the other's environment under its running pip.
mb_python_env() {
  local dir lock rc
  if [[ -n "${MOEBLAZE_PYTHON:-}" ]] || ! command -v flock >/dev/null 2>&1; then
    mb_python_env_unlocked
    return
  fi
  dir="$(dirname -- "$MOEBLAZE_VENV")"
  mkdir -p -- "$dir" && exec {lock}<"$dir" || return 1
  if ! flock -n "$lock"; then
    echo "another set-up is making $MOEBLAZE_VENV: waiting for it to finish"
    flock "$lock"
  fi
  mb_python_env_unlocked
  rc=$?
  exec {lock}<&-
  return $rc
}

mb_python_env_unlocked() {
  local req="$MOEBLAZE_REQUIREMENTS" venv="$MOEBLAZE_VENV"
  local py="$venv/bin/python" stamp="$venv/.moeblaze-requirements" want unmet
  [[ -f "$req" ]] || { mb_error "requirements file $req not found"; return 1; }
  if [[ -n "${MOEBLAZE_PYTHON:-}" ]]; then
    # A user's own interpreter (a machine without PyPI, a GPU machine's torch): used as it is and
    # never installed into. A missing package is an error; another version is reported.
    unmet="$(mb_requirements_unmet "$MOEBLAZE_PYTHON" "$req")" || {
      mb_error "MOEBLAZE_PYTHON=$MOEBLAZE_PYTHON does not run"; return 1; }
    if grep -qE ': (not installed|not pinned)' <<<"$unmet"; then
      mb_error "MOEBLAZE_PYTHON=$MOEBLAZE_PYTHON lacks what $req asks for:"$'\n'"$unmet"
      return 1
    fi
    [[ -z "$unmet" ]] || echo "note: MOEBLAZE_PYTHON has other versions than $req pins:"$'\n'"$unmet"
    echo "Python tests: MOEBLAZE_PYTHON=$MOEBLAZE_PYTHON (nothing installed)"
    return 0
  fi
  if [[ ! -x "$MOEBLAZE_BASE_PYTHON" ]]; then
    mb_error "$MOEBLAZE_BASE_PYTHON not found: install python3 and python3-venv, or set MOEBLAZE_BASE_PYTHON"
    return 1
  fi
  want="$(sha256sum "$req" | cut -d' ' -f1) $("$MOEBLAZE_BASE_PYTHON" -c 'import sys; print(sys.version.split()[0])')"
  if [[ -x "$py" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    if unmet="$(mb_requirements_unmet "$py" "$req")" && [[ -z "$unmet" ]]; then
      echo "Python environment $venv up to date ($("$py" -c 'import sys; print(sys.version.split()[0])'); $req)"
      return 0
    fi
  fi
  rm -f "$stamp"
  # A broken environment, or one made from another base interpreter, is made again (--clear);
  # a folder that is not a virtual environment is never deleted.
  if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" ]]; then
    mb_error "$venv exists and is not a virtual environment: move it away or set MOEBLAZE_VENV"
    return 1
  fi
  # pip --version, not import pip: an interrupted venv (ensurepip) leaves an importable, broken pip.
  if [[ ! -x "$py" ]] || ! "$py" -m pip --version >/dev/null 2>&1 ||
    [[ "$("$py" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)" != \
      "$("$MOEBLAZE_BASE_PYTHON" -c 'import sys; print(sys.version.split()[0])')" ]]; then
    echo "creating the Python environment $venv from $MOEBLAZE_BASE_PYTHON"
    if ! "$MOEBLAZE_BASE_PYTHON" -m venv --clear "$venv"; then
      mb_error "$MOEBLAZE_BASE_PYTHON -m venv $venv failed (on Debian: apt-get install python3-venv)"
      return 1
    fi
  fi
  echo "installing $req into $venv"
  # PIP_USER=0 and PIP_BREAK_SYSTEM_PACKAGES=0 override any pip configuration that says otherwise;
  # --require-virtualenv refuses to run outside one; binary wheels only (no compiler runs).
  local start=$SECONDS
  if ! PIP_USER=0 PIP_BREAK_SYSTEM_PACKAGES=0 "$py" -m pip install --require-virtualenv \
    --no-input --disable-pip-version-check --no-cache-dir --only-binary=:all: --progress-bar off \
    --retries 5 --timeout 60 -r "$req"; then
    mb_error "pip install -r $req into $venv failed (see pip's message above)"
    return 1
  fi
  unmet="$(mb_requirements_unmet "$py" "$req")"
  if [[ -n "$unmet" ]]; then
    mb_error "after pip install, $venv still does not satisfy $req:"$'\n'"$unmet"
    return 1
  fi
  echo "$want" >"$stamp"
  echo "Python environment $venv ready in $((SECONDS - start))s:" \
    "$("$py" -c 'import sys; print("Python", sys.version.split()[0])')"
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
  mb_check_path checkout "$MOEBLAZE_ROOT" && mb_check_path "build folder" "$MOEBLAZE_BUILD_DIR" || return 1
  if nvcc="$(mb_find_nvcc)"; then
    args+=("-DCMAKE_CUDA_COMPILER=$nvcc")
    echo "nvcc: $nvcc ($("$nvcc" --version | tail -n 2 | head -n 1))"
  else
    echo "nvcc not found: the CUDA backend will not be built"
  fi
  # The Python tests, the SWIG module and the benchmark smoke tests use the set-up's interpreter
  # (MOEBLAZE_PYTHON is a cache entry: given explicitly, so a build folder configured earlier with
  # another interpreter follows). Without one, CMake probes (cmake/python.cmake).
  py="$(mb_test_python)"
  if [[ -x "$py" ]]; then
    args+=("-DPython3_EXECUTABLE=$py" "-DMOEBLAZE_PYTHON=$py")
    if [[ -z "${MOEBLAZE_PYTHON:-}" ]]; then args+=("-DMOEBLAZE_SETUP_VENV=$MOEBLAZE_VENV"); else
      args+=(-DMOEBLAZE_SETUP_VENV=); fi
    echo "Python tests: $py ($("$py" -c 'import sys; print("Python", sys.version.split()[0])'))"
  fi
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

# The CPU main job's own build folder: the CPU library and examples/c/train_moe, nothing else (no
# CUDA kernels, tests, bindings or docs): a few minutes on 2 cores.
MOEBLAZE_MAIN_CPU_BUILD_DIR="${MOEBLAZE_MAIN_CPU_BUILD_DIR:-$MOEBLAZE_BUILD_DIR-main-cpu}"

mb_configure_main_cpu() {
  local args=(-S "$MOEBLAZE_ROOT" -B "$MOEBLAZE_MAIN_CPU_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
    -DMOEBLAZE_CUDA=OFF -DMOEBLAZE_BUILD_TESTS=OFF -DMOEBLAZE_BUILD_EXAMPLES=ON
    -DMOEBLAZE_BUILD_BINDINGS=OFF -DMOEBLAZE_BUILD_DOCS=OFF)
  mb_check_path checkout "$MOEBLAZE_ROOT" && mb_check_path "build folder" "$MOEBLAZE_MAIN_CPU_BUILD_DIR" ||
    return 1
  if command -v ninja >/dev/null 2>&1 && [[ ! -f "$MOEBLAZE_MAIN_CPU_BUILD_DIR/CMakeCache.txt" ]]; then
    args+=(-G Ninja)
  fi
  # shellcheck disable=SC2206
  args+=(${MOEBLAZE_CMAKE_ARGS:-})
  echo "cmake ${args[*]}"
  cmake "${args[@]}"
}

mb_build_main_cpu() {
  cmake --build "$MOEBLAZE_MAIN_CPU_BUILD_DIR" -j "$MOEBLAZE_JOBS" --target train_moe
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  mb_phase setup mb_setup_packages || mb_fail_phases
  mb_phase python mb_python_env || mb_fail_phases
  mb_phase configure mb_configure || mb_fail_phases
  mb_phase build mb_build || mb_fail_phases
  mb_print_phases
fi
