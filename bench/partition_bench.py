"""Pipeline partition by parameters, uniform and measured, on CPU: per-stage time and step time.

One deliberately unbalanced GPT: 8 blocks of d = 128, the first two with 1024-wide MLPs and the
other six 64-wide, 512-token sequences, a vocabulary of 8192 (PP = 2) or 4096 (PP = 4). Parameter
counts mislead three ways: the embedding holds as many parameters as the head but costs almost
nothing, the head also computes the loss, and attention cost (quadratic in the sequence) has no
parameters, so the narrow blocks cost far more than their parameters say and the wide ones less.
Each pipeline depth runs, in this one invocation, under torchrun with gloo:

  parameters  DeepSpeed's parameter-balanced split (what "measured" starts from)
  uniform     the same number of blocks per stage
  measured    partition_method = "measured": profiles steps 2-6 (2 unhooked calibration steps,
              3 with the layer hooks), checkpoints, ends with reason
              `repartition`; the next start (the restart the daemon would do) restores the
              checkpoint into the measured split and trains on

Per-stage time is the stage's forward + backward time per step (the trainer's step-time split,
`train.timing_interval = 1`), the median over steps 9..N on each rank (every process skips its
first steps: allocation, first-touch); step time is the median of rank 0's step times over the
same steps. `predicted` applies trainer/partition.py's model to the costs measured in the
"measured" run's profile.

    flock /tmp/ds3d-heavy.lock .venv/bin/python bench/partition_bench.py \\
        --out bench/results/partition.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ds3d.trainer.report import read_rank_records

MODEL = ["model.n_layers=8", "model.d_model=128", "model.n_heads=4", "model.seq_len=512",
         "model.layer_d_ff=[1024,1024,64,64,64,64,64,64]", "train.micro_batch_size=1",
         "train.warmup_steps=2", "train.timing_interval=1"]
# the head (with the loss) grows with the vocabulary; with 4 stages a smaller one, so that the
# head alone is not the slowest stage of every split
VOCAB = {2: 8192, 4: 4096}
FIRST_MEASURED = 9  # steps before this are warm-up (and, for "measured", profile + restart)


LOADS: list[dict[str, Any]] = []  # 1-minute load average around every run (shared machines)


def wait_quiet(max_load: float, timeout_s: float = 900.0) -> float:
    """Waits until the 1-minute load average is below `max_load` (other work on a shared machine
    would be measured as stage time), at most `timeout_s`; returns the load seen."""
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def torchrun(run_dir: Path, nproc: int, sets: list[str], max_load: float = 1.5) -> float:
    """Runs the worker group to its end (after waiting for a quiet machine); returns wall
    seconds."""
    before = wait_quiet(max_load)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "ds3d.trainer.worker", "--run-dir", str(run_dir),
           "--config", "tiny"] + sum((["--set", s] for s in sets), [])
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DS3D_LOG_FORMAT="json")
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    (run_dir / "torchrun.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed in {run_dir}:\n{proc.stderr[-3000:]}")
    LOADS.append({"run": run_dir.name, "load_before": round(before, 2),
                  "load_after": round(os.getloadavg()[0], 2)})
    return time.perf_counter() - t0


def records(run_dir: Path, rank: int, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_rank_records(run_dir, rank) if r["kind"] == kind]


def analyse(run_dir: Path, nproc: int) -> dict[str, Any]:
    """Measured per-stage busy time, step time and bubble over steps >= FIRST_MEASURED of the
    newest start."""
    last_start = records(run_dir, 0, "start")[-1]
    steps = {r["step"]: r for r in records(run_dir, 0, "step") if r["step"] >= FIRST_MEASURED}
    busy: dict[int, list[float]] = {}
    bubble: list[float] = []
    for rank in range(nproc):
        for hb in records(run_dir, rank, "heartbeat"):
            if "split" in hb and hb["step"] >= FIRST_MEASURED:
                s = hb["split"]
                busy.setdefault(hb["stage"], []).append(s["forward"] + s["backward"])
                if "bubble" in s:
                    bubble.append(s["bubble"])
    stage_busy = [statistics.median(busy[k]) for k in sorted(busy)]
    return {"boundaries": last_start["partition"], "source": last_start["partition_source"],
            "stage_busy_s": [round(x, 4) for x in stage_busy],
            "slowest_stage_s": round(max(stage_busy), 4),
            "step_s": round(statistics.median(r["step_time_s"] for r in steps.values()), 4),
            "bubble_measured": round(statistics.mean(bubble), 4),
            "steps_measured": len(steps)}


def bench_pp(pp: int, steps: int, micro_batches: int, root: Path) -> dict[str, Any]:
    from ds3d.trainer.config import build_job_config
    from ds3d.trainer.partition import LayerCost, MemoryModel, method_boundaries, predict

    sets = MODEL + [f"model.vocab_size={VOCAB.get(pp, 8192)}", f"parallel.pp={pp}",
                    f"train.global_batch_size={micro_batches}", f"train.steps={steps}"]
    out: dict[str, Any] = {"pp": pp, "micro_batches": micro_batches, "steps": steps,
                           "vocab_size": VOCAB.get(pp, 8192), "runs": {}}
    walls: dict[str, float] = {}
    for method in ("parameters", "uniform"):
        run = root / f"pp{pp}-{method}"
        walls[method] = torchrun(run, pp, sets + [f'parallel.partition_method="{method}"'])
        out["runs"][method] = analyse(run, pp)
        print(f"pp={pp} {method}: {out['runs'][method]}", flush=True)
    run = root / f"pp{pp}-measured"
    measured = sets + ['parallel.partition_method="measured"']
    first = torchrun(run, pp, measured)
    decided = json.loads((run / "partition.json").read_text())
    second = torchrun(run, pp, measured)
    walls["measured"] = first + second
    out["runs"]["measured"] = analyse(run, pp)
    out["runs"]["measured"]["repartition"] = {
        "at_step": decided["step"], "decision": decided["decision"],
        "from": decided["previous"], "to": decided["boundaries"],
        "first_run_s": round(first, 1), "restart_run_s": round(second, 1)}
    print(f"pp={pp} measured: {out['runs']['measured']}", flush=True)

    out["calibration"] = {f"stage {r['stage']}": r["calibration"]
                          for rank in range(pp) for r in records(run, rank, "profile")}
    costs_doc = json.loads((run / "profile" / "layer-costs.json").read_text())
    costs = [LayerCost(c["layer"], c["forward_s"], c["backward_s"], c["params"],
                       c["activation_bytes"]) for c in costs_doc["layers"]]
    out["layer_costs"] = [{"layer": c["layer"], "name": c["name"],
                           "forward_ms": round(c["forward_s"] * 1e3, 2),
                           "backward_ms": round(c["backward_s"] * 1e3, 2), "params": c["params"],
                           "activation_bytes": c["activation_bytes"]}
                          for c in costs_doc["layers"]]
    cfg = build_job_config("tiny", sets)
    mem = MemoryModel(costs_doc["bytes_per_param"])
    for method, res in out["runs"].items():
        bounds = res["boundaries"]
        if method != "measured":
            assert bounds == method_boundaries(cfg.model_copy(update={"parallel": cfg.parallel
                                                .model_copy(update={"partition_method": method})}))
        p = predict(costs, bounds, micro_batches, mem)
        res["predicted"] = {"stage_busy_s": [round(s * micro_batches, 4) for s in p.stage_s],
                            "step_s": round(p.step_s, 4), "bubble": round(p.bubble, 4)}
        res["wall_s"] = round(walls[method], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench/results/partition.json"))
    args = ap.parse_args()
    import deepspeed
    import torch

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "flock /tmp/ds3d-heavy.lock .venv/bin/python bench/partition_bench.py "
                   + " ".join(sys.argv[1:]),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                 "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                 "backend": "gloo", "omp_threads": 1},
        "model": MODEL, "vocab_size": VOCAB, "first_measured_step": FIRST_MEASURED, "pipelines": []}
    with tempfile.TemporaryDirectory(prefix="ds3d-partition-bench-") as tmp:
        for pp in args.pp:
            result["pipelines"].append(bench_pp(pp, args.steps, args.micro_batches, Path(tmp)))
    result["load_average"] = LOADS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for pipe in result["pipelines"]:
        print(f"\nPP={pipe['pp']}, m={pipe['micro_batches']}")
        for method, r in pipe["runs"].items():
            print(f"  {method:<10} {'|'.join(map(str, r['boundaries'])):<14} stages "
                  f"{r['stage_busy_s']} s  step {r['step_s']:.3f} s  bubble "
                  f"{r['bubble_measured']:.1%}  (predicted step {r['predicted']['step_s']:.3f} s)")


if __name__ == "__main__":
    main()
