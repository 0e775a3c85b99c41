"""Library discovery and the ABI check, each in a fresh interpreter (the loader runs once)."""

import os
import subprocess
import sys
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def run(code, library):
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, MOEBLAZE_LIBRARY=library)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_explicit_library_file_and_folder():
    import moeblaze
    path = moeblaze.library_path()
    code = "import moeblaze; print(moeblaze.library_path()); print(moeblaze.get_abi_version())"
    for library in (path, os.path.dirname(path)):
        result = run(code, library)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split()[0] == path


def test_missing_library_is_a_clear_error_not_another_library(tmp_path):
    result = run("import moeblaze; moeblaze.get_version()", str(tmp_path / "nope.so"))
    assert result.returncode != 0
    assert "OSError" in result.stderr and "MOEBLAZE_LIBRARY" in result.stderr
    assert "nope.so" in result.stderr


def test_importing_the_package_does_not_load_the_library():
    result = run("import moeblaze, moeblaze._lib as l; print(l._lib_instance is None)", "/nope")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
