"""Cost of each fault kind on CPU, against a fault-free run of the same job in the same run.

The same job, (TP, PP, DP) = (2, 2, 1) `tiny`, 30 steps, checkpoint every 5 steps, runs under
the real elastic agent (torchrun, --max-restarts 3) once without faults and once per fault kind,
injected at step 12 on rank 1 through control/inject.json (what `ds3dctl inject` writes):

  nan    the rank's forward turns NaN; DeepSpeed's ZeRO-1 optimizer skips that step's update
         on every rank, so all ranks agree to undo the step in place (back to step 11, no
         checkpoint read) and skip its batch; one step lost
  crash  the rank exits with code 13; the agent restarts the group, which resumes from step 10
  hang   the rank stops forever; the gloo collective timeout (DS3D_COLLECTIVE_TIMEOUT_S, here
         20 s) turns the stuck collective into an error, the agent restarts the group
  slow   the rank's forward takes 0.1 s longer per micro-batch from step 12 on (a straggler;
         nothing to recover)
  spike  rank 3's head logits x50 for 3 steps: the loss really jumps; detected after the 3rd
         spiked step (median of 5 + 20 MADs, 3 in a row), rollback to before the spike, its 3
         batches skipped
  schedule  one run with nan (step 8), crash (16, rank 2) and spike (22, rank 3) in turn: the
         goodput of a job that meets a fault every few steps
  lost_node  one node of three dies: a job of its own on three daemons, against its own
         fault-free run (below)

Reported per kind: time to detect (fault injected -> fault noticed), time to recover (noticed ->
first step after the recovery), steps lost (re-trained steps), and goodput = useful steps per
wall-second from the first worker's start to the end, as a share of the fault-free run's (run
once before and once after the faulty runs; the faster of the two counts).

Lost node: three `ds3dd` daemons on loopback as three nodes (127.0.0.1-3, the first the head) run
`tiny` at (TP, PP, DP) = (1, 1, 3), launch.min_nodes 2, global batch 6 (micro-batch 1), 100
steps, checkpoint every 10 steps, through the real `ds3dctl start --hosts`: once without a fault,
then once with node c (not the head) SIGKILLed once rank 0 reported step 25: its daemon, its
agent and its worker, all at once. The other two agents see the worker group fail (gloo: the
peer's connection reset), re-rendezvous without c, DP shrinks 3 -> 2 with the same global batch,
the step-20 checkpoint is reshaped (universal) to the new layout and the job completes on two
nodes. Time to detect = kill -> the first surviving agent logs the failed group (torch's
elastic agent log line); time to recover = that -> the first step of the shrunk group. Also
reported: the phases in between (re-rendezvous and process start, reshape, engine build and
load) and when the head daemon records its `node_lost` event (only once the shrunk group's rank
0 reports its start: the daemon learns the new world size from it). The daemons are driven with
the integration tests' `DaemonProc` (tests/integration/test_daemon_support.py), the machinery
of tests/integration/test_multinode_daemons.py, whose lost-node test checks the losses.

    python bench/fault_bench.py --out bench/results/faults.json
    python bench/fault_bench.py --kinds lost_node   # only the lost-node pair of runs

Results go to --out; a section that was not run this time (the torchrun kinds, or the lost
node) is kept from the file already there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ds3d.trainer.kinds import FaultKind
from ds3d.trainer.report import read_rank_records

STEPS, AT = 30, 12
SETS = [f"train.steps={STEPS}", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
        "checkpoint.interval=5", "faults.spike_policy=rollback", "faults.spike_window=5",
        "faults.spike_mads=20"]
# kind -> rank it hits: every injectable kind, one run each
SINGLE = {FaultKind.NAN: 1, FaultKind.CRASH: 1, FaultKind.HANG: 1, FaultKind.SLOW: 1,
          FaultKind.SPIKE: 3}
assert set(SINGLE) == set(FaultKind), "a FaultKind without a bench run"
# (kind, rank, at step)
SCHEDULE = [(FaultKind.NAN, 1, 8), (FaultKind.CRASH, 2, 16), (FaultKind.SPIKE, 3, 22)]


def feed_schedule(run_dir: Path, schedule: list[tuple[str, int, int]], stop) -> None:
    """Writes control/inject.json for each fault in turn, the next once the previous fired."""
    for i, (kind, rank, at) in enumerate(schedule, start=1):
        (run_dir / "control" / "inject.json").write_text(
            json.dumps({"id": i, "kind": kind, "rank": rank, "at_step": at}))
        while not (run_dir / "control" / f"inject-done-{i}").exists():
            if stop.wait(0.2):
                return


def run_job(run_dir: Path, schedule: list[tuple[str, int, int]]) -> float:
    import threading

    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    feeder = threading.Thread(target=feed_schedule, args=(run_dir, schedule, stop), daemon=True)
    feeder.start()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "--max-restarts=3", "-m", "ds3d.trainer.worker", "--run-dir", str(run_dir),
           "--config", "tiny"] + sum((["--set", s] for s in SETS), [])
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DS3D_COLLECTIVE_TIMEOUT_S="20",
               DS3D_LOG_FORMAT="json")
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"job failed: {proc.stderr[-3000:]}")
    return t0


def records(run_dir: Path, rank: int = 0) -> list[dict]:
    return read_rank_records(run_dir, rank)


def analyse(run_dir: Path, t0: float, kind: str | None, steps_total: int = STEPS) -> dict:
    recs = records(run_dir)
    steps = [r for r in recs if r["kind"] == "step"]
    end = max(r["time"] for r in recs)
    # from the first worker's start: process spawn and imports (10-20 s on 2 cores, noisy) are
    # the same for every run and say nothing about fault handling
    begin = min(r["time"] for r in recs if r["kind"] == "start")
    out = {"wall_s": end - t0, "training_wall_s": end - begin, "useful_steps": steps_total,
           "trained_steps": len(steps), "steps_lost": len(steps) - steps_total,
           "goodput_steps_per_s": steps_total / (end - begin)}
    if kind in (None, "slow"):
        return out
    if kind == "schedule":
        out["faults"] = [{"kind": k, "rank": r, "at_step": a} for k, r, a in SCHEDULE]
        out["recoveries"] = [r["cause"] for r in recs if r["kind"] == "recovery"]
        out["restarts"] = max(r["restart"] for r in recs)
        return out
    done = run_dir / "control" / "inject-done-1"
    injected = done.stat().st_mtime
    if kind in ("nan", "spike"):
        fault = next(r for r in recs if r["kind"] == "fault" and r["cause"] == kind)
        rec = next(r for r in recs if r["kind"] == "recovery")
        first_after = next(r for r in steps if r["time"] > rec["time"])
        out.update(time_to_detect_s=fault["time"] - injected,
                   time_to_recover_s=first_after["time"] - fault["time"])
    else:  # crash / hang: detected when the agent starts the next worker group
        restarted = next(r for r in recs if r["kind"] == "heartbeat" and r["restart"] >= 1)
        first_after = next(r for r in steps if r["restart"] >= 1)
        out.update(time_to_detect_s=restarted["time"] - injected,
                   time_to_recover_s=first_after["time"] - restarted["time"])
    return out


# ---- lost node: three daemons as three nodes ---------------------------------------------------

LN_STEPS, LN_KILL_AT, LN_CKPT = 100, 25, 10
LN_SETS = ["launch.min_nodes=2", "train.micro_batch_size=1", "train.global_batch_size=6",
           f"checkpoint.interval={LN_CKPT}", "train.warmup_steps=2"]
LN_JOB = (f"tiny (1,1,3) on three ds3dd nodes, {LN_STEPS} steps, global batch 6, ckpt every "
          f"{LN_CKPT}, launch.min_nodes 2")


def _daemon_support():
    """The integration tests' real-daemon driver (DaemonProc: ds3dd + ds3dctl subprocesses)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    import test_daemon_support

    return test_daemon_support


