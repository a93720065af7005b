"""Under CI (CI=true), a required test tier that skips fails the run.

The RGW tests skip where Ceph's packages are missing and the promtool tests where promtool is,
which is right on a developer's machine but would let CI stay green after a failed install.
The disk-full tests (`tmpfs`) skip where a tmpfs cannot be mounted (not root, no
CAP_SYS_ADMIN): CI runs as root, so there a skip means a broken runner, not a choice.
The etcd tests skip where Debian's etcd-server is missing; tests using its fixtures get `etcd`.
Tests of a required tier carry its marker (`rgw`, `promtool`, `tmpfs`); tests that use the Ceph RGW
fixture get `rgw` whether or not they were marked. Under CI, such a test's skip is reported as
a failure that quotes the skip's reason (what to install).
"""

from __future__ import annotations

import os

import pytest

REQUIRED_TIERS = ("rgw", "promtool", "tmpfs", "etcd")  # tmpfs: disk-full (fixtures/tmpfs.py)
RGW_FIXTURE = "rgw_cluster"  # every RGW fixture depends on it (tests/fixtures/rgw.py)
ETCD_FIXTURES = ("etcd_server", "etcd_cluster")  # tests/fixtures/etcd.py


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def required_tier(item: pytest.Item) -> str | None:
    return next((m for m in REQUIRED_TIERS if item.get_closest_marker(m) is not None), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if RGW_FIXTURE in getattr(item, "fixturenames", ()) and \
                item.get_closest_marker("rgw") is None:
            item.add_marker(pytest.mark.rgw)
        if any(f in ETCD_FIXTURES for f in getattr(item, "fixturenames", ())) and \
                item.get_closest_marker("etcd") is None:
            item.add_marker(pytest.mark.etcd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (report.skipped and under_ci()) or hasattr(report, "wasxfail"):
        return
    tier = required_tier(item)
    if tier is None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (f"required test tier {tier!r} skipped under CI=true: {reason}\n"
                       f"(.ci/run installs it; a CI run without it must not pass)")
