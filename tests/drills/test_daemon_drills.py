"""Fault drills at the daemon level: the real `ds3dd` (with --enable-fault-injection and a short
hang timeout) driven by the real `ds3dctl`, the real trainer (DeepSpeed on CPU/gloo, TP 2 x PP 2)
under the elastic agent. A drilled job must end COMPLETED with the per-step losses of an
uninterrupted run of the same daemon (steps re-trained from a checkpoint included), or FAILED with
the cause in its message when restarting cannot help.

Heavy: run serialised,
`flock /tmp/ds3d-heavy.lock .venv/bin/pytest tests/drills/test_daemon_drills.py`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from fixtures.s3 import free_port  # noqa: E402
from support import losses, records  # noqa: E402
from test_daemon_support import DaemonProc, kill_job_processes, pb  # noqa: E402

pytestmark = [pytest.mark.slow]

LAYOUT = ["--tp", "2", "--pp", "2", "--dp", "1"]
STEPS = 12
SETS = ["--set", "checkpoint.interval=2", "--set", "train.warmup_steps=2"]
AT_STEP = 7
# the restart-budget drills need no parallel layout: one worker starts (and fails) faster
ONE_WORKER = ["--tp", "1", "--pp", "1", "--dp", "1"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    sock_dir = Path(tempfile.mkdtemp(prefix="ds3d-", dir="/tmp"))  # unix paths: < 108 bytes
    d = DaemonProc(tmp_path_factory.mktemp("drills") / "state",
                   listen=f"unix:{sock_dir}/ds3dd.sock",
                   args=["--hang-timeout", "10", "--enable-fault-injection",
                         "--metrics-port", str(free_port())])
    d.start()
    yield d
    d.stop()
    kill_job_processes(d.state_dir)
    shutil.rmtree(sock_dir, ignore_errors=True)


def logs(d: DaemonProc, name: str) -> str:
    return d.ctl("logs", name, "--lines", "30").stdout[-6000:]


def start(d: DaemonProc, name: str, *extra: str) -> None:
    r = d.ctl("start", "tiny", "--name", name, *LAYOUT, "--steps", str(STEPS), *SETS, *extra)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def reference(daemon) -> dict[int, float]:
    """Per-step losses of the uninterrupted run (same daemon, same settings)."""
    start(daemon, "ref")
    job = daemon.wait_state("ref", "COMPLETED", "FAILED", timeout_s=500)
    assert job["state"] == "COMPLETED", logs(daemon, "ref")
    want = losses(Path(job["run_dir"]))
    assert sorted(want) == list(range(1, STEPS + 1))
    return want


def inject_before_training(d: DaemonProc, name: str, kind: str, rank: int,
                           at_step: int = AT_STEP) -> None:
    """Schedules `kind` on `rank` at `at_step` as soon as the daemon accepts an injection (the job
    is STARTING: its workers have not trained yet), through the gRPC stub to lose no time. On a
    loaded machine a job found RUNNING may already be past any fixed step; the drills still read
    the step the rank actually injected at (`injected_step`) and assert relative to it."""
    channel, stub = d.stub()
    deadline = time.monotonic() + 300
    req = pb.InjectFaultRequest(name=name, kind=kind, rank=rank, at_step=at_step)
    try:
        while True:
            try:
                stub.InjectFault(req, timeout=30)
                return
            except grpc.RpcError as e:  # PENDING: not launched yet, so not injectable yet
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION or \
                        time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        channel.close()


def injected_step(run_dir: Path) -> int:
    """The step at which the target rank acted on the drill's injection (it writes it to
    control/inject-done-<id> before acting): AT_STEP, or later if the job was past it."""
    step = int((run_dir / "control" / "inject-done-1").read_text())
    assert AT_STEP <= step <= STEPS - 3, f"injected at step {step}: too late for the drill"
    return step


def drill(d: DaemonProc, name: str, kind: str, rank: int,
          *extra: str) -> tuple[Path, dict, list[dict], int]:
    """Starts job `name` with `kind` scheduled on `rank` and waits for it to complete (the
    recovery worked); returns its run directory, final status, events and the injected step."""
    start(d, name, *extra)
    inject_before_training(d, name, kind, rank=rank)
    job = d.wait_state(name, "COMPLETED", "FAILED", timeout_s=600)
    assert job["state"] == "COMPLETED", logs(d, name)
    run_dir = Path(job["run_dir"])
    return run_dir, job, d.event_details(name), injected_step(run_dir)


def assert_recovered(evs: list[dict], run_dir: Path, cause: str, noticed_by: str,
                     resumed_from: int, last_step: int) -> dict:
    """The one `recovered` event of the drill: its cause, who noticed the fault, the steps lost,
    and its times against rank 0's own records (daemon/incidents.py): for a restart, detect +
    recover spans the last step record before the fault to the first one of the new group."""
    rec = [e for e in evs if e["kind"] == "recovered"]
    assert len(rec) == 1, [e["message"] for e in evs]
    d = rec[0]["detail"]
    assert (rec[0]["cause"], d["noticed_by"]) == (cause, noticed_by), rec[0]["message"]
    assert (d["last_step"], d["resumed_from"]) == (last_step, resumed_from), d
    assert d["steps_lost"] == last_step - resumed_from
    assert rec[0]["message"].startswith(f"recovered from {cause}: noticed "), rec[0]["message"]
    if noticed_by == "workers":  # an in-process rollback times itself
        back = [r for r in records(run_dir, 0, "recovery") if r["cause"] == cause]
        assert d["time_to_detect_s"] == 0
        assert d["time_to_recover_s"] == pytest.approx(back[0]["seconds"], abs=1e-3), d
        return d
    new_group = records(run_dir, 0, "start")[-1]
    steps = records(run_dir, 0, "step")
    stopped = next(r["time"] for r in steps if r["step"] == last_step)  # first timeline
    again = next(r["time"] for r in steps if r["time"] > new_group["time"])
    assert d["time_to_detect_s"] + d["time_to_recover_s"] == \
        pytest.approx(again - stopped, abs=0.01), d
    # the fault was noticed before the new group's first process started (the daemon's
    # detectors), or is dated by that process (torch elastic's own restart)
    spawned = new_group["process_started"] - stopped
    if noticed_by == "agent":
        assert d["time_to_detect_s"] == pytest.approx(spawned, abs=0.01), d
    else:
        assert d["time_to_detect_s"] <= spawned, (d, spawned)
    return d


def metric_samples(d: DaemonProc, name: str) -> dict[tuple[str, str], float]:
    """(job, cause) -> value of one metric family's samples, parsed by prometheus_client."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = d.argv[d.argv.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.labels["job"], s.labels.get("cause", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def assert_same_losses(run_dir: Path, want: dict[int, float]) -> None:
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), f"step {step}"


