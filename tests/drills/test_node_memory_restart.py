"""A crashed worker group restarts from the newest save's host copy in node memory
(checkpoints/node_memory.py): real processes under ds3d's node agent (torch elastic's restart
loop, tests/support.torchrun), gloo on CPU, (TP, PP, DP) = (2, 2, 1), the arena a file in a
tmpfs (this test process's folder in /dev/shm: tests/conftest.py sets DS3D_NODE_MEMORY_ROOT).

Saves every 3 steps; rank 2 crashes (os._exit) before step 9, two steps after step 6's save.
Every rank's marker names step 6, so the restarted group restores step 6 from node memory, with
no disk read, and trains on to the bit as a run without the fault. After the clean end, the
job's node memory folder is gone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ds3d.checkpoints.identity import local_job_id
from ds3d.checkpoints.node_memory import job_folder

from support import losses, records, torchrun

STEPS = 12
SETS = [f"train.steps={STEPS}", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
        "checkpoint.interval=3"]


def _inject(run_dir: Path, **req: object) -> None:
    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    (run_dir / "control" / "inject.json").write_text(json.dumps({"id": 1, **req}))


def _restoring(run: Path) -> list[dict]:
    return [r for r in records(run, 0, "checkpoint") if r.get("phase") == "restoring"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_crash_restarts_from_the_save_held_in_node_memory(tmp_path: Path) -> None:
    root = Path(os.environ["DS3D_NODE_MEMORY_ROOT"])
    ref, run = tmp_path / "ref", tmp_path / "run"
    torchrun(ref, 4, sets=SETS)
    _inject(run, kind="crash", rank=2, at_step=9)
    torchrun(run, 4, sets=SETS, max_restarts=1, timeout=500)  # raises unless it exits 0

    starts = [(s["restart"], s["step"]) for s in records(run, 0, "start")]
    assert starts == [(0, 0), (1, 6)], starts
    assert (run / "control" / "inject-done-1").read_text() == "9"
    restoring = _restoring(run)
    assert [(r["restart"], r["step"], r["source"]) for r in restoring] == \
        [(1, 6, "node_memory")], restoring
    assert "node memory" in restoring[0]["detail"]
    want, got = losses(ref), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == want[step], (step, got[step], want[step])  # to the bit
    # a clean end removed every rank's arena and marker: nothing of the job is left in RAM
    job_id = local_job_id(run)
    assert job_id and not job_folder(job_id, root).exists(), \
        list(job_folder(job_id, root).iterdir())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_keep_in_node_memory_false_restarts_from_disk(tmp_path: Path) -> None:
    """The same crash with node memory off: the restart reads the local tier (step 6 if its
    files were local-complete before the crash, else step 3), nothing is put in /dev/shm."""
    root = Path(os.environ["DS3D_NODE_MEMORY_ROOT"])
    run = tmp_path / "run"
    _inject(run, kind="crash", rank=2, at_step=9)
    sets = SETS + ["checkpoint.keep_in_node_memory=false"]
    torchrun(run, 4, sets=sets, max_restarts=1, timeout=500)
    restoring = _restoring(run)
    assert len(restoring) == 1 and restoring[0]["source"] == "local", restoring
    assert restoring[0]["step"] in (3, 6)
    job_id = local_job_id(run)
    assert job_id and not job_folder(job_id, root).exists()
