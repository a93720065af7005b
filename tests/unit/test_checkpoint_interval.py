"""`checkpoint.interval = "auto"`: the Young-Daly arithmetic on a simulated fault history, and
the daemon's failure history that feeds it."""

import json
import math

import pytest

from ds3d.daemon.failure_history import FailureHistory
from ds3d.daemon.reports import describe_interval
from ds3d.daemon.states import JobState
from ds3d.daemon.store import Store
from ds3d.trainer.checkpoint_interval import (
    FAILURES_FILE,
    AutoInterval,
    FailureReading,
    mtbf_estimate,
    young_daly,
)
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError

H = 3600.0


def test_young_daly_is_sqrt_of_twice_cost_times_mtbf():
    assert young_daly(10.0, 5 * H) == pytest.approx(600.0)  # sqrt(2 * 10 * 18000)
    assert young_daly(0.0, H) == 0.0
    with pytest.raises(ValueError):
        young_daly(1.0, 0.0)


def test_mtbf_moves_from_the_prior_to_the_observed_rate():
    assert mtbf_estimate(6 * H, 0, 0.0) == 6 * H          # nothing observed: the prior
    assert mtbf_estimate(6 * H, 2, 12 * H) == 6 * H       # (6 + 12) h / (1 + 2)
    # 100 failures in 200 h: the data dominate (true MTBF 2 h), the prior shifts it a little
    assert mtbf_estimate(6 * H, 100, 200 * H) == pytest.approx(206 * H / 101)
    assert mtbf_estimate(6 * H, 3, 1 * H) == pytest.approx(7 * H / 4)


def _history(control, failures, observed_s):
    (control / FAILURES_FILE).write_text(json.dumps({"failures": failures,
                                                     "observed_s": observed_s}))


def test_interval_follows_a_simulated_fault_history(tmp_path):
    """A job's life: prior only, first measured save, then failures observed by the daemon."""
    auto = AutoInterval(FailureReading(tmp_path, prior_hours=6.0, reread_s=0.0),
                        initial_cost_s=30.0)
    d = auto.decision
    assert not d.measured and d.save_cost_s == 30.0 and d.mtbf_s == 6 * H
    assert d.interval_s == pytest.approx(math.sqrt(2 * 30.0 * 6 * H))  # 1138.4 s

    # the first save: blocked 0.4 s, durable 40 s after the save started
    auto.saved(step=100, blocked_s=0.4, now=1000.0)
    auto.committed(step=100, now=1000.0 - 0.4 + 40.0)
    d = auto.update()
    assert d is not None and d.measured
    assert d.blocked_s == pytest.approx(0.4) and d.commit_s == pytest.approx(40.0)
    assert d.save_cost_s == pytest.approx(40.4)
    assert d.interval_s == pytest.approx(math.sqrt(2 * 40.4 * 6 * H))

    # the daemon saw 3 failures in 2 h of running: MTBF (6 + 2) / 4 = 2 h
    _history(tmp_path, 3, 2 * H)
    assert auto.history.read(now=2000.0)
    d = auto.update()
    assert d is not None and d.failures == 3 and d.mtbf_s == pytest.approx(2 * H)
    assert d.interval_s == pytest.approx(math.sqrt(2 * 40.4 * 2 * H))  # 762.6 s
    assert auto.update() is None  # nothing changed: no new report

    # due once the newest save is older than the interval
    assert not auto.due(now=1000.0 + d.interval_s - 1)
    assert auto.due(now=1000.0 + d.interval_s + 1)


