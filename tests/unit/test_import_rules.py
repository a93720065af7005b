"""The import graph follows the layers: storage (`checkpoints/`) knows neither the trainer nor
the daemon, and the trainer (the data plane) knows neither the daemon nor the gRPC contract
(`protos/`, imported as `ds3d.v1`). Every import counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"checkpoints": "ds3d.checkpoints", "trainer": "ds3d.trainer", "daemon": "ds3d.daemon",
            "protos": "ds3d.v1"}


def imports_of(folder: str, forbidden: str) -> list[str]:
    """'file.py:line module' for every import of `forbidden` (a package) in `folder`."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                      if n == forbidden or n.startswith(forbidden + ".")]
    return found


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("checkpoints", "trainer"),
    ("checkpoints", "daemon"),
    ("trainer", "daemon"),
    ("trainer", "protos"),
])
def test_layer_does_not_import(folder, forbidden):
    found = imports_of(folder, PACKAGES[forbidden])
    assert not found, f"{folder}/ must not import {PACKAGES[forbidden]}:\n" + "\n".join(found)


def test_the_rule_sees_imports():
    """The scan finds what is there (so an empty result above means something)."""
    assert imports_of("daemon", "ds3d.checkpoints")  # `from ds3d.checkpoints.x import ...`
    assert imports_of("daemon", "ds3d.v1")


# ds3dd and ds3dctl are control-plane processes: importing torch costs each start ~2.5 CPU-s
# and ~150 MB (the test suite starts hundreds of them; a node runs the daemon for weeks). Only
# the agent and the workers import it, inside functions where the daemon reaches them.
NO_TORCH = "import sys; sys.modules['torch'] = None; import importlib; " \
    "[importlib.import_module(m) for m in sys.argv[1:]]"


def test_daemon_and_cli_start_without_torch():
    import subprocess
    import sys

    modules = ["ds3d.daemon.main", "ds3d.daemon.server", "ds3d.daemon.cli"]
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *modules], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    # the check itself bites: a module that needs torch fails under it
    out = subprocess.run([sys.executable, "-c", NO_TORCH, "ds3d.checkpoints.engine_io"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "torch" in out.stderr