def _sigkill_node(daemon, kill_job_processes) -> tuple[float, float]:
    """A node dies: SIGKILL to its daemon, its agents and their workers, gathered first and
    killed in one go (agents run in sessions of their own, apart from the daemon); then the
    tests' sweep of anything the node's jobs left. Returns (first kill, last kill) times."""
    import psutil

    node = psutil.Process(daemon.proc.pid)
    procs = [node, *node.children(recursive=True)]
    for pid_file in daemon.state_dir.glob("shares/*/control/agent-*.pid"):
        try:
            agent = psutil.Process(json.loads(pid_file.read_text())["pid"])
            procs += [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    first = time.time()
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    last = time.time()
    daemon.proc.wait(10)
    kill_job_processes(daemon.state_dir)
    return first, last


class _Tail:
    """New records of one rank's report file, as they are written."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.buf = path, 0, ""

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as fh:
            fh.seek(self.pos)
            self.buf += fh.read()
            self.pos = fh.tell()
        *lines, self.buf = self.buf.split("\n")
        return [json.loads(line) for line in lines if line.strip()]


def run_lost_node(work: Path, kill: bool) -> dict:
    """One three-node job to its end; with `kill`, node c dies once rank 0 reported step
    LN_KILL_AT. Returns what analyse_lost_node needs."""
    support = _daemon_support()
    token = support.new_token()
    work.mkdir(parents=True, exist_ok=True)  # the daemons' token files go here
    daemons = [support.DaemonProc(work / n, token=token, node=f"node-{n}",
                                  args=["--hang-timeout", "120", "--node-addr", f"127.0.0.{i + 1}"])
               for i, n in enumerate("abc")]
    store = work / "shared-store"
    out: dict = {}
    try:
        for d in daemons:
            d.start()
        a, b, c = daemons
        out["t0"] = time.time()
        r = a.ctl("start", "tiny", "--name", "ln", "--dp", "3", "--steps", str(LN_STEPS),
                  *sum((["--set", s] for s in LN_SETS), []),
                  "--hosts", ",".join(d.addr for d in daemons), "--store", f"file://{store}")
        if r.returncode != 0:
            raise RuntimeError(f"ds3dctl start failed: {r.stderr}")
        head = Path(a.job("ln")["run_dir"])
        out["run_dir"] = str(head)
        if kill:
            # torch elastic ranks nodes by address: rank 0 is on the head (127.0.0.1)
            tail, step = _Tail(head / "reports" / "rank-00000.jsonl"), 0
            committed = store / "ln" / "ckpt" / f"step-{LN_KILL_AT // LN_CKPT * LN_CKPT:08d}"
            deadline, check = time.monotonic() + 600, time.monotonic() + 5
            while step < LN_KILL_AT or not (committed / "MANIFEST.json").is_file():
                if time.monotonic() > check:  # ds3dctl costs a process start: now and then
                    check = time.monotonic() + 5
                    if time.monotonic() > deadline or \
                            a.job("ln")["state"] in ("FAILED", "COMPLETED"):
                        raise RuntimeError(f"step {LN_KILL_AT} not reached: "
                                           f"{a.ctl('logs', 'ln').stdout[-3000:]}")
                step = max([step] + [rec["step"] for rec in tail.read() if rec["kind"] == "step"])
                time.sleep(0.02)
            out["kill_step"] = step
            out["kill_time"], out["kill_last"] = _sigkill_node(c, support.kill_job_processes)
            out["survivor_dirs"] = [str(head), str(b.state_dir / "shares" / "ln")]
        done = a.wait_state("ln", "COMPLETED", "FAILED", timeout_s=600)
        if done["state"] != "COMPLETED" or done["step"] != LN_STEPS:
            raise RuntimeError(f"job ended {done['state']} at step {done['step']}: "
                               f"{a.ctl('logs', 'ln').stdout[-3000:]}")
        out["world_size"] = done["world_size"]
        out["events"] = a.events("ln")
    finally:
        for d in daemons:
            d.stop()
        for d in daemons:
            support.kill_job_processes(d.state_dir)
    return out


# torch elastic's agent, glog style, local time: "E1204 06:59:20.654000 9874 .../api.py:1002]
# failed (exitcode: 1) local_rank: 0 ..." -- the agent saw its worker group fail
_AGENT_FAILED = re.compile(
    r"^[EWI](\d\d)(\d\d) (\d\d):(\d\d):(\d\d(?:\.\d+)?) \d+ .*\] failed \(exitcode")


def _agent_failed_times(run_dir: Path, year: int) -> list[float]:
    path = run_dir / "logs" / "agent.log"
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if m := _AGENT_FAILED.match(line):
            mon, day, hh, mm, ss = m.groups()
            out.append(time.mktime((year, int(mon), int(day), int(hh), int(mm), 0, 0, 0, -1))
                       + float(ss))
    return out


def _group_spawned(run_dir: Path, after: float) -> float | None:
    """When an agent started a new worker group after `after`: torch elastic creates the
    group's log folder (logs/attempt-N/<run id>/attempt_<restart>/<local rank>) right after the
    rendezvous, before it spawns the workers into it."""
    times = [p.stat().st_mtime for p in run_dir.glob("logs/attempt-*/*/attempt_*/*")
             if p.is_dir() and p.stat().st_mtime > after]
    return min(times, default=None)


def _longest_step_gap(recs: list[dict], skip: tuple[float, float] | None = None) -> float:
    """The longest time between two consecutive rank-0 steps (the one spanning `skip`, the
    recovery, left out): a stall of the machine shows here, not only in goodput."""
    times = [r["time"] for r in recs if r["kind"] == "step"]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)
            if skip is None or not (a <= skip[0] and b >= skip[1])]
    return max(gaps, default=0.0)


def analyse_lost_node(run: dict, kill: bool) -> dict:
    head = Path(run["run_dir"])
    out = analyse(head, run["t0"], None, LN_STEPS)
    out["final_world_size"] = run["world_size"]
    recs = records(head)
    if not kill:
        out["longest_step_gap_s"] = _longest_step_gap(recs)
        return out
    k = run["kill_time"]
    # the shrunk group: from the first worker start after the kill (restart count one up)
    init = next(r for r in recs if r["time"] > k and r["kind"] == "heartbeat"
                and r.get("phase") == "init")
    after = [r for r in recs if r["restart"] >= init["restart"]]
    last_old = max(r["step"] for r in recs
                   if r["kind"] == "step" and r["restart"] < init["restart"])
    first_step = next(r for r in after if r["kind"] == "step")
    reshaped = next(r for r in after if r["kind"] == "checkpoint" and r["phase"] == "reshaped")
    loaded = next(r for r in after if r["kind"] == "checkpoint" and r["phase"] == "loaded")
    start = next(r for r in after if r["kind"] == "start")
    noticed = [t for d in run["survivor_dirs"]
               for t in _agent_failed_times(Path(d), time.localtime(k).tm_year) if t > k - 1]
    if not noticed:
        raise RuntimeError("no surviving agent logged the failed worker group")
    detect = min(noticed)
    spawned = [t for d in run["survivor_dirs"] if (t := _group_spawned(Path(d), k)) is not None]
    spawn = min(spawned) if spawned else None
    lost_event = next(e for e in run["events"]
                      if e["kind"] == "fault" and e["cause"] == "node_lost")
    out.update(
        killed_at_step=run["kill_step"], last_step_before_kill=last_old,
        kill_spread_s=run["kill_last"] - k,
        resumed_from_step=start["step"], dp_after=start["dp"],
        world_size_after=start["world_size"], reshape=reshaped.get("detail", ""),
        reshape_s=reshaped.get("seconds"),
        time_to_detect_s=detect - k, time_to_recover_s=first_step["time"] - detect,
        # detection, then contiguous phases that add up to time_to_recover_s; the daemon's
        # event apart
        phases_s={
            # both surviving agents: their logs' "failed" lines
            "kill_to_agents_noticed": sorted(t - k for t in noticed),
            # re-rendezvous of the two survivors (the 5 s last call for a third node within)
            "noticed_to_rendezvous_done": spawn - detect if spawn else None,
            # worker process start, imports, process group
            "rendezvous_done_to_new_group_init": init["time"] - spawn if spawn else None,
            # the newest checkpoint reshaped (universal) to DP 2; the worker's own timing of
            # the conversion is `reshape_s`
            "new_group_init_to_reshaped": reshaped["time"] - init["time"],
            "reshaped_to_loaded": loaded["time"] - reshaped["time"],  # engine build + load
            "loaded_to_first_step": first_step["time"] - loaded["time"],
            "kill_to_daemon_node_lost_event": lost_event["time"] - k,
        },
        daemon_event=lost_event["message"],
        longest_step_gap_s=_longest_step_gap(recs, (k, first_step["time"])))
    return out


def bench_lost_node(work: Path) -> dict:
    results = {"none": analyse_lost_node(run_lost_node(work / "ln-baseline", False), False)}
    print("lost_node none", json.dumps(results["none"]), flush=True)
    res = analyse_lost_node(run_lost_node(work / "ln-kill", True), True)
    res["goodput_vs_fault_free"] = (res["goodput_steps_per_s"] /
                                    results["none"]["goodput_steps_per_s"])
    results["lost_node"] = res
    print("lost_node", json.dumps(res), flush=True)
    return results


def _table(results: dict) -> None:
    print(f"\n{'fault':9} {'wall s':>7} {'detect s':>9} {'recover s':>10} {'lost':>5} "
          f"{'goodput':>8}")
    for k, r in results.items():
        print(f"{k:9} {r['wall_s']:7.1f} {r.get('time_to_detect_s', 0):9.2f} "
              f"{r.get('time_to_recover_s', 0):10.2f} {r['steps_lost']:5d} "
              f"{r.get('goodput_vs_fault_free', 1):8.1%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/faults.json")
    ap.add_argument("--kinds", default="nan,crash,hang,slow,spike,schedule,lost_node")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = set(kinds) - {*SINGLE, "schedule", "lost_node"}
    if unknown:
        ap.error(f"unknown kinds: {sorted(unknown)}")
    command = "python bench/fault_bench.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    # a section not run this time keeps its numbers (and date) from the file already there
    report: dict = json.loads(out.read_text()) if out.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="ds3d-fault-bench-"))
    agent_kinds = [k for k in kinds if k != "lost_node"]
    if agent_kinds:
        # the fault-free run before and after the faulty ones; goodput against the faster
        # (on a shared 2-core machine one run can be slowed by other work: the faster one is
        # the job's speed, and a fault's goodput is not flattered by a slow baseline)
        def baseline(i: int) -> dict:
            t0 = run_job(work / f"baseline-{i}", [])
            return analyse(work / f"baseline-{i}", t0, None)

        results: dict = {}
        baselines = [baseline(1)]
        for kind in agent_kinds:
            run = work / kind
            t0 = run_job(run, SCHEDULE if kind == "schedule" else [(kind, SINGLE[kind], AT)])
            results[kind] = analyse(run, t0, kind)
            print(kind, json.dumps(results[kind]), flush=True)
        baselines.append(baseline(2))
        best = max(baselines, key=lambda b: b["goodput_steps_per_s"])
        results = {"none": {**best, "baseline_training_wall_s": [b["training_wall_s"]
                                                                  for b in baselines]},
                   **results}
        for kind in agent_kinds:
            results[kind]["goodput_vs_fault_free"] = (results[kind]["goodput_steps_per_s"] /
                                                      best["goodput_steps_per_s"])
        report.update(date=time.strftime("%Y-%m-%d"), command=command,
                      job="tiny (2,2,1) 30 steps, ckpt every 5", injected_at_step=AT,
                      schedule=SCHEDULE, results=results)
        _table(results)
    if "lost_node" in kinds:
        ln = bench_lost_node(work)
        report["lost_node"] = {"date": time.strftime("%Y-%m-%d"), "command": command,
                               "job": LN_JOB, "killed_after_step": LN_KILL_AT,
                               "killed_node": "node-c (127.0.0.3, not the head)", "results": ln}
        _table(ln)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
