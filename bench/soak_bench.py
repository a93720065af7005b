"""Soak: a weeks-long run in fast motion, on CPU (issue 19, goal 7).

One real `ds3dd` (with --enable-fault-injection) lives for the whole soak on one state directory
and runs a chain of jobs, one after the other, through the real `ds3dctl`: `tiny` at
(TP, PP, DP) = (2, 2, 1), gloo, --steps-per-job steps each, checkpoint every 10 steps, keep_last
2, a file:// store under the soak's folder. Every 60-180 s (seeded RNG, recorded) one random
fault strikes the running job: each trainer FaultKind (nan, crash, hang, slow, spike) through
`ds3dctl inject --at-step <observed step + 3>`, or a daemon restart (SIGKILL of ds3dd, then a new
ds3dd on the same state directory: the workers must keep training and be reattached, not
relaunched). When the soak time is up, no new fault and no new job; the running job completes.

Every --sample-s seconds: ds3dd's RSS, open fds and threads; the same for the job's elastic agent
and (summed) its workers; disk bytes of the state directory, the local checkpoint tiers and the
store; bytes of report files, logs; rows of the event table (sqlite, read-only); bytes of the
workers' snapshot arenas in node memory (/dev/shm). `--set KEY=VALUE` adds job settings (e.g.
checkpoint.memory_interval=3: memory-only snapshots in both slots through every fault kind).
Reported per series: the slope per hour over the first and over the second half of the soak
(flat after warm-up vs. a leak).

Final loss: each job, once completed, is run again fault-free directly with torchrun (the same
job.json, the store and local tier moved to the reference's folder, `data.skip_batches` = the
windows its final checkpoint's manifest says the soak skipped), in a background thread while the
soak goes on with the next job (that load only slows the soak; nothing in it depends on timing).
The loss of every step of the soak's final trajectory (the last record of each step in rank 0's
report) is compared with the reference's at rel 1e-5.

Why a chain of jobs: the fault-free references must replay every trained step, and a 2-core
machine cannot afford a 60-minute reference after a 60-minute soak; jobs of a few hundred steps
each get their reference while the soak goes on, and the daemon and its state (what the
flatness measures) live through the whole soak.

    nice -n 5 python bench/soak_bench.py --minutes 60 --out bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fault_bench  # noqa: E402 - the bench folder is not a package

from ds3d.checkpoints import node_memory  # noqa: E402
from ds3d.trainer.kinds import FaultKind  # noqa: E402

DAEMON_RESTART = "daemon_restart"
KINDS = [*(str(k) for k in FaultKind), DAEMON_RESTART]
RANK_OF = {FaultKind.SPIKE: 3}  # the spike scales the head's logits: the last stage (rank 2/3)
AHEAD = 3  # inject this many steps after the observed step
# no fault this near a job's end: a rank takes an injection up a few steps late, and a spike is
# detected only after 3 spiked steps (an undetected spike at the end is a real loss difference)
MARGIN = 40
REL_TOL = 1e-5
# fault_bench's spike detection settings; max_rollbacks/max_restarts high: a soak meets many
SETS = [s for s in fault_bench.SETS if s.startswith(("faults.", "train.warmup"))] + [
    "checkpoint.interval=10", "checkpoint.keep_last=2", "faults.max_rollbacks=1000",
    "launch.max_restarts=1000"]
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DS3D_COLLECTIVE_TIMEOUT_S": "20",
       "DS3D_LOG_FORMAT": "json"}


def proc_stats(pids: list[int]) -> dict | None:
    """RSS (MiB), open fds and threads, summed over the live processes among `pids`."""
    out = {"rss_mib": 0.0, "fds": 0, "threads": 0, "n": 0}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                out["rss_mib"] += p.memory_info().rss / 2**20
                out["fds"] += p.num_fds()
                out["threads"] += p.num_threads()
            out["n"] += 1
        except psutil.Error:
            pass
    return out if out["n"] else None


def tree_bytes(path: Path, pattern: str = "**/*") -> int:
    """Apparent bytes of the files under `path` matching `pattern`. Retention removes folders
    while this walks (a 60-minute soak once died of it inside glob): such a walk starts over."""
    for _ in range(5):
        total = 0
        try:
            for f in path.glob(pattern):
                try:
                    if f.is_file() and not f.is_symlink():
                        total += f.stat().st_size
                except OSError:
                    pass
            return total
        except FileNotFoundError:
            continue
    return total


def event_rows(state_dir: Path) -> int:
    con = sqlite3.connect(f"file:{state_dir / 'ds3d.db'}?mode=ro", uri=True, timeout=10)
    try:
        return con.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    finally:
        con.close()


def agent_pids(run_dir: Path) -> list[int]:
    pids = []
    for f in sorted((run_dir / "control").glob("agent-*.pid")):
        try:
            pids.append(json.loads(f.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    return [p for p in pids if psutil.pid_exists(p)]


def sample(t0: float, daemon, state_dir: Path, store: Path, run_dir: Path | None,
           worker_procs) -> dict:
    jobs = state_dir / "jobs"
    s = {"t_s": round(time.time() - t0, 1),
         "daemon": proc_stats([daemon.proc.pid]) if daemon.proc else None,
         "agent": proc_stats(agent_pids(run_dir)) if run_dir else None,
         "workers": proc_stats(worker_procs(run_dir))
         if run_dir else None,
         "job": run_dir.name if run_dir else None,
         # the running job alone (its folder, local tier included, and its store prefix): what
         # its retention (keep_last) bounds; ended jobs keep their folders (no delete command)
         "job_disk_bytes": tree_bytes(run_dir) + tree_bytes(store / run_dir.name)
         if run_dir else None,
         "disk_state_dir_bytes": tree_bytes(state_dir),
         "disk_local_ckpt_bytes": tree_bytes(jobs, "*/ckpt/**/*"),
         "disk_store_bytes": tree_bytes(store),
         "report_bytes": tree_bytes(jobs, "*/reports/*.jsonl"),
         "log_bytes": tree_bytes(jobs, "*/logs/**/*") + tree_bytes(state_dir, "*.log*")
         + tree_bytes(state_dir.parent, "*.stdout"),
         "db_bytes": tree_bytes(state_dir, "ds3d.db*"),
         # the workers' snapshot arenas in node memory (RAM): one job's at most, bounded
         "node_memory_bytes": tree_bytes(node_memory.default_root(), "ds3d-*/**/*")}
    try:
        s["event_rows"] = event_rows(state_dir)
    except sqlite3.Error as e:
        s["event_rows"] = None
        s["event_rows_error"] = str(e)
    return s


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mx) * (v - my) for t, v in points) / var * 3600


def flatness(samples: list[dict]) -> dict:
    """Per series: first value, last value, min, max, slope/h over the first and second half."""
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for key, val in s.items():
            if isinstance(val, dict):
                for sub, v in val.items():
                    if sub != "n":
                        series.setdefault(f"{key}.{sub}", []).append((s["t_s"], float(v)))
            elif isinstance(val, (int, float)) and key not in ("t_s", "job_disk_bytes"):
                series.setdefault(key, []).append((s["t_s"], float(val)))
    half = (samples[0]["t_s"] + samples[-1]["t_s"]) / 2 if samples else 0
    out = {}
    for key, pts in series.items():
        out[key] = {"first": pts[0][1], "last": pts[-1][1],
                    "min": min(v for _, v in pts), "max": max(v for _, v in pts),
                    "slope_per_h_first_half": slope_per_hour([p for p in pts if p[0] < half]),
                    "slope_per_h_second_half": slope_per_hour([p for p in pts if p[0] >= half])}
    return out


def per_job(samples: list[dict]) -> dict:
    """The running job's own series (agent, workers, disk), job by job: each job has its own
    agent and workers, so their flatness is within a job."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(s["job"] for s in samples if s.get("job")):
        mine = [s for s in samples if s.get("job") == name]
        out[name] = {k: v for k, v in flatness(
            [{"t_s": s["t_s"], **{key: s[key] for key in ("agent", "workers", "job_disk_bytes")
                                  if s.get(key) is not None}} for s in mine]).items()}
    return out


