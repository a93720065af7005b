"""Goodput of `checkpoint.interval = "auto"` (Young-Daly) against fixed intervals, on CPU.

The same job, `tiny` at DP 2 (two processes), STEPS steps, runs under the real elastic agent
(torchrun, --max-restarts 100) once per checkpoint policy, with the same fault schedule: a crash
of rank 1 every FAULT_EVERY_S seconds of wall time from the first step (written to
control/inject.json, what `ds3dctl inject` writes, for the next step). A crash costs a process
restart (start-up, restore) plus the steps since the newest committed checkpoint; a checkpoint
costs its snapshot and its upload to the file store. Faults come by the clock, not by step, so
every policy meets the same failure process.

"auto" is given the schedule's true MTBF as its prior (`checkpoint.auto_mtbf_prior_hours`), as an
operator would give a fleet's measured failure rate; under plain torchrun there is no daemon to
count failures, so the prior is all it has (the daemon-observed rate is tested in
tests/unit/test_checkpoint_interval.py). Its save cost is measured in the run.

Goodput = useful steps / wall seconds from the first worker's start to the end, as a share of a
fault-free run without checkpoints of the same job (run first and last; the faster counts).

    python bench/interval_bench.py --out bench/results/interval.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ds3d.trainer.report import read_rank_records

STEPS = 600
FAULT_EVERY_S = 12.0
BASE = [f"train.steps={STEPS}", "train.warmup_steps=2", "parallel.dp=2",
        "checkpoint.keep_last=2"]
POLICIES = {"none (fault-free, no checkpoints)": ["checkpoint.interval=0"],
            "every 1 step": ["checkpoint.interval=1"],
            "every 10 steps": ["checkpoint.interval=10"],
            "every 50 steps": ["checkpoint.interval=50"],
            "auto": ['checkpoint.interval="auto"',
                     f"checkpoint.auto_mtbf_prior_hours={FAULT_EVERY_S / 3600:.6f}",
                     "checkpoint.auto_initial_save_cost_s=1.0"]}


def records(run_dir: Path, rank: int = 0) -> list[dict]:
    return read_rank_records(run_dir, rank)


def crash_by_the_clock(run_dir: Path, stop: threading.Event) -> None:
    """A crash of rank 1 every FAULT_EVERY_S seconds, counted from the first trained step."""
    while not any(r["kind"] == "step" for r in records(run_dir)):
        if stop.wait(0.2):
            return
    first = time.monotonic()
    i = 0
    while True:
        i += 1
        if stop.wait(max(0.0, first + i * FAULT_EVERY_S - time.monotonic())):
            return
        (run_dir / "control" / "inject.json").write_text(
            json.dumps({"id": i, "kind": "crash", "rank": 1, "at_step": 0}))


def run(run_dir: Path, sets: list[str], faults: bool) -> dict:
    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    feeder = threading.Thread(target=crash_by_the_clock, args=(run_dir, stop), daemon=True)
    if faults:
        feeder.start()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=100", "-m", "ds3d.trainer.worker", "--run-dir", str(run_dir),
           "--config", "tiny"] + sum((["--set", s] for s in BASE + sets), [])
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DS3D_LOG_FORMAT="json")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"job failed: {proc.stderr[-3000:]}")
    recs = records(run_dir)
    steps = [r for r in recs if r["kind"] == "step"]
    begin = min(r["time"] for r in recs if r["kind"] == "start")
    end = max(r["time"] for r in recs)
    saves = [r for r in recs if r["kind"] == "checkpoint" and r.get("phase") == "saved"]
    out = {"training_wall_s": round(end - begin, 2), "trained_steps": len(steps),
           "steps_lost": len(steps) - STEPS,
           "crashes": len(list(run_dir.glob("control/inject-done-*"))),
           "saves": len(saves), "goodput_steps_per_s": STEPS / (end - begin),
           "step_time_s": sorted(r["step_time_s"] for r in steps)[len(steps) // 2]}
    decisions = [r for r in recs if r["kind"] == "checkpoint_interval"]
    if decisions:
        last = decisions[-1]
        out["auto_final"] = {k: last[k] for k in ("interval_s", "save_cost_s", "blocked_s",
                                                  "commit_s", "mtbf_s", "measured")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/interval.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ds3d-interval-bench-"))
    names = list(POLICIES)
    results: dict = {}
    baselines = [run(work / "baseline-1", POLICIES[names[0]], faults=False)]
    for name in names[1:]:
        results[name] = run(work / name.replace(" ", "-"), POLICIES[name], faults=True)
        print(name, json.dumps(results[name]), flush=True)
    baselines.append(run(work / "baseline-2", POLICIES[names[0]], faults=False))
    best = max(baselines, key=lambda b: b["goodput_steps_per_s"])
    for r in results.values():
        r["goodput_vs_fault_free"] = round(r["goodput_steps_per_s"]
                                           / best["goodput_steps_per_s"], 4)
    report = {"date": time.strftime("%Y-%m-%d"), "command": "python bench/interval_bench.py "
              + " ".join(sys.argv[1:]), "machine": f"{os.cpu_count()} CPU cores",
              "job": f"tiny DP 2, {STEPS} steps, file store", "fault": f"crash of rank 1 every "
              f"{FAULT_EVERY_S:g} s of wall time", "baseline": {
                  **best, "training_wall_s_both": [b["training_wall_s"] for b in baselines]},
              "results": results}
    print(f"\n{'policy':16} {'saves':>5} {'crashes':>7} {'lost':>5} {'goodput':>8}")
    for name, r in results.items():
        print(f"{name:16} {r['saves']:5d} {r['crashes']:7d} {r['steps_lost']:5d} "
              f"{r['goodput_vs_fault_free']:8.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
