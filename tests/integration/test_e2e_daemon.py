"""End to end through the real binaries: `ds3dd` (listening on a unix socket) driven by
`ds3dctl`, running the real trainer (DeepSpeed on CPU/gloo, TP 2 x PP 2) through the elastic
agent. Pause/resume must continue exactly where the pause left off: the per-step losses equal an
uninterrupted run's. Stop saves a committed checkpoint first; stop --now does not.

Heavy: run serialised, `flock /tmp/ds3d-heavy.lock .venv/bin/pytest tests/integration/test_e2e*`."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from fixtures.s3 import free_port
from support import losses, records
from test_daemon_support import (
    DaemonProc,
    frozen_workers,
    kill_job_processes,
    wait_reported_step,
    worker_procs,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAYOUT = ["--tp", "2", "--pp", "2", "--dp", "1"]


@pytest.fixture
def daemon(tmp_path):
    sock_dir = Path(tempfile.mkdtemp(prefix="ds3d-", dir="/tmp"))  # unix paths: < 108 bytes
    d = DaemonProc(tmp_path / "state", listen=f"unix:{sock_dir}/ds3dd.sock",
                   args=["--hang-timeout", "300", "--metrics-port", str(free_port())])
    d.start()
    yield d
    d.stop()
    kill_job_processes(d.state_dir)
    shutil.rmtree(sock_dir, ignore_errors=True)


def manifest(run_dir: Path, name: str, step: int) -> Path:
    """Where the job's default store (file://RUN_DIR/store) commits the checkpoint of `step`."""
    return run_dir / "store" / name / "ckpt" / f"step-{step:08d}" / "MANIFEST.json"