GROWING = ("report_bytes", "log_bytes", "event_rows", "db_bytes", "disk_state_dir_bytes",
           "disk_local_ckpt_bytes", "disk_store_bytes")


def growth(samples: list[dict], useful_steps: int) -> dict:
    """What grows with the work done: the increase over the soak, per 1000 useful steps (the
    jobs' steps once each; retrained steps add to the bytes but not to this count), and whether
    the second half grew faster than the first (a rate that rises is more than linear)."""
    flat = flatness(samples)
    out = {}
    for key in GROWING:
        f = flat.get(key)
        if not f:
            continue
        first, second = f["slope_per_h_first_half"], f["slope_per_h_second_half"]
        out[key] = {"increase": f["last"] - f["first"],
                    "per_1000_useful_steps": (f["last"] - f["first"]) / useful_steps * 1000
                    if useful_steps else None,
                    "slope_second_half_over_first": second / first if first and second
                    else None}
    return out


def summarise(result: dict) -> dict:
    """The derived figures of a result (also for a result file written before they existed:
    --recompute)."""
    completed = [j for j in result["jobs"] if j.get("state") == "COMPLETED"]
    steps = int(result["command"].split("--steps-per-job")[1].split()[0]) \
        if "--steps-per-job" in result["command"] else 500
    result["useful_steps"] = steps * len(completed)
    result["flatness"] = flatness(result["samples"])
    result["per_job"] = per_job(result["samples"])
    result["growth"] = growth(result["samples"], result["useful_steps"])
    return result


