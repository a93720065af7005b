"""The order in which `make test`'s process tier hands its modules to the two xdist workers.

Why: under `--dist loadfile` a module is one unit of work, and a worker that finishes early
idles while the other runs its last module. xdist's default queue (most tests first) puts the
one-test modules last, the very last a 75 s one (test_store_outage_at_end), which the other
worker can spend idle. Longest first (the modules below, slowest first, by the CI durations
of 2026-12-05) leaves only short modules for the end. Only the order changes: the modules not
listed follow in xdist's own order. Active with `--dist loadfile --no-loadscope-reorder` alone
(the Makefile's process tier); elsewhere the collection order stands.
"""

from __future__ import annotations

import pytest

# slowest first; each took 30 s or more of test time on the 2-core CI machine
LONGEST_FIRST = (
    "tests/integration/test_backlog_upload.py",
    "tests/integration/test_multinode_daemons.py",
    "tests/drills/test_daemon_drills.py",
    "tests/integration/test_head_failover.py",
    "tests/integration/test_rgw_outage_training.py",
    "tests/integration/test_e2e_daemon.py",
    "tests/integration/test_two_commits.py",
    "tests/integration/test_store_outage_at_end.py",
    "tests/drills/test_node_memory_daemon.py",
    "tests/integration/test_disk_full.py",
    "tests/integration/test_measured_partition.py",
    "tests/integration/test_daemon_lifecycle.py",
    "tests/drills/test_hang_suspect_drill.py",
    "tests/drills/test_trainer_faults.py",
    "tests/integration/test_reshape.py",
    "tests/drills/test_memory_snapshot_recovery.py",
    "tests/drills/test_node_memory_restart.py",
    "tests/drills/test_startup_lock_drill.py",
    "tests/integration/test_export.py",
    "tests/drills/test_oom_drill.py",
    "tests/integration/test_checkpoint_truth.py",
)


def module_order(tests_per_module: dict[str, int]) -> list[str]:
    """The modules (paths relative to the repository -> their number of tests, in collection
    order) in scheduling order: those of LONGEST_FIRST in its order, then the others as xdist
    would queue them (most tests first, ties in collection order)."""
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    modules = list(tests_per_module)
    return sorted(modules, key=lambda m: (rank.get(m, len(rank)), -tests_per_module[m],
                                          modules.index(m)))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("dist", "no") != "loadfile" or \
            config.getoption("loadscopereorder", True):
        return
    root = config.rootpath
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.path.relative_to(root).as_posix(), []).append(item)
    order = module_order({m: len(module_items) for m, module_items in by_module.items()})
    items[:] = [item for m in order for item in by_module[m]]
