import os
import random
import sys
from pathlib import Path

import pytest

# Tests run against the source tree's package unless PYTHONPATH already provides one.
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
if str(_PACKAGE_ROOT) not in sys.path:
    sys.path.insert(0, str(_PACKAGE_ROOT))

REPO_ROOT = _PACKAGE_ROOT.parent.parent
HEADER = REPO_ROOT / "include" / "moeblaze.h"


@pytest.fixture
def seed(request):
    """A per-test seed, printed so a failure can be replayed (MOEBLAZE_TEST_SEED overrides)."""
    value = int(os.environ.get("MOEBLAZE_TEST_SEED", random.randrange(1 << 31)))
    print(f"[{request.node.name}] seed = {value}")
    return value


def run_python(script):
    """Runs `script` in a fresh interpreter that imports this moeblaze package."""
    import subprocess

    import moeblaze

    package_root = str(Path(moeblaze.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=path))