def wait_no_workers(run_dir: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker_procs(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_procs(run_dir) == [], f"workers of {run_dir} still running"


def canonical(record: dict) -> str:
    return json.dumps(record, sort_keys=True)


def logs(d: DaemonProc, name: str) -> str:
    return d.ctl("logs", name, "--lines", "30").stdout[-6000:]


def test_pause_resume_matches_uninterrupted_run(daemon):
    r = daemon.ctl("start", "tiny", "--name", "pr", *LAYOUT, "--steps", "20")
    assert r.returncode == 0, r.stderr
    run_dir = daemon.state_dir / "jobs" / "pr"
    # the 20 steps take ~3 s: a pause sent after the daemon's status said "step 2" came after
    # the last step on a loaded machine (CI, 2026-12-05). So the workers are frozen the moment
    # rank 0's report says step 2, and thawed once the pause is in.
    wait_reported_step(run_dir, 2)
    with frozen_workers(run_dir, 4):
        r = daemon.ctl("pause", "pr")
    assert r.returncode == 0, r.stderr
    job = daemon.wait_state("pr", "PAUSED", "FAILED", "COMPLETED", timeout_s=180)
    assert job["state"] == "PAUSED", logs(daemon, "pr")
    paused = job["step"]
    assert 2 <= paused < 20 and job["last_checkpoint_step"] == paused
    assert manifest(run_dir, "pr", paused).is_file()  # committed before the workers exited
    wait_no_workers(run_dir)

    r = daemon.ctl("resume", "pr")
    assert r.returncode == 0, r.stderr
    job = daemon.wait_state("pr", "COMPLETED", "FAILED", timeout_s=300)
    assert job["state"] == "COMPLETED", logs(daemon, "pr")
    assert job["step"] == 20
    starts = records(run_dir, 0, "start")
    assert len(starts) == 2 and starts[-1]["step"] == paused
    assert manifest(run_dir, "pr", 20).is_file()

    r = daemon.ctl("start", "tiny", "--name", "ref", *LAYOUT, "--steps", "20")
    assert r.returncode == 0, r.stderr
    ref = daemon.wait_state("ref", "COMPLETED", "FAILED", timeout_s=300)
    assert ref["state"] == "COMPLETED", logs(daemon, "ref")
    assert len(records(Path(ref["run_dir"]), 0, "start")) == 1

    got, want = losses(run_dir), losses(Path(ref["run_dir"]))
    assert sorted(got) == sorted(want) == list(range(1, 21))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), f"step {step}"


def test_stop_saves_then_stops_and_stop_now_does_not(daemon):
    for name in ("graceful", "abrupt"):
        r = daemon.ctl("start", "tiny", "--name", name, *LAYOUT, "--steps", "100000")
        assert r.returncode == 0, r.stderr
    jobs = {name: daemon.wait_for(name, lambda j: j["state"] == "RUNNING" and j["step"] >= 2 or
                                  j["state"] == "FAILED", "step 2", timeout_s=300)
            for name in ("graceful", "abrupt")}
    for name, job in jobs.items():
        assert job["state"] == "RUNNING", logs(daemon, name)

    assert daemon.ctl("stop", "abrupt", "--now").returncode == 0
    assert daemon.ctl("stop", "graceful").returncode == 0
    for name in ("graceful", "abrupt"):
        job = daemon.wait_state(name, "STOPPED", "FAILED", timeout_s=180)
        assert job["state"] == "STOPPED", logs(daemon, name)
        wait_no_workers(Path(job["run_dir"]))
        jobs[name] = job

    g = jobs["graceful"]
    assert g["last_checkpoint_step"] == g["step"] >= 2
    assert manifest(Path(g["run_dir"]), "graceful", g["step"]).is_file()
    done = records(Path(g["run_dir"]), 0, "done")
    assert done and done[-1]["reason"] == "stopped"

    a = jobs["abrupt"]
    assert a["last_checkpoint_step"] == -1
    assert not list((Path(a["run_dir"]) / "store").rglob("MANIFEST.json"))
    # the daemon refuses to act on a finished job, in one line
    r = daemon.ctl("pause", "abrupt")
    assert r.returncode == 2 and "STOPPED" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    cks = json.loads(daemon.ctl("checkpoints", "graceful", "--json").stdout)
    assert any(c["step"] == g["step"] and c["phase"] == "committed" for c in cks)


def test_daemon_sigkill_mid_training_job_still_completes_with_full_history(daemon):
    """SIGKILL ds3dd while the real workers train; a new ds3dd knows the job, reattaches to the
    agent it left, and the job ends COMPLETED with every event, the old ones unchanged."""
    name = "survive"
    run_dir = daemon.state_dir / "jobs" / name
    assert daemon.ctl("start", "tiny", "--name", name, *LAYOUT, "--steps", "30").returncode == 0
    # frozen the moment rank 0 reports step 3, while the daemon's status catches up and the
    # daemon is killed: the 30-step job cannot end before its daemon does (a status-timed
    # freeze came after the last step on a loaded machine)
    wait_reported_step(run_dir, 3)
    with frozen_workers(run_dir, 4):
        daemon.wait_for(name, lambda j: j["state"] == "RUNNING" and j["step"] >= 3, "step 3",
                        timeout_s=300)
        before = daemon.events(name)
        daemon.kill()  # no cleanup of any kind
    assert worker_procs(run_dir), "the workers must outlive the daemon"
    time.sleep(3)  # the workers go on training while no daemon watches
    daemon.start()
    assert daemon.job(name)["state"] in ("RUNNING", "COMPLETED")
    job = daemon.wait_state(name, "COMPLETED", timeout_s=600)
    assert job["step"] == 30
    after = daemon.events(name)
    assert after[:len(before)] == before  # the old events unchanged
    # every record the workers wrote (heartbeats are not events) is one event, exactly once,
    # though the daemon was killed between reading the files and a new one read them on
    as_events = Counter(canonical(e["detail"]) for e in daemon.event_details(name))
    written = [canonical(r) for f in sorted((run_dir / "reports").glob("rank-*.jsonl"))
               for r in map(json.loads, f.read_text().splitlines()) if r["kind"] != "heartbeat"]
    assert len(written) >= 30 + 4  # rank 0's 30 steps, every rank's start at least
    wrong = {r: as_events[r] for r in written if as_events[r] != 1}
    assert not wrong, f"{len(wrong)} record(s) not stored exactly once: {list(wrong.items())[:3]}"
    assert len([e for e in after if e["kind"] == "launch"]) == 1, "reattached, not relaunched"
    stepped = {e["step"] for e in after if e["kind"] == "step"}
    assert set(range(1, 31)) <= stepped, "steps trained while the daemon was down were read back"
    assert sorted(losses(run_dir)) == list(range(1, 31))

    # the Prometheus endpoint, read by prometheus_client's own parser
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = daemon.argv[daemon.argv.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)

    def value(name, **labels):
        return next(s.value for s in samples[name]
                    if all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("ds3d_job_step", job=name) == 30
    assert value("ds3d_job_state", job=name, state="COMPLETED") == 1
    assert value("ds3d_checkpoint_upload_bytes_total", job=name) > 0
    assert sum(s.value for s in samples["ds3d_rpc_requests_total"]) > 0

    # where the TensorBoard files are; the weights of the final checkpoint, exported
    r = daemon.ctl("logs", name, "--tensorboard")
    assert r.returncode == 0 and str(run_dir / "tensorboard") in r.stdout
    assert any((run_dir / "tensorboard").iterdir())
    out = run_dir.parent / "export"
    r = daemon.ctl("export", name, "--out", str(out), timeout_s=300)
    assert r.returncode == 0, r.stderr
    assert "exported step 30" in r.stdout
    assert (out / "model.safetensors").stat().st_size > 0
    assert json.loads((out / "config.json").read_text())["source_layout"]["tp"] == 2
    r = daemon.ctl("export", name, "--step", "7", "--out", str(out))  # holds the first export
    assert r.returncode == 2 and "is not empty" in r.stderr, r.stderr
    r = daemon.ctl("export", name, "--step", "7", "--out", str(out.parent / "export-7"))
    assert r.returncode == 2 and "no complete, verified checkpoint of step 7" in r.stderr


def test_sigterm_drains_then_next_daemon_resumes(tmp_path):
    """Graceful shutdown: SIGTERM pauses the running job (checkpoint, workers stopped) before
    ds3dd exits; the next ds3dd on the same state directory resumes it to COMPLETED."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ds3d-", dir="/tmp"))
    d = DaemonProc(tmp_path / "state", listen=f"unix:{sock_dir}/ds3dd.sock",
                   args=["--hang-timeout", "300", "--drain-timeout", "120"])
    name, run_dir = "drained", tmp_path / "state" / "jobs" / "drained"
    try:
        d.start()
        assert d.ctl("start", "tiny", "--name", name, *LAYOUT, "--steps", "40").returncode == 0
        wait_reported_step(run_dir, 3)
        with frozen_workers(run_dir, 4):  # the 40-step job cannot end before the drain
            d.proc.terminate()  # SIGTERM
        d.proc.wait(150)
        assert worker_procs(run_dir) == [], "workers stopped by the drain"
        paused_at = max(r["step"] for r in records(run_dir, 0, "done"))
        assert manifest(run_dir, name, paused_at).is_file()
        d.start()
        job = d.wait_state(name, "COMPLETED", timeout_s=600)
        assert job["step"] == 40
        kinds = [e["kind"] for e in d.events(name)]
        assert "drain" in kinds
        starts = [r["step"] for r in records(run_dir, 0, "start")]
        assert starts == [0, paused_at]
        assert sorted(losses(run_dir)) == list(range(1, 41))
    finally:
        d.stop()
        kill_job_processes(d.state_dir)
        shutil.rmtree(sock_dir, ignore_errors=True)