@pytest.mark.timeout(900)
def test_hang_is_detected_with_stacks_killed_and_restarted(daemon, reference):
    name = "hang"
    run_dir, job, evs, at = drill(daemon, name, "hang", 1)

    hangs = [e for e in evs if e["kind"] == "fault" and e["cause"] == "hang"]
    assert len(hangs) == 1, [e["message"] for e in evs if e["kind"] == "fault"]
    hang = hangs[0]
    assert hang["rank"] == 1 and hang["step"] == at, hang["message"]
    stacks = hang["detail"]["stacks"]
    assert sorted(stacks) == ["0", "1", "2", "3"], hang["message"]
    assert hang["detail"]["suspects"] == [1]
    assert "before_step" in stacks["1"] and "faults.py" in stacks["1"], stacks["1"]
    # the other ranks wait for it in a collective or a pipeline receive
    assert "before_step" not in stacks["0"]
    starts = records(run_dir, 0, "start")
    assert len(starts) == 2 and 0 < starts[-1]["step"] < at, starts
    d = assert_recovered(evs, run_dir, "hang", "daemon", starts[-1]["step"], last_step=at - 1)
    assert d["time_to_detect_s"] >= 10  # --hang-timeout 10
    assert_same_losses(run_dir, reference)


@pytest.mark.timeout(900)
def test_crashed_worker_group_is_restarted_and_matches(daemon, reference):
    name = "crash"
    run_dir, job, evs, at = drill(daemon, name, "crash", 2)
    assert job["restarts"] == 1
    rec = [e for e in evs if e["kind"] == "recovery"]
    assert [e["cause"] for e in rec] == ["worker_exit"], [e["message"] for e in evs]
    injected = [e for e in evs if e["kind"] == "fault" and e["cause"] == "injected_crash"]
    assert [(e["rank"], e["step"]) for e in injected] == [(2, at)]
    # the agent's restart is a fault naming the rank that exited first, before its recovery
    lost = [e for e in evs if e["kind"] == "fault" and e["cause"] == "worker_exit"]
    assert [e["rank"] for e in lost] == [2], [e["message"] for e in evs]
    assert "rank 2 failed first: exited with code 13" in lost[0]["message"], lost[0]["message"]
    assert evs.index(lost[0]) < evs.index(rec[0])
    starts = records(run_dir, 0, "start")
    assert [s["restart"] for s in starts] == [0, 1] and 0 < starts[-1]["step"] < at
    d = assert_recovered(evs, run_dir, "worker_exit", "agent", starts[-1]["step"],
                         last_step=at - 1)
    crashed = next(r["time"] for r in records(run_dir, 2, "fault")  # written just before exit
                   if r["cause"] == "injected_crash")
    assert starts[-1]["process_started"] > crashed  # the new group came after the crash
    assert metric_samples(daemon, "ds3d_recovery_seconds_count")[(name, "worker_exit")] == 1
    assert metric_samples(daemon, "ds3d_recovery_steps_lost_total")[(name, "worker_exit")] == \
        d["steps_lost"]
    assert_same_losses(run_dir, reference)


