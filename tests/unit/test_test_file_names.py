"""Every test file's basename is unique across tests/: pytest imports them as top-level modules
(rootdir-relative, no packages), so two files of one name make a whole run refuse to collect.
Seen twice: a pytest-xdist tier collected them apart and passed, and the single-process
`timing` tier of `make test` then failed at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    twice = sorted(name for name, n in names.items() if n > 1)
    assert twice == [], f"test files sharing a basename (rename one): {twice}"
