"""A full disk mid-run is diagnosed within seconds and never wedges the job (issue 19, goal 4).

A real ds3dd runs the real trainer (`tiny`, one worker, checkpoints every few steps) with the
job folder, or the whole state directory (SQLite included), on a small tmpfs. Once the job is
training, the test fills that tmpfs with one file and checks that

  * one `diagnosis` event (cause `disk_full`) names the file system, its free bytes and the
    bytes needed, within seconds of the fill;
  * the job is neither declared hung nor restarted while the disk stays full (the daemon runs
    with a hang timeout shorter than the time the disk stays full);
  * after the test deletes the file, the job goes on by itself: a `disk_space_back` diagnosis,
    COMPLETED at the last step, every step trained exactly once (no restart, nothing re-run),
    and the saves that did not fit reported as `failed` (cause `disk_full`) with the bytes they
    needed and the bytes free.

Heavy (a real trainer), run serialised:
`flock /tmp/ds3d-heavy.lock .venv/bin/pytest -q tests/integration/test_disk_full.py`.
Needs root to mount a tmpfs: the `tmpfs` tier, required under CI=true (tests/required_tiers.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from support import records
from test_daemon_support import DaemonProc, kill_job_processes

pytest_plugins = ["fixtures.tmpfs"]
pytestmark = [pytest.mark.slow, pytest.mark.tmpfs, pytest.mark.timeout(600)]

HANG_TIMEOUT_S = 10.0
FULL_FOR_S = HANG_TIMEOUT_S + 8.0  # the disk stays full longer than the hang timeout
STEPS = 2000  # far more than the test lets pass before it frees the disk, so it ends the job
INTERVAL = 5


def _diagnoses(daemon: DaemonProc, job: str, cause: str) -> list[dict]:
    return [e for e in daemon.event_details(job) if e["kind"] == "diagnosis"
            and e["cause"] == cause]


def _wait_events(daemon: DaemonProc, job: str, pred, what: str, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [e for e in daemon.event_details(job) if pred(e)]
        if got:
            return got
        time.sleep(0.2)
    recent = [(e["kind"], e["cause"], e["message"][:120])
              for e in daemon.event_details(job)[-15:]]
    raise AssertionError(f"{job}: no {what} within {timeout_s} s: {recent}")


def _run_through_a_full_disk(daemon: DaemonProc, disk: Path, fill_disk, name: str) -> None:
    r = daemon.ctl("start", "tiny", "--name", name, "--steps", str(STEPS),
                   "--set", f"checkpoint.interval={INTERVAL}", "--set", "checkpoint.keep_last=2")
    assert r.returncode == 0, r.stderr
    # a committed checkpoint first: the one that must survive the full disk
    # (RUNNING too: a fast worker's first checkpoint can be read in the tick that sees it start)
    job = daemon.wait_for(name, lambda j: j["state"] == "FAILED" or (
        j["state"] == "RUNNING" and j.get("last_checkpoint_step", -1) >= INTERVAL),
        "a first checkpoint", timeout_s=300)
    assert job["state"] == "RUNNING", job
    run_dir = Path(job["run_dir"])

    filler = fill_disk(disk)
    filled_at = time.time()
    [full] = _wait_events(daemon, name, lambda e: e["kind"] == "diagnosis" and
                          e["cause"] == "disk_full", "disk_full diagnosis", timeout_s=10)
    d = full["detail"]
    assert d["detected_at"] - filled_at < 5.0, d
    assert d["mount"] == str(disk) and d["bytes_free"] < d["bytes_needed"], d
    assert str(disk) in full["message"] and f"free ({d['bytes_free']} bytes)" in full["message"]
    assert f"({d['bytes_needed']} bytes) needed" in full["message"]
    step_at_fill = daemon.job(name)["step"]

    # longer than the hang timeout, yet neither a hang nor a restart: the silence is explained
    time.sleep(max(0.0, filled_at + FULL_FOR_S - time.time()))
    job = daemon.job(name)
    assert job["state"] == "RUNNING" and job["restarts"] == 0, job
    assert not [e for e in daemon.event_details(name) if e["kind"] == "fault"]
    assert "disk full" in job["message"], job["message"]

    filler.unlink()
    freed_at = time.time()
    [back] = _wait_events(daemon, name, lambda e: e["kind"] == "diagnosis" and
                          e["cause"] == "disk_space_back", "disk_space_back diagnosis",
                          timeout_s=15)
    assert back["detail"]["detected_at"] - freed_at < 10.0, back
    # the workers trained on meanwhile: their held records arrive, beyond the step at the fill
    daemon.wait_for(name, lambda j: j["step"] > step_at_fill + 2 * INTERVAL,
                    "progress after the disk had room again", timeout_s=60)
    r = daemon.ctl("stop", name)  # ends the long job with a checkpoint, as a user would
    assert r.returncode == 0, r.stderr
    job = daemon.wait_state(name, "STOPPED", "FAILED", timeout_s=180)
    assert job["state"] == "STOPPED" and job["restarts"] == 0, job

    # every step exactly once, in order: no restart re-ran anything, no record was lost
    steps = [rec["step"] for rec in records(run_dir, 0, "step")]
    assert steps == list(range(1, job["step"] + 1)), steps[-10:]
    assert job["step"] > step_at_fill + 2 * INTERVAL
    # the saves that came while the disk was full failed, said why, and took nothing older
    failed = [rec for rec in records(run_dir, 0, "checkpoint")
              if rec.get("phase") == "failed" and rec.get("cause") == "disk_full"]
    assert [rec for rec in failed if rec["time"] >= filled_at], \
        f"no save was attempted while the disk was full: {failed}"
    for rec in failed:
        assert 0 < rec["bytes_needed"] and rec["path"].startswith(str(disk)), rec
        assert f"({rec['bytes_needed']} bytes) needed" in rec["detail"], rec
        # free is measured once the save's partial files are gone (snapshot.py), and the
        # workers' report lines share the disk: a save that missed by little can then find up
        # to its partial file's size free again; never a disk with room to spare. But for a
        # save that failed while the test was still filling: tmpfs gives back all of a
        # fallocate that a concurrent save made fail, before `fill` writes the rest. And for a
        # save that ran out of space just before the filler was removed and measured the free
        # bytes just after (CI 2026-12-06: 87 MB free, recorded 0.03 s after the unlink)
        around_the_unlink = freed_at <= rec["time"] < freed_at + 10.0
        assert rec["time"] < filled_at or around_the_unlink or \
            rec["bytes_free"] < rec["bytes_needed"] + (1 << 20), (rec, filled_at, freed_at)
        assert not (run_dir / "ckpt" / f"global_step{rec['step']}").exists()
    events = [e for e in daemon.event_details(name) if e["kind"] == "checkpoint"
              and e["cause"] == "disk_full"]
    assert {e["step"] for e in events} == {rec["step"] for rec in failed}
    assert all("dropped" in e["message"] for e in events)
    # the save at the stop, after the disk had room again, is committed
    cks = json.loads(daemon.ctl("checkpoints", name, "--json").stdout)
    assert cks[-1]["step"] == job["step"] and cks[-1]["phase"] == "committed", cks[-1]


@pytest.fixture
def state(tmp_path: Path):
    yield tmp_path / "state"
    kill_job_processes(tmp_path / "state")


def test_job_folder_full_mid_run(state: Path, small_tmpfs, fill_disk) -> None:
    """The jobs folder (reports, control files, logs, the local tier and the default file
    store) on a 64 MiB tmpfs; the daemon's SQLite on the test's own disk."""
    jobs = small_tmpfs(64 << 20, where=state / "jobs")
    with DaemonProc(state, args=["--hang-timeout", str(HANG_TIMEOUT_S)]) as daemon:
        _run_through_a_full_disk(daemon, jobs, fill_disk, "jobfull")


def test_state_dir_full_mid_run(state: Path, small_tmpfs, fill_disk) -> None:
    """The whole state directory (SQLite, the daemon's log, the jobs folder) on the tmpfs.
    Here the disk is not full all the time: the daemon releases its reserve file, retention
    deletes old steps, SQLite and the daemon's log take pages, so writes that fit at one moment
    do not the next. Two such writes used to end the worker (its agent restarted the group:
    restarts == 1, as in CI on 2026-12-04): DeepSpeed's truncating copy of zero_to_fp32.py into
    the checkpoint folder at every save (seen here: ENOSPC out of save_checkpoint; now made
    once, checkpoints/recovery_scripts.py), and an upload marker refused after the save's files
    fitted (now that save fails like one that did not fit, checkpoints/snapshot.py)."""
    small_tmpfs(96 << 20, where=state)
    with DaemonProc(state, args=["--hang-timeout", str(HANG_TIMEOUT_S)]) as daemon:
        _run_through_a_full_disk(daemon, state, fill_disk, "statefull")
        assert os.path.exists(state / "ds3dd.reserve")  # made again once there was room
        # SQLite refusing writes is one line now and then, not a traceback every tick
        log = (state / "ds3dd.log").read_text(errors="replace")
        assert "supervisor tick failed" not in log
