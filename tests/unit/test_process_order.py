"""The process tier's module order (tests/process_order.py): longest known modules first, the
others as xdist would queue them, every module exactly once."""

from __future__ import annotations

from process_order import LONGEST_FIRST, module_order


def test_listed_modules_come_first_in_their_order_then_most_tests_first() -> None:
    listed = [LONGEST_FIRST[3], LONGEST_FIRST[0]]
    counts = {"tests/integration/test_a.py": 1, listed[0]: 2,
              "tests/integration/test_b.py": 7, listed[1]: 5,
              "tests/integration/test_c.py": 7}
    assert module_order(counts) == [LONGEST_FIRST[0], LONGEST_FIRST[3],
                                    "tests/integration/test_b.py",
                                    "tests/integration/test_c.py",
                                    "tests/integration/test_a.py"]


def test_every_listed_module_exists_once() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [m for m in LONGEST_FIRST if not (root / m).is_file()] == []
