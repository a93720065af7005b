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