@pytest.mark.timeout(900)
def test_an_unloadable_checkpoint_is_rolled_back_past(daemon, reference):
    """Rank 0 saves a checkpoint DeepSpeed cannot load (its first layer's state has a key the
    layer lacks; every size and sha256 verifies it: a writer's bug), then crashes once that
    checkpoint is committed. The restarted groups restore it and fail in DeepSpeed's strict load,
    twice; the daemon then rolls back to the checkpoint before it, instead of restarting the
    same load until the budget is spent and the job FAILS. The rollback deletes the bad step;
    the job completes with the reference losses."""
    name = "unloadable"
    run_dir, job, evs, at = drill(daemon, name, "unloadable", 0)
    bad = at + at % 2  # the first save from the injected step on (checkpoint.interval=2)
    failed = [e for e in evs if e["kind"] == "checkpoint" and e["cause"] == "load_failed"]
    assert {e["step"] for e in failed} == {bad}, [e["message"] for e in evs]
    # two groups (a third may have started before the daemon's tick saw the second fail)
    assert len({e["detail"]["restart"] for e in failed}) >= 2, failed
    assert any("Unexpected key(s)" in e["message"] and "ds3d_drill_unknown_key" in e["message"]
               for e in failed), failed
    fault = [e for e in evs if e["kind"] == "fault" and e["cause"] == "checkpoint_unloadable"]
    assert len(fault) == 1, [e["message"] for e in evs]
    assert fault[0]["step"] == bad and fault[0]["detail"]["rollback_to"] == bad - 2, fault
    assert f"rolling back to the checkpoint of step {bad - 2}" in fault[0]["message"], fault
    rolled = [r for r in records(run_dir, 0, "checkpoint") if r["phase"] == "rolled_back"]
    assert [(r["step"], r["deleted"]) for r in rolled] == [(bad - 2, [bad])], rolled
    assert job["state"] == "COMPLETED" and job["restarts"] <= 3
    assert_same_losses(run_dir, reference)