def test_interval_is_never_shorter_than_the_time_to_commit(tmp_path):
    """A store down to a crawl (commit 300 s) and failures every few seconds (50 in 6 min):
    Young-Daly says 68 s, but a save before the previous one is durable buys nothing. (With C
    counting the commit time, the floor binds only when MTBF < C / 2.)"""
    auto = AutoInterval(FailureReading(tmp_path, prior_hours=0.01, reread_s=0.0),
                        initial_cost_s=30.0)
    auto.saved(step=10, blocked_s=0.5, now=0.0)
    auto.committed(step=10, now=300.0)
    _history(tmp_path, 50, 0.1 * H)
    auto.history.read(now=1.0)
    d = auto.update()
    assert d is not None
    # commit_s runs from the start of the save (0 - 0.5 s blocked) to the commit (300 s)
    assert d.commit_s == pytest.approx(300.5) and d.save_cost_s == pytest.approx(301.0)
    assert d.young_daly_s == pytest.approx(math.sqrt(2 * 301.0 * 0.11 * H / 51))
    assert d.mtbf_s == pytest.approx(0.11 * H / 51)
    assert d.young_daly_s < 300.5 and d.interval_s == pytest.approx(300.5)


def test_a_bad_or_missing_history_file_keeps_the_last_good_one(tmp_path):
    auto = AutoInterval(FailureReading(tmp_path, prior_hours=6.0, reread_s=0.0),
                        initial_cost_s=30.0)
    assert not auto.history.read()  # no daemon: the prior
    _history(tmp_path, 2, 100.0)
    assert auto.history.read()
    (tmp_path / FAILURES_FILE).write_text("{not json")
    assert not auto.history.read()
    _history(tmp_path, -1, 5.0)
    assert not auto.history.read()
    assert (auto.history.failures, auto.history.observed_s) == (2, 100.0)


def test_config_takes_auto_or_a_step_count():
    assert build_job_config("tiny", ['checkpoint.interval="auto"']).checkpoint.interval == "auto"
    assert build_job_config("tiny", ["checkpoint.interval=25"]).checkpoint.interval == 25
    with pytest.raises(ConfigError, match="checkpoint.interval"):
        build_job_config("tiny", ['checkpoint.interval="often"'])
    with pytest.raises(ConfigError, match="auto_mtbf_prior_hours"):
        build_job_config("tiny", ["checkpoint.auto_mtbf_prior_hours=0"])


def test_daemon_publishes_recoveries_and_running_time(tmp_path):
    store = Store(tmp_path / "ds3d.db")
    store.create_job("j", "{}", "n", str(tmp_path))
    store.transition("j", JobState.STARTING, "starting")
    store.transition("j", JobState.RUNNING, "running")
    written: list[tuple[str, str]] = []
    history = FailureHistory(store, "j", every_s=30.0)
    assert history.publish(lambda f, t: written.append((f, t)), now=0.0)
    assert json.loads(written[-1][1])["failures"] == 0
    assert not history.publish(lambda f, t: written.append((f, t)), now=10.0)  # not yet due
    store.record("j", "recovered", "crash: back", cause="worker_exit")
    store.record("j", "recovered", "nan: back", cause="nan")
    assert history.publish(lambda f, t: written.append((f, t)), now=11.0)  # count changed
    data = json.loads(written[-1][1])
    assert written[-1][0] == FAILURES_FILE and data["failures"] == 2
    store.transition("j", JobState.PAUSED, "paused")
    times = [e.time for e in store.events(job="j", kinds=["state"])]  # pending, starting, ...
    running = store.seconds_in("j", [JobState.STARTING, JobState.RUNNING], now=times[-1] + 1000)
    assert running == pytest.approx(times[3] - times[1])  # from STARTING to PAUSED
    # paused time is not exposure: the running time stops growing
    assert store.seconds_in("j", [JobState.RUNNING], now=times[-1] + 1000) == \
        pytest.approx(times[3] - times[2])


def test_status_line_names_every_input():
    line = describe_interval({"interval_s": 762.6, "young_daly_s": 762.6, "save_cost_s": 40.4,
                              "blocked_s": 0.4, "commit_s": 40.0, "mtbf_s": 7200.0,
                              "mtbf_prior_s": 21600.0, "failures": 3, "observed_s": 7200.0,
                              "measured": True})
    assert "every 763 s" in line and "C 40.4 s" in line and "MTBF 2.00 h" in line
    assert "3 failure(s) in 2.00 h" in line and "prior of 6.0 h" in line
