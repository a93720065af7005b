"""Cost of each fault kind on CPU, against a fault-free run of the same job in the same run.

The same job, (TP, PP, DP) = (2, 2, 1) `tiny`, 30 steps, checkpoint every 5 steps, runs under
the real elastic agent (torchrun, --max-restarts 3) once without faults and once per fault kind,
injected at step 12 on rank 1 through control/inject.json (what `ds3dctl inject` writes):

  nan    the rank's forward turns NaN; all ranks agree, roll back in-process to step 10, skip
         the batch
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

Reported per kind: time to detect (fault injected -> fault noticed), time to recover (noticed ->
first step after the recovery), steps lost (re-trained steps), and goodput = useful steps per
wall-second from the first worker's start to the end, as a share of the fault-free run's.

    python bench/fault_bench.py --out bench/results/faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, AT = 30, 12
SETS = [f"train.steps={STEPS}", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
        "checkpoint.interval=5", "faults.spike_policy=rollback", "faults.spike_window=5",
        "faults.spike_mads=20"]
SINGLE = {"nan": 1, "crash": 1, "hang": 1, "slow": 1, "spike": 3}  # kind -> rank it hits
SCHEDULE = [("nan", 1, 8), ("crash", 2, 16), ("spike", 3, 22)]  # (kind, rank, at step)


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
    path = run_dir / "reports" / f"rank-{rank:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def analyse(run_dir: Path, t0: float, kind: str | None) -> dict:
    recs = records(run_dir)
    steps = [r for r in recs if r["kind"] == "step"]
    end = max(r["time"] for r in recs)
    # from the first worker's start: process spawn and imports (10-20 s on 2 cores, noisy) are
    # the same for every run and say nothing about fault handling
    begin = min(r["time"] for r in recs if r["kind"] == "start")
    out = {"wall_s": end - t0, "training_wall_s": end - begin, "useful_steps": STEPS,
           "trained_steps": len(steps), "steps_lost": len(steps) - STEPS,
           "goodput_steps_per_s": STEPS / (end - begin)}
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/faults.json")
    ap.add_argument("--kinds", default="nan,crash,hang,slow,spike,schedule")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ds3d-fault-bench-"))
    results: dict = {}
    t0 = run_job(work / "baseline", [])
    results["none"] = analyse(work / "baseline", t0, None)
    for kind in args.kinds.split(","):
        run = work / kind
        t0 = run_job(run, SCHEDULE if kind == "schedule" else [(kind, SINGLE[kind], AT)])
        results[kind] = analyse(run, t0, kind)
        results[kind]["goodput_vs_fault_free"] = (results[kind]["goodput_steps_per_s"] /
                                                  results["none"]["goodput_steps_per_s"])
        print(kind, json.dumps(results[kind]), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "job": "tiny (2,2,1) 30 steps, ckpt every 5",
              "injected_at_step": AT, "schedule": SCHEDULE, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'fault':8} {'wall s':>7} {'detect s':>9} {'recover s':>10} {'lost':>5} {'goodput':>8}")
    for k, r in results.items():
        print(f"{k:8} {r['wall_s']:7.1f} {r.get('time_to_detect_s', 0):9.2f} "
              f"{r.get('time_to_recover_s', 0):10.2f} {r['steps_lost']:5d} "
              f"{r.get('goodput_vs_fault_free', 1):8.1%}")


if __name__ == "__main__":
    main()
