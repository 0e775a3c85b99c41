#!/usr/bin/env bash
# The set-up never writes outside the project (label scripts). Three parts:
#   1. scripts/ and .ci/ never ask pip for a user or system-wide install, and every pip install in
#      them refuses to run outside a virtual environment;
#   2. the Python tests run under the set-up's virtual environment (when scripts/setup.sh configured
#      the build): MOEBLAZE_PYTHON is its interpreter, isolated from the system's and the user's
#      site-packages, and numpy, pytest and torch come from inside it;
#   3. scripts/setup.sh's mb_python_env on a scratch environment with two local wheels (no network):
#      installs the pins, does nothing when they are met, follows a changed pin, remakes an
#      environment whose pip does not run, lets two set-ups at once both succeed, fails with a message
#      naming the requirements file for an unsatisfiable or unpinned requirement, never installs
#      into a given MOEBLAZE_PYTHON (another version there is reported, a missing package is an
#      error), and leaves $HOME and the base interpreter untouched.
#
#   tests/scripts/setup_stays_in_project.sh <configured MOEBLAZE_PYTHON> <configured MOEBLAZE_SETUP_VENV>
set -uo pipefail
root="$(CDPATH='' cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)"
configured_python="${1:-}"
setup_venv="${2:-}"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }

# ---- 1. no user or system-wide pip installs in the scripts --------------------------------------
scripts=("$root"/scripts/*.sh "$root"/.ci/run)
code_lines() { grep -nHv '^[[:space:]]*#' "$@"; }
if hits="$(code_lines "${scripts[@]}" | grep -E -- '--user([^-[:alnum:]]|$)|--break-system-packages|PIP_USER=(1|[Tt]rue|[Yy]es)|PIP_BREAK_SYSTEM_PACKAGES=(1|[Tt]rue|[Yy]es)|sudo[^|;&]*pip')"; then
  fail "user or system-wide pip install in the scripts:"$'\n'"$hits"
else
  pass "no --user, --break-system-packages or sudo pip in ${#scripts[@]} scripts"
fi
pip_install='(-m pip|^[^"]*:[[:space:]]*(sudo[[:space:]]+)?pip[0-9.]*|[;&|][[:space:]]*pip[0-9.]*)[[:space:]]+install'
if hits="$(code_lines "${scripts[@]}" | grep -E "$pip_install" | grep -v -- '--require-virtualenv')"; then
  fail "pip install without --require-virtualenv:"$'\n'"$hits"
else
  pass "every pip install in the scripts has --require-virtualenv"
fi

# shellcheck source=scripts/setup.sh
source "$root/scripts/setup.sh"

# ---- 2. the configured interpreter is the set-up's environment ----------------------------------
if [[ -n "$setup_venv" ]]; then
  if [[ "$configured_python" != "$setup_venv/bin/python" ]]; then
    fail "MOEBLAZE_PYTHON is '$configured_python', not the set-up's $setup_venv/bin/python"
  elif ! report="$("$configured_python" - "$setup_venv" <<'PY'
import os, site, sys
venv = os.path.realpath(sys.argv[1])
problems = []
if os.path.realpath(sys.prefix) != venv:
    problems.append(f"sys.prefix {sys.prefix} is not {venv}")
if sys.prefix == sys.base_prefix:
    problems.append("not a virtual environment (sys.prefix == sys.base_prefix)")
if site.ENABLE_USER_SITE:
    problems.append("the user's site-packages is visible")
cfg = open(os.path.join(venv, "pyvenv.cfg")).read().replace(" ", "")
if "include-system-site-packages=false" not in cfg:
    problems.append("pyvenv.cfg lets the system's site-packages in")
import numpy, pytest, torch
for module in (numpy, pytest, torch):
    if not os.path.realpath(module.__file__).startswith(venv + os.sep):
        problems.append(f"{module.__name__} comes from {module.__file__}, outside {venv}")
major, minor = (int(part) for part in torch.__version__.split(".")[:2])
if (major, minor) < (2, 5):
    problems.append(f"torch {torch.__version__} is older than 2.5")
print(f"Python {sys.version.split()[0]}, numpy {numpy.__version__}, pytest {pytest.__version__}, "
      f"torch {torch.__version__}")
for problem in problems:
    print("PROBLEM:", problem)
sys.exit(1 if problems else 0)
PY
)"; then
    fail "the set-up's environment $setup_venv:"$'\n'"$report"
  else
    pass "the Python tests run under $configured_python ($report)"
    unmet="$(mb_requirements_unmet "$configured_python" "$root/bindings/python/requirements-test.txt")"
    if [[ -n "$unmet" ]]; then fail "$setup_venv does not match the requirements file:"$'\n'"$unmet"; else
      pass "$setup_venv has every pin of bindings/python/requirements-test.txt"; fi
  fi
else
  echo "note: configured without scripts/setup.sh's environment (MOEBLAZE_PYTHON='$configured_python'): part 2 not checked"
fi

# ---- 3. mb_python_env on a scratch environment ---------------------------------------------------
base="${MOEBLAZE_BASE_PYTHON:-/usr/bin/python3}"
if ! "$base" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  echo "$base cannot make virtual environments (python3-venv missing): part 3 skipped"
  ((failures == 0)) && exit 77
  exit 1
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/home" "$scratch/tmp" "$scratch/wheels" "$scratch/project"
# Two versions of a one-module wheel, made by hand (a wheel is a zip with its metadata).
"$base" - "$scratch/wheels" <<'PY'
import base64, hashlib, sys, zipfile
for version in ("1.0", "2.0"):
    files = {
        "moeblaze_probe/__init__.py": f"VERSION = {version!r}\n",
        f"moeblaze_probe-{version}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: moeblaze-probe\nVersion: {version}\n",
        f"moeblaze_probe-{version}.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = f"moeblaze_probe-{version}.dist-info/RECORD"
    lines = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        lines.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[record] = "\n".join(lines + [f"{record},,"]) + "\n"
    with zipfile.ZipFile(f"{sys.argv[1]}/moeblaze_probe-{version}-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
PY
user_site="$("$base" -c 'import site; print(site.getusersitepackages())')"
user_site_before="$(ls -la --time-style=+%s "$user_site" 2>&1)"

# pip runs `rustc --version` for its user agent; a rustup proxy would write its settings into the
# empty $HOME, so it keeps its own home.
export RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}" CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}"
export HOME="$scratch/home" TMPDIR="$scratch/tmp"
export MOEBLAZE_VENV="$scratch/project/.venv" MOEBLAZE_REQUIREMENTS="$scratch/project/requirements.txt"
unset MOEBLAZE_PYTHON
requirements() { printf -- '--no-index\n--find-links %s\n%s\n' "$scratch/wheels" "$1" >"$MOEBLAZE_REQUIREMENTS"; }
probe_version() { "$MOEBLAZE_VENV/bin/python" -c 'import moeblaze_probe; print(moeblaze_probe.VERSION)' 2>&1; }
env_step() { (mb_python_env) >"$scratch/out" 2>&1; }

requirements "moeblaze-probe==1.0"
if env_step && [[ "$(probe_version)" == 1.0 ]]; then pass "a new environment gets the pin (1.0)"; else
  fail "new environment:"$'\n'"$(cat "$scratch/out")"; fi
start=$SECONDS
if env_step && grep -q "up to date" "$scratch/out" && ! grep -q "installing" "$scratch/out"; then
  pass "a complete environment is left alone ($((SECONDS - start))s)"
else fail "second set-up with nothing changed:"$'\n'"$(cat "$scratch/out")"; fi
requirements "moeblaze-probe==2.0"
if env_step && [[ "$(probe_version)" == 2.0 ]]; then pass "a changed pin is installed (2.0)"; else
  fail "changed pin:"$'\n'"$(cat "$scratch/out")"; fi
# An interrupted creation leaves a pip that imports but does not run: the environment is made again.
rm -f "$MOEBLAZE_VENV"/lib/python*/site-packages/pip/__main__.py "$MOEBLAZE_VENV/.moeblaze-requirements"
if env_step && grep -q "creating" "$scratch/out" && [[ "$(probe_version)" == 2.0 ]]; then
  pass "an environment whose pip does not run is made again"
else fail "environment with a broken pip:"$'\n'"$(cat "$scratch/out")"; fi
# Two set-ups at once take turns: neither deletes the environment under the other's pip (the second
# starts while the first makes it; without the lock both failed).
rm -rf "$MOEBLAZE_VENV"
(mb_python_env) >"$scratch/out1" 2>&1 &
first=$!
sleep 1
(mb_python_env) >"$scratch/out2" 2>&1 &
second=$!
wait "$first"
first_rc=$?
wait "$second"
second_rc=$?
if ((first_rc == 0 && second_rc == 0)) && [[ "$(probe_version)" == 2.0 ]]; then
  pass "two set-ups at once both succeed"
else fail "two set-ups at once ($first_rc, $second_rc):"$'\n'"$(cat "$scratch/out1" "$scratch/out2")"; fi
requirements "moeblaze-probe==3.0"
if env_step; then fail "an unsatisfiable pin (3.0) passed"
elif grep -q "ERROR: pip install -r $MOEBLAZE_REQUIREMENTS" "$scratch/out"; then
  pass "an unsatisfiable pin fails with: $(grep ERROR: "$scratch/out" | tail -n 1)"
else fail "an unsatisfiable pin failed without naming it:"$'\n'"$(cat "$scratch/out")"; fi
requirements "moeblaze-probe"
if env_step; then fail "an unpinned requirement passed"
elif grep -q "not pinned" "$scratch/out"; then pass "an unpinned requirement is an error"
else fail "an unpinned requirement failed without saying so:"$'\n'"$(cat "$scratch/out")"; fi
# A user's own interpreter is checked, never installed into.
requirements "moeblaze-probe==2.0"
if MOEBLAZE_PYTHON="$MOEBLAZE_VENV/bin/python" env_step && grep -q "nothing installed" "$scratch/out"; then
  pass "MOEBLAZE_PYTHON that meets the pins is used as it is"
else fail "MOEBLAZE_PYTHON meeting the pins:"$'\n'"$(cat "$scratch/out")"; fi
requirements "moeblaze-probe==1.0"
if MOEBLAZE_PYTHON="$MOEBLAZE_VENV/bin/python" env_step && [[ "$(probe_version)" == 2.0 ]] &&
  grep -q "moeblaze-probe: 2.0 installed, 1.0 required" "$scratch/out"; then
  pass "MOEBLAZE_PYTHON with another version: reported, nothing installed into it"
else fail "MOEBLAZE_PYTHON with another version:"$'\n'"$(cat "$scratch/out")"$'\n'"probe: $(probe_version)"; fi
requirements "moeblaze-probe-absent==1.0"
if MOEBLAZE_PYTHON="$MOEBLAZE_VENV/bin/python" env_step; then fail "MOEBLAZE_PYTHON lacking a package passed"
elif grep -q "moeblaze-probe-absent: not installed" "$scratch/out" &&
  ! "$MOEBLAZE_VENV/bin/python" -m pip show -q moeblaze-probe-absent >/dev/null 2>&1; then
  pass "MOEBLAZE_PYTHON lacking a package is an error, and nothing is installed into it"
else fail "MOEBLAZE_PYTHON lacking a package:"$'\n'"$(cat "$scratch/out")"; fi

# Nothing outside the scratch project.
if [[ -n "$(find "$HOME" -mindepth 1 | head -n 5)" ]]; then
  fail "files written into \$HOME: $(find "$HOME" -mindepth 1 | head -n 5 | tr '\n' ' ')"
else pass "\$HOME untouched"; fi
if [[ "$(ls -la --time-style=+%s "$user_site" 2>&1)" != "$user_site_before" ]]; then
  fail "the user's site-packages $user_site changed"
else pass "the user's site-packages ($user_site) untouched"; fi
if "$base" -c 'import moeblaze_probe' >/dev/null 2>&1; then
  fail "the probe package is importable from $base"
else pass "$base does not see the probe package"; fi

if ((failures)); then echo "$failures check(s) failed"; exit 1; fi
echo "all checks passed"
