"""The install path: `pip wheel bindings/python` builds libmoeblaze into a wheel that works alone.

    python bindings/python/tests/wheel_check.py [--work DIR] [--cuda]

Builds the wheel with pip (scikit-build-core driving CMake; CPU-only unless --cuda, so that the
check takes about a minute), then checks that the wheel holds the package and the library, installs
it into an empty folder, and, from outside the checkout and with no MOEBLAZE_LIBRARY set, that
`import moeblaze` loads the library from the package folder, that `moeblaze.__version__` is the
project's version, and that examples/python/ctypes_direct.py finds the installed library and
trains. Uses the interpreter's own scikit-build-core when it has one (no download), else pip's build
isolation. Prints the build time; exits non-zero on any failure.
"""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_SOURCE = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(PACKAGE_SOURCE))


def project_version() -> str:
    """The version (major, minor, patch) from include/moeblaze.h, where CMake takes it from."""
    with open(os.path.join(REPO, "include", "moeblaze.h")) as f:
        header = f.read()
    parts = [re.search(rf"#define MOEBLAZE_VERSION_{part} (\d+)", header) for part in
             ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise SystemExit("cannot find MOEBLAZE_VERSION_MAJOR/MINOR/PATCH in include/moeblaze.h")
    return ".".join(match.group(1) for match in parts)


def run(command, **kwargs):
    print("+ " + " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--cuda", action="store_true",
                        help="let CMake build the CUDA backend when nvcc is found (slow)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="moeblaze-wheel-")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    wheels, site = os.path.join(work, "wheels"), os.path.join(work, "site")

    command = [sys.executable, "-m", "pip", "wheel", PACKAGE_SOURCE, "--no-deps", "-w", wheels,
               f"--config-settings=build-dir={os.path.join(work, 'build')}"]
    if not args.cuda:
        command.append("--config-settings=cmake.define.MOEBLAZE_CUDA=OFF")
    if importlib.util.find_spec("scikit_build_core") is not None:
        command.append("--no-build-isolation")
    start = time.monotonic()
    run(command)
    print(f"wheel built in {time.monotonic() - start:.0f} s", flush=True)

    built = [name for name in os.listdir(wheels) if name.endswith(".whl")]
    if len(built) != 1:
        raise SystemExit(f"expected one wheel in {wheels}, found {built}")
    wheel = os.path.join(wheels, built[0])
    version = project_version()
    if not built[0].startswith(f"moeblaze-{version}-"):
        raise SystemExit(f"wheel {built[0]}: expected version {version}")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {"moeblaze/__init__.py", "moeblaze/_lib.py", "moeblaze/torch.py", "moeblaze/hf.py",
              "moeblaze/libmoeblaze.so.0"}
    if not needed <= names:
        raise SystemExit(f"wheel {built[0]} lacks {sorted(needed - names)}")
    print(f"{built[0]}: {len(names)} files, the library included")

    run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, wheel])
    environment = {k: v for k, v in os.environ.items() if k not in ("MOEBLAZE_LIBRARY",
                                                                      "PYTHONPATH")}
    environment["PYTHONPATH"] = site
    check = ("import moeblaze, os, sys; path = moeblaze.library_path(); "
             f"assert path.startswith({site!r}), path; "
             f"assert moeblaze.__version__ == {version!r}, moeblaze.__version__; "
             "print('import moeblaze:', path, moeblaze.__version__); "
             "print(moeblaze.build_info())")
    outside = tempfile.mkdtemp(prefix="moeblaze-outside-")  # no build tree next to it
    try:
        run([sys.executable, "-c", check], env=environment, cwd=outside)
        script = os.path.join(outside, "ctypes_direct.py")  # a copy: no checkout to fall back on
        shutil.copy(os.path.join(REPO, "examples", "python", "ctypes_direct.py"), script)
        result = run([sys.executable, script], env=environment, cwd=outside,
                     stdout=subprocess.PIPE, text=True)
        print(result.stdout, end="")
        first = result.stdout.splitlines()[0]
        if not first.startswith(f"library: {site}"):
            raise SystemExit(f"ctypes_direct.py did not use the installed library: {first}")
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    print("wheel check passed")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
