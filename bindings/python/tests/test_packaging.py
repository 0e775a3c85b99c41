"""The package's version agrees with the header and pyproject.toml (the wheel check,
wheel_check.py, builds and installs the wheel itself)."""

import re

import moeblaze
from conftest import HEADER, _PACKAGE_ROOT


def test_version_is_the_headers_and_pyprojects():
    header = HEADER.read_text()
    parts = [re.search(rf"#define MOEBLAZE_VERSION_{p} (\d+)", header).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    expected = ".".join(parts)
    pyproject = (_PACKAGE_ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == expected
    assert moeblaze.__version__ == expected
    major, minor, patch = (int(p) for p in parts)
    assert moeblaze.get_version() == major * 10000 + minor * 100 + patch