@pytest.mark.timeout(900)
def test_an_unloadable_first_checkpoint_pauses_the_job_with_it_kept(daemon):
    """The job's first checkpoint (step 2) cannot be loaded: there is nothing to roll back to.
    After its second failed load the job is PAUSED (not FAILED once the restart budget is
    spent, where nothing more can be done with it), the checkpoint kept and the message saying
    what failed and the ways out."""
    name = "unloadable-first"
    start(daemon, name, *ONE_WORKER)
    inject_before_training(daemon, name, "unloadable", rank=0, at_step=1)
    job = daemon.wait_state(name, "PAUSED", "FAILED", "COMPLETED", timeout_s=600)
    assert job["state"] == "PAUSED", logs(daemon, name)
    run_dir = Path(job["run_dir"])
    assert (run_dir / "control" / "inject-done-1").read_text() == "1"  # before any save
    msg = job["message"]
    assert msg.startswith("checkpoint step 2 could not be loaded by 2 worker groups (its files "
                          "verified): rank 0: RuntimeError: Error(s) in loading state_dict"), msg
    assert "; PAUSED with every checkpoint kept: no committed checkpoint before it to roll back " \
           "to. Fix the cause and `ds3dctl resume JOB`" in msg, msg
    assert daemon.job(name)["desired_state"] == "PAUSED"  # not resumed by the supervisor
    r = daemon.ctl("checkpoints", name, "--json", timeout_s=120)
    assert r.returncode == 0, r.stderr
    # kept: committed in the store, though the index may say `saved`: the drill's rank crashed
    # as soon as the commit was done, maybe before its `committed` record was written
    rows = json.loads(r.stdout)
    assert [(c["step"], c["present"]) for c in rows if c["phase"] in ("saved", "committed")] \
        == [(2, True)], r.stdout
    assert not [e for e in daemon.event_details(name) if e["kind"] == "launch"][1:]
    assert daemon.ctl("stop", name).returncode == 0
    daemon.wait_state(name, "STOPPED", timeout_s=120)


@pytest.mark.timeout(900)
def test_independent_crashes_with_progress_between_them_do_not_spend_the_budget(daemon):
    """`launch.max_restarts=1`, and two crashes with new checkpoints committed between them:
    the budget counts restarts in a row without progress (daemon/policies.py), so the second
    crash is restarted too (its agent had no restart left: the daemon relaunches) and the job
    completes. A lifetime budget FAILED it: a weeks-long job died at its fourth hardware fault."""
    name = "two-crashes"
    start(daemon, name, *ONE_WORKER, "--steps", "60", "--set", "launch.max_restarts=1")
    inject_before_training(daemon, name, "crash", rank=0, at_step=4)
    first = daemon.wait_for(name, lambda j: j["restarts"] == 1, "the first restart",
                            timeout_s=300)
    daemon.wait_for(name, lambda j: j["last_checkpoint_step"] > first["last_checkpoint_step"]
                    and j["state"] == "RUNNING", "a new checkpoint after it", timeout_s=300)
    channel, stub = daemon.stub()
    with channel:
        stub.InjectFault(pb.InjectFaultRequest(name=name, kind="crash", rank=0, at_step=0),
                         timeout=30)
    job = daemon.wait_state(name, "COMPLETED", "FAILED", timeout_s=600)
    assert job["state"] == "COMPLETED", job["message"]
    assert job["restarts"] == 2 and job["step"] == 60, job
    crashes = [e for e in daemon.event_details(name)
               if e["kind"] == "fault" and e["cause"] == "injected_crash"]
    assert len(crashes) == 2, crashes
    launches = [e for e in daemon.event_details(name) if e["kind"] == "launch"]
    assert len(launches) == 2  # the second crash: the agent's budget was spent, the daemon's not