def final_losses(run_dir: Path) -> dict[int, float]:
    """Loss per step of the final trajectory: the last record of each step in rank 0's report
    (a rolled-back or restarted stretch is trained again and recorded again, later)."""
    out: dict[int, float] = {}
    for r in fault_bench.records(run_dir):
        if r["kind"] == "step":
            out[r["step"]] = r["loss"]
    return out


def run_reference(soak_run_dir: Path, ref_dir: Path, windows: list) -> dict:
    """The soak job's own job.json, fault-free, its storage moved to `ref_dir`, its data
    skipping the windows the soak skipped; straight under torchrun as fault_bench runs jobs."""
    cfg = json.loads((soak_run_dir / "job.json").read_text())
    cfg["data"]["skip_batches"] = windows
    cfg["checkpoint"]["store"] = f"file://{ref_dir / 'store'}"
    cfg["checkpoint"]["local_dir"] = str(ref_dir / "ckpt")
    ref_dir.mkdir(parents=True, exist_ok=True)
    (ref_dir / "job.json").write_text(json.dumps(cfg))
    nproc = cfg["parallel"]["tp"] * cfg["parallel"]["pp"] * cfg["parallel"]["dp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", "ds3d.trainer.worker",
           "--run-dir", str(ref_dir)]
    env = dict(os.environ, **ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    t = time.time()
    with open(ref_dir / "torchrun.log", "w") as log:
        rc = subprocess.run(["nice", "-n", "5", *cmd], env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=3600).returncode
    return {"rc": rc, "wall_s": round(time.time() - t, 1)}


def compare(soak_run_dir: Path, ref_dir: Path, steps: int) -> dict:
    soak, ref = final_losses(soak_run_dir), final_losses(ref_dir)
    common = sorted(set(soak) & set(ref))
    rel = [abs(soak[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in common]
    worst = max(range(len(rel)), key=rel.__getitem__) if rel else None
    return {"steps_compared": len(common),
            "soak_steps_missing": sorted(set(range(1, steps + 1)) - set(soak))[:20],
            "ref_steps_missing": sorted(set(range(1, steps + 1)) - set(ref))[:20],
            "final_loss_soak": soak.get(steps), "final_loss_ref": ref.get(steps),
            "max_rel_diff": max(rel) if rel else None,
            "worst_step": common[worst] if worst is not None else None,
            "equal_at_rel_1e-5": bool(rel) and max(rel) <= REL_TOL
            and soak.get(steps) is not None and len(common) == steps}


class Soak:
    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        support = fault_bench._daemon_support()
        self.support = support
        self.args, self.root = args, root
        self.state_dir, self.store = root / "state", root / "store"
        self.rng = random.Random(args.seed)
        self.daemon = support.DaemonProc(
            self.state_dir, extra_env=ENV,
            args=["--enable-fault-injection", "--hang-timeout", "60"])
        self.samples: list[dict] = []
        self.faults: list[dict] = []
        self.jobs: list[dict] = []
        self.refs: queue.Queue = queue.Queue()
        self.ref_results: dict[str, dict] = {}
        self.t0 = time.time()
        self.series_file = args.out.with_suffix(".samples.jsonl")
        self.series_file.parent.mkdir(parents=True, exist_ok=True)
        self.series_file.write_text("")

    def keep_sample(self, s: dict) -> None:
        """Each sample is appended to <out>.samples.jsonl as it is taken: a soak that dies late
        keeps its time series (one did, and lost them)."""
        with self.series_file.open("a") as f:
            f.write(json.dumps(s) + "\n")

    # ---- jobs --------------------------------------------------------------------------------

    def start_job(self, n: int) -> dict:
        name = f"soak-{n:02d}"
        sets = sum((["--set", s] for s in SETS + self.args.set), [])
        r = self.daemon.ctl("start", "tiny", "--name", name, "--tp", "2", "--pp", "2",
                            "--steps", str(self.args.steps_per_job), "--store",
                            f"file://{self.store}", *sets)
        if r.returncode != 0:
            raise RuntimeError(f"ds3dctl start {name}: {r.stderr}")
        job = {"name": name, "started_s": round(time.time() - self.t0, 1),
               "run_dir": str(self.state_dir / "jobs" / name)}
        self.jobs.append(job)
        print(f"[{job['started_s']:7.1f}s] started {name}", flush=True)
        return job

    def finish_job(self, job: dict, state: str) -> None:
        run_dir = Path(job["run_dir"])
        job["ended_s"] = round(time.time() - self.t0, 1)
        job["state"] = state
        recs = fault_bench.records(run_dir)
        job["recoveries"] = [{"cause": r.get("cause"), "step": r.get("step"),
                              "recovered_to": r.get("recovered_to"),
                              "skipped_batches": r.get("skipped_batches")}
                             for r in recs if r["kind"] == "recovery"]
        job["worker_restarts"] = max(r.get("restart", 0) for r in recs)
        job["launch_events"] = sum(e["kind"] == "launch" for e in self.daemon.events(job["name"]))
        steps = self.args.steps_per_job
        manifest = self.store / job["name"] / "ckpt" / f"step-{steps:08d}" / "MANIFEST.json"
        windows = json.loads(manifest.read_text()).get("data_position", {}).get(
            "skip_batches", []) if manifest.is_file() else None
        job["skip_batches"] = windows
        print(f"[{job['ended_s']:7.1f}s] {job['name']} {state}: {len(job['recoveries'])} "
              f"recoveries, {job['worker_restarts']} restarts, windows {windows}", flush=True)
        if state == "COMPLETED" and windows is not None:
            self.refs.put(job)

    def reference_worker(self) -> None:
        while True:
            job = self.refs.get()
            if job is None:
                return
            ref_dir = self.root / "ref" / job["name"]
            try:
                res = run_reference(Path(job["run_dir"]), ref_dir, job["skip_batches"])
                res.update(compare(Path(job["run_dir"]), ref_dir, self.args.steps_per_job))
            except Exception as e:  # noqa: BLE001 - recorded, the soak goes on
                res = {"error": repr(e)}
            self.ref_results[job["name"]] = res
            print(f"reference {job['name']}: {res}", flush=True)

    # ---- faults ------------------------------------------------------------------------------

    def fire(self, job: dict) -> bool:
        """One random fault into the running job; False if the job is not at a point to take
        one (not running, too near its end): the caller tries again shortly."""
        info = self.daemon.job(job["name"])
        step = info["step"]
        if info["state"] != "RUNNING" or step < 1 or step + MARGIN > self.args.steps_per_job:
            return False
        kind = self.rng.choice(self.args.kinds)
        rec = {"t_s": round(time.time() - self.t0, 1), "job": job["name"], "kind": kind,
               "observed_step": step}
        if kind == DAEMON_RESTART:
            run_dir = Path(job["run_dir"])
            launches = sum(e["kind"] == "launch" for e in self.daemon.events(job["name"]))
            self.daemon.kill()
            rec["workers_alive_after_kill"] = len(self.support.worker_procs(run_dir))
            time.sleep(2)
            t = time.time()
            self.daemon.start(timeout_s=120)
            rec["restart_s"] = round(time.time() - t, 2)
            after = self.daemon.wait_for(
                job["name"], lambda j: j["step"] > step or j["state"] != "RUNNING",
                "a step after the daemon restart", timeout_s=600)
            rec["state_after"] = after["state"]
            rec["step_after"] = after["step"]
            rec["reattached"] = sum(e["kind"] == "launch"
                                    for e in self.daemon.events(job["name"])) == launches
        else:
            rank = RANK_OF.get(FaultKind(kind), self.rng.randrange(4))
            at = step + AHEAD
            r = self.daemon.ctl("inject", job["name"], kind, "--rank", str(rank),
                                "--at-step", str(at))
            rec.update(rank=rank, at_step=at, rc=r.returncode,
                       out=(r.stdout or r.stderr).strip()[-300:])
            if r.returncode == 0:
                rec["id"] = json.loads((Path(job["run_dir"]) / "control" /
                                        "inject.json").read_text())["id"]
        self.faults.append(rec)
        print(f"[{rec['t_s']:7.1f}s] {job['name']} step {step}: {kind} {rec}", flush=True)
        return True

    # ---- the soak ----------------------------------------------------------------------------

    def run(self) -> dict:
        args = self.args
        self.daemon.start()
        refs = threading.Thread(target=self.reference_worker, daemon=True)
        refs.start()
        deadline = self.t0 + args.minutes * 60
        n = 1
        job = self.start_job(n)
        next_fault = time.time() + self.rng.uniform(args.gap_min, args.gap_max)
        next_sample = 0.0
        try:
            while True:
                now = time.time()
                if now >= next_sample:
                    self.samples.append(sample(self.t0, self.daemon, self.state_dir, self.store,
                                               Path(job["run_dir"]) if job else None,
                                               self.support.worker_procs))
                    self.keep_sample(self.samples[-1])
                    next_sample = now + args.sample_s
                if job is not None:
                    state = self.daemon.job(job["name"])["state"]
                    if state in ("COMPLETED", "FAILED", "STOPPED", "PAUSED"):
                        self.finish_job(job, state)
                        job = None
                        if time.time() < deadline:
                            n += 1
                            job = self.start_job(n)
                if job is None:
                    break
                if time.time() >= next_fault and time.time() < deadline:
                    if self.fire(job):
                        next_fault = time.time() + self.rng.uniform(args.gap_min, args.gap_max)
                    else:
                        next_fault = time.time() + 5
                time.sleep(1.0)
            soak_s = time.time() - self.t0
            self.samples.append(sample(self.t0, self.daemon, self.state_dir, self.store, None,
                                       self.support.worker_procs))
            self.refs.put(None)
            refs.join()
        finally:
            self.daemon.stop()
            self.support.kill_job_processes(self.state_dir)
        for f in self.faults:  # did each injected fault fire?
            if "id" in f:
                done = self.state_dir / "jobs" / f["job"] / "control" / f"inject-done-{f['id']}"
                f["fired"] = done.exists()
        return summarise(self.result(soak_s))

    def result(self, soak_s: float) -> dict:
        by_kind: dict[str, dict] = {}
        for f in self.faults:
            k = by_kind.setdefault(f["kind"], {"issued": 0, "fired": 0})
            k["issued"] += 1
            k["fired"] += bool(f.get("fired") or f.get("reattached"))
        recoveries: dict[str, int] = {}
        for j in self.jobs:
            for r in j.get("recoveries", []):
                recoveries[r["cause"]] = recoveries.get(r["cause"], 0) + 1
        for j in self.jobs:
            j["reference"] = self.ref_results.get(j["name"])
        return {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.t0)),
            "command": " ".join(["python", "bench/soak_bench.py", *sys.argv[1:]]),
            "job": f"tiny (2,2,1) gloo, {self.args.steps_per_job} steps per job, "
                   f"{' '.join(SETS + self.args.set)}, file:// store",
            "code_commit": self.args.code_commit, "code_from": str(Path(
                __import__("ds3d.daemon").daemon.__file__).parent.parent),
            "seed": self.args.seed, "kinds": self.args.kinds,
            "gap_s": [self.args.gap_min, self.args.gap_max],
            "soak_minutes_requested": self.args.minutes,
            "soak_s": round(soak_s, 1), "daemon_restarts": by_kind.get(DAEMON_RESTART, {}),
            "faults_by_kind": by_kind, "recoveries_by_cause": recoveries,
            "jobs": self.jobs, "faults": self.faults,
            "all_losses_equal": all(j["reference"] and j["reference"].get("equal_at_rel_1e-5")
                                    for j in self.jobs if j.get("state") == "COMPLETED"),
            "samples": self.samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--steps-per-job", type=int, default=500)
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--gap-min", type=float, default=60.0)
    ap.add_argument("--gap-max", type=float, default=180.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--kinds", type=lambda v: v.split(","), default=KINDS,
                    help=f"comma-separated fault kinds to draw from (default: all, {KINDS})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a job setting added to the soak's own (e.g. "
                         "checkpoint.memory_interval=3); repeatable")
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    ap.add_argument("--code-commit", default="",
                    help="recorded as is: the commit of the code under test (a soak can run "
                    "from a snapshot of it, apart from a working tree others edit)")
    ap.add_argument("--keep", type=Path, help="work folder kept afterwards (default: a temp dir)")
    ap.add_argument("--recompute", type=Path, metavar="RESULT.json",
                    help="only recompute the derived figures of a result file, in place")
    args = ap.parse_args()
    if args.recompute:
        result = summarise(json.loads(args.recompute.read_text()))
        args.recompute.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["growth"], indent=1))
        return
    if unknown := sorted(set(args.kinds) - set(KINDS)):
        ap.error(f"--kinds: unknown {unknown}; choose from {KINDS}")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        root = args.keep
        result = Soak(root, args).run()
    else:
        with tempfile.TemporaryDirectory(prefix="ds3d-soak-") as tmp:
            result = Soak(Path(tmp), args).run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    bulky = ("samples", "faults", "jobs", "flatness", "per_job", "growth")
    print(json.dumps({k: v for k, v in result.items() if k not in bulky}, indent=1))


if __name__ == "__main__":
    main()
