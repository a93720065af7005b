"""Under CI=true a skipped test of a required tier (rgw, promtool) fails the run; elsewhere it
stays a skip. Runs tests/required_tiers.py in a pytest of its own (pytester)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(60)

TESTS = '''
import shutil
import pytest

@pytest.fixture
def rgw_cluster():
    pytest.skip("Ceph RGW not installed (missing radosgw)")

@pytest.mark.promtool
def test_promtool():
    if shutil.which("promtool-that-is-not-here") is None:
        pytest.skip("promtool not installed")

def test_uses_rgw_unmarked(rgw_cluster):
    pass

def test_optional_skip():
    pytest.skip("not a required tier")

@pytest.mark.rgw
@pytest.mark.xfail(reason="known", strict=True)
def test_rgw_xfail():
    assert False

@pytest.mark.rgw
def test_rgw_that_runs():
    pass
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    tests = Path(__file__).resolve().parents[1]  # where required_tiers.py is, for xdist workers
    pytester.makeconftest(f'import sys\nsys.path.insert(0, {str(tests)!r})\n'
                          'pytest_plugins = ["required_tiers"]\n')
    pytester.makeini("[pytest]\nmarkers =\n    rgw: rgw\n    promtool: promtool\n")
    pytester.makepyfile(test_tiers=TESTS)
    return pytester


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_under_ci_a_skipped_required_tier_fails_the_run(suite, monkeypatch, workers):
    """Also through pytest-xdist (`make test` runs the unit tier with -n 2): the failed report
    is made on the worker and must arrive failed."""
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-rA", *workers)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines([
        "*required test tier 'promtool' skipped under CI=true: promtool not installed*",
        "*required test tier 'rgw' skipped under CI=true: Ceph RGW not installed*",
    ])
    result.stdout.fnmatch_lines(["SKIPPED * not a required tier"])


@pytest.mark.parametrize("ci", ["", "false"])
def test_outside_ci_they_stay_skips(suite, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