@pytest.mark.timeout(900)
@pytest.mark.parametrize("rank", [3])  # either rank of the TP group: unit test_step_analysis
def test_straggler_is_named_and_exported_per_rank(daemon, reference, rank):
    """Rank 3's forward becomes slow (a throttled device): every rank's wall step time
    grows alike (they wait for it), and so does the compute time of its TP peer, which waits for
    it inside the TP all-reduces; less that wait (`tp_wait`), the slow rank's own compute stands
    out: a `straggler` diagnosis names it alone (a probe of 12-06 saw the peer named, by 1 ms of
    compute time, for either rank), and `ds3d_rank_step_seconds` shows it per rank. Nothing
    restarts; losses unchanged."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    name, peer = f"slow{rank}", 5 - rank
    run_dir, job, evs, at = drill(daemon, name, "slow", rank, "--set", "train.timing_interval=2")
    assert job["restarts"] == 0
    slow = [e for e in evs if e["kind"] == "diagnosis" and e["cause"] == "straggler"]
    assert len(slow) == 1, [e["message"] for e in evs if e["kind"] == "diagnosis"]
    # its tensor-parallel peer waits for it inside the all-reduces: told apart by that wait
    assert slow[0]["detail"]["slow_ranks"] == [rank], slow[0]["message"]
    assert slow[0]["rank"] == rank and slow[0]["step"] > at, slow[0]
    assert "(stage 1" in slow[0]["message"] and "longer per step" in slow[0]["message"]
    assert f"peer rank {peer} waits for it inside the all-reduces" in slow[0]["message"], \
        slow[0]
    port = daemon.argv[daemon.argv.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    per_rank = {s.labels["rank"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "ds3d_rank_step_seconds" and
                s.labels["job"] == name}
    assert sorted(per_rank) == ["0", "1", "2", "3"]
    assert per_rank[str(rank)] > 1.5 * max(per_rank["0"], per_rank["1"], per_rank[str(peer)]), \
        per_rank
    # every sampled step's split is in rank 0's heartbeats, with the pipeline bubble beside
    # the schedule's theoretical one
    splits = [r["split"] for r in records(run_dir, 0, "heartbeat") if "split" in r]
    assert splits and all(s["forward"] > 0 and s["backward"] > 0 for s in splits)
    micro = 8 // 2  # tiny: global batch 8, micro-batch 2, DP 1; 1F1B bubble (p-1)/(m+p-1)
    assert all(0 <= s["bubble"] <= 1 for s in splits)
    assert {round(s["bubble_theoretical"], 4) for s in splits} == {round(1 / (micro + 1), 4)}
    assert_same_losses(run_dir, reference)


@pytest.mark.timeout(900)
def test_nan_is_undone_in_place_through_the_daemon(daemon, reference):
    """An injected NaN on rank 1: DeepSpeed's ZeRO-1 optimizer (the job's default) skips the
    update of a step whose gradient norm is not finite, so every rank agrees to undo the step
    in place and skip its batch (trainer/loop.py `_undo_skipped_update`): one step lost,
    nothing read. The job completes, the fault and the recovery are events, steps before it
    keep the reference losses and none after it is NaN."""
    name = "nan"
    run_dir, job, evs, at = drill(daemon, name, "nan", 1)
    nan = [e for e in evs if e["kind"] == "fault" and e["cause"] == "nan"]
    assert sorted(e["rank"] for e in nan) == [0, 1, 2, 3]  # every rank agreed on it
    assert {e["step"] for e in nan} == {at}, [e["message"] for e in nan]
    rec = records(run_dir, 0, "recovery")
    assert len(rec) == 1 and rec[0]["cause"] == "nan" and rec[0]["recovered_to"] == at - 1
    back = at - 1
    assert rec[0]["skipped_batches"] == [at - 1, at]  # batch at-1 fed step at
    assert rec[0]["source"] == "skipped_update" and rec[0]["steps_lost"] == 1
    recovery = [e for e in evs if e["kind"] == "recovery" and e["rank"] == 0]
    assert recovery and "every rank skipped its update; undone in place, back to step " \
        f"{back}" in recovery[0]["message"], recovery
    assert_recovered(evs, run_dir, "nan", "workers", back, last_step=at)
    recovered = [e for e in evs if e["kind"] == "recovered"]
    assert f"from step {back} (in place: the update was skipped)" in recovered[0]["message"], \
        recovered
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(v == v for v in got.values())
    for step in range(1, back + 1):
        assert got[step] == pytest.approx(reference[step], rel=1e-6), f"step {step}"
    assert got[at] != pytest.approx(reference[at], rel=1e-6)  # other data now


# a short window (training is only 12 steps), and 20 MADs: the injected loss is ~3x the median,
# while the noise of a falling loss must never look like a spike
SPIKE_SETS = ["--set", "faults.spike_policy=rollback", "--set", "faults.spike_window=5",
              "--set", "faults.spike_mads=20"]
PATIENCE = 3  # faults.spike_patience (default): steps above the threshold before acting


@pytest.mark.timeout(900)
def test_loss_spike_rolls_back_past_it_and_skips_its_window(daemon):
    """Rank 3 (last stage: its head's logits x50 from the injected step for 3 steps) makes the
    computed loss jump. The detector (median of 5 steps + 20 MADs, 3 steps in a row) fires on
    the third spiked step on every rank; the checkpoint saved in the middle of the spike is
    deleted, the job rolls back to the one before it and skips the spike's 3 batches. It
    completes, and every step's loss equals a run that skipped the same window from the start."""
    name = "spike"
    run_dir, job, evs, at = drill(daemon, name, "spike", 3, *SPIKE_SETS)
    last = at + PATIENCE - 1
    spikes = [e for e in evs if e["kind"] == "fault" and e["cause"] == "spike"]
    assert sorted(e["rank"] for e in spikes) == [0, 1, 2, 3]  # every rank agreed on it
    assert {e["step"] for e in spikes} == {last}, [e["message"] for e in spikes]
    seen = spikes[0]["detail"]
    assert seen["first_step"] == at and seen["loss"] > seen["threshold"] > seen["median"]
    assert f"above the running median {seen['median']:.4g}" in spikes[0]["message"]
    # the loss the workers computed really jumped on each spiked step (first timeline)
    first = {}
    for r in records(run_dir, 0, "step"):
        first.setdefault(r["step"], r["loss"])
    assert all(first[s] > seen["threshold"] for s in range(at, last + 1)), first

    rec = records(run_dir, 0, "recovery")
    assert len(rec) == 1 and rec[0]["cause"] == "spike", rec
    assert rec[0]["recovered_to"] < at  # before the spike, not the checkpoint inside it
    assert rec[0]["source"] == "local"  # the newest save, in memory, was trained on the spike
    assert rec[0]["dropped_checkpoints"] == [s for s in range(at, last) if s % 2 == 0]
    window = rec[0]["skipped_batches"]
    assert window == [at - 1, last]  # batches at-1 .. last-1 fed steps at..last

    start(daemon, "spike-ref", *SPIKE_SETS, "--set", f"data.skip_batches=[{window}]")
    ref = daemon.wait_state("spike-ref", "COMPLETED", "FAILED", timeout_s=600)
    assert ref["state"] == "COMPLETED", logs(daemon, "spike-ref")
    assert not records(Path(ref["run_dir"]), 0, "fault")  # no spike without the injection
    want = losses(Path(ref["run_dir"]))
    assert_same_losses(run_dir, want)


@pytest.mark.timeout(600)
def test_config_refused_by_the_workers_fails_at_once(daemon, tmp_path):
    """A data file that exists (the daemon's start checks pass) but holds fewer tokens than one
    sample: the worker refuses it with exit code 2, which no restart can fix."""
    data = tmp_path / "short.bin"
    data.write_bytes(bytes(10))  # 5 uint16 tokens
    start(daemon, "refused", *ONE_WORKER, "--set", f"data.source={data}",
          "--set", "launch.max_restarts=1")
    job = daemon.wait_state("refused", "FAILED", "COMPLETED", "RUNNING", timeout_s=400)
    assert job["state"] == "FAILED", logs(daemon, "refused")
    assert "fewer than one sample" in job["message"] and "refused" in job["message"], job
    assert job["restarts"] == 0  # the daemon did not relaunch (the agent's own retry is spent)
    evs = daemon.event_details("refused")
    assert [e["cause"] for e in evs if e["kind"] == "fault"] == ["config_refused"]
    assert len([e for e in evs if e["kind"] == "launch"]) == 1


@pytest.mark.timeout(900)
def test_crash_loop_ends_failed_after_the_restart_budget(daemon, tmp_path):
    """A data file with an odd number of bytes for uint16 tokens: numpy raises at every start of
    the worker (a real crash, exit code 1); after launch.max_restarts relaunches the job is
    FAILED with the cause and the workers' error in its message. The second relaunch is made
    from RECOVERING (its predecessor failed before training): that transition was refused, and
    the job stayed RECOVERING for good (CI of 12-06, a failed take-back relaunch)."""
    data = tmp_path / "odd.bin"
    data.write_bytes(bytes(4097))
    start(daemon, "loop", *ONE_WORKER, "--set", f"data.source={data}",
          "--set", "launch.max_restarts=2")
    job = daemon.wait_state("loop", "FAILED", "COMPLETED", timeout_s=800)
    assert job["state"] == "FAILED", logs(daemon, "loop")
    msg = job["message"]
    assert "restart budget spent" in msg and "agent_exit" in msg, msg
    assert "ValueError" in msg, msg
    evs = daemon.event_details("loop")
    assert len([e for e in evs if e["kind"] == "launch"]) == 3, [e["message"] for e in evs]
    # the agent's own restarts of the group, if any, are worker_exit faults naming the rank
    assert [e["cause"] for e in evs if e["kind"] == "fault" and e["cause"] != "worker_exit"] \
        == ["agent_exit"] * 3
    assert all("rank 0 failed first: exited with code 1: ValueError" in e["message"]
               for e in evs if e["kind"] == "fault" and e["cause"] == "worker_exit")
    restarts = [e["message"] for e in evs if e["kind"] == "state" and "restart " in e["message"]]
    assert restarts[:2] == ["agent_exit: restart 1 of 2 in 1 s",
                            "agent_exit: restart 2 of 2 in 2 s"], restarts


STUCK = r'''
import faulthandler, signal, sys, time
import setproctitle
setproctitle.setproctitle(sys.argv[1])  # what ds3d's agent sets in each forked worker
faulthandler.register(signal.SIGUSR1, all_threads=True)
def stuck_here():
    while True:
        time.sleep(3600)
print("ready", flush=True)
stuck_here()
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["py-spy", "faulthandler"])
def test_stack_capture_of_a_stuck_worker(tmp_path, monkeypatch, method):
    """dump_stacks finds a job's worker by its process title (run dir and ranks), and reads its
    stack with py-spy or, without py-spy, through SIGUSR1 + faulthandler into the agent's stderr
    log."""
    import subprocess
    import time

    from ds3d.daemon import stacks
    from ds3d.daemon.procs import WorkerTitle

    if method == "py-spy" and stacks._py_spy() is None:
        pytest.skip("py-spy is not installed")
    if method == "faulthandler":
        monkeypatch.setattr(stacks, "_py_spy", lambda: None)
    run_dir = tmp_path / "job"
    log = run_dir / "logs" / "attempt-1" / "job-a1_x" / "attempt_0" / "0" / "stderr.log"
    log.parent.mkdir(parents=True)
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    with open(log, "ab") as err:
        title = WorkerTitle("ds3d.trainer.worker", str(run_dir), rank=5, local_rank=0)
        proc = subprocess.Popen([sys.executable, str(script), str(title)],
                                stdout=subprocess.PIPE, stderr=err)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.2)
        dump = stacks.dump_stacks(run_dir, attempt=1)
        assert dump.method == method and list(dump.stacks) == [5], dump
        assert "stuck_here" in dump.stacks[5], dump.stacks[5]
        assert dump.unanswered == {} and stacks.suspects(dump) == [5]
    finally:
        proc.kill()
        proc.wait()
