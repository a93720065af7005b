"""Memory-only snapshots between durable saves (checkpoint.memory_interval, trainer/loop.py
`hold`): real 4-rank jobs under ds3d's node agent, gloo on CPU, (TP, PP, DP) = (2, 2, 1), node
memory in this test process's tmpfs folder (tests/conftest.py sets DS3D_NODE_MEMORY_ROOT).

Durable saves every 6 steps, memory-only snapshots every 2 (steps 2, 4, 8, 10): a fault after
step 8 goes back to step 8's memory-only snapshot, not to step 6's durable save, both for an
in-process rollback (a NaN at step 9 with faults.skip_batches = 2, which always rolls back) and
for a crash restart (rank 2 exits before step 9; the agent restarts the group, which maps the
arenas back from node memory). Either way the run then trains, to the bit, as a fault-free run
(the rollback's: one that skips the same batch from the start): every loss, and every tensor
and counter of the final checkpoint. No memory-only snapshot ever made a file or a folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ds3d.checkpoints.identity import local_job_id
from ds3d.checkpoints.node_memory import job_folder

from fixtures.bitwise import assert_same
from support import losses, records, torchrun

STEPS = 12
SETS = [f"train.steps={STEPS}", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
        "checkpoint.interval=6", "checkpoint.memory_interval=2"]
FAULT_AT = 9  # before step 9: step 8's memory-only snapshot is the newest state held


def _inject(run_dir: Path, **req: object) -> None:
    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    (run_dir / "control" / "inject.json").write_text(json.dumps({"id": 1, **req}))


def _final_checkpoint(run_dir: Path) -> Path:
    return run_dir / "store" / "tiny" / "ckpt" / f"step-{STEPS:08d}"


def _assert_same_run(run: Path, ref: Path) -> None:
    """Every step's loss, and every file of the final checkpoint, equal to the bit."""
    want, got = losses(ref), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == want[step], (step, got[step], want[step])
    a, b = _final_checkpoint(run), _final_checkpoint(ref)
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.pt"))
    assert files and files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*.pt"))
    for name in files:
        assert_same(torch.load(a / name, weights_only=False),
                     torch.load(b / name, weights_only=False), name)


def _assert_nothing_written_for_memory_snapshots(run: Path) -> None:
    """Only durable steps (6 and the end) ever had a folder or an object: memory-only
    snapshots are not in the local tier, the store or the local-complete records."""
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("global_step")) \
        == ["global_step12", "global_step6"]
    assert sorted(p.name for p in (run / "store" / "tiny" / "ckpt").iterdir()) == [
        "step-00000006", f"step-{STEPS:08d}"]
    indexed = {c["step"] for c in records(run, 0, "checkpoint")
               if c.get("phase") in ("saved", "local_complete", "committed")}
    assert indexed == {6, STEPS}, indexed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nan_rollback_goes_back_to_the_newer_memory_only_snapshot(tmp_path: Path) -> None:
    """faults.skip_batches = 2: a NaN always rolls back (the batch before the bad one was
    trained on); the newest held snapshot at most step 8 is step 8's memory-only one."""
    sets = SETS + ["faults.skip_batches=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    _inject(run, kind="nan", rank=1, at_step=FAULT_AT)
    torchrun(run, 4, sets=sets, timeout=500)
    assert [(f["cause"], f["step"]) for f in records(run, 0, "fault")] == [("nan", FAULT_AT)]
    [rec] = records(run, 0, "recovery")
    assert (rec["source"], rec["recovered_to"], rec["steps_lost"]) == ("memory", 8, 1), rec
    # the window is cut at the snapshot's own batch: batch 8 (step 9's) alone is skipped
    assert rec["skipped_batches"] == [8, 9], rec
    held = [(r["step"], r["restart"]) for r in records(run, 0, "checkpoint")
            if r.get("phase") == "held_in_memory"]
    assert held == [(2, 0), (4, 0), (8, 0), (10, 0)], held  # 10 again after the rollback
    assert all(isinstance(r["blocked_s"], float) for r in records(run, 0, "checkpoint")
               if r.get("phase") == "held_in_memory")
    _assert_nothing_written_for_memory_snapshots(run)

    torchrun(ref, 4, sets=sets + ["data.skip_batches=[[8, 9]]"], timeout=500)
    assert not records(ref, 0, "fault") and not records(ref, 0, "recovery")
    _assert_same_run(run, ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_crash_restarts_from_the_memory_only_snapshot_in_node_memory(tmp_path: Path) -> None:
    root = Path(os.environ["DS3D_NODE_MEMORY_ROOT"])
    ref, run = tmp_path / "ref", tmp_path / "run"
    _inject(run, kind="crash", rank=2, at_step=FAULT_AT)
    torchrun(run, 4, sets=SETS, max_restarts=1, timeout=500)  # raises unless it exits 0

    starts = [(s["restart"], s["step"]) for s in records(run, 0, "start")]
    assert starts == [(0, 0), (1, 8)], starts
    assert (run / "control" / "inject-done-1").read_text() == str(FAULT_AT)
    restoring = [r for r in records(run, 0, "checkpoint") if r.get("phase") == "restoring"]
    assert [(r["restart"], r["step"], r["source"], r["durable"]) for r in restoring] == \
        [(1, 8, "node_memory", False)], restoring
    assert "memory-only snapshot" in restoring[0]["detail"]
    _assert_nothing_written_for_memory_snapshots(run)
    # a clean end removed every rank's arenas and markers, both slots
    job_id = local_job_id(run)
    assert job_id and not job_folder(job_id, root).exists(), \
        list(job_folder(job_id, root).iterdir())

    torchrun(ref, 4, sets=SETS, timeout=500)
    _assert_same_run(run, ref)


SPIKE_SETS = ["train.steps=12", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
              "checkpoint.interval=4", "checkpoint.memory_interval=2",
              "faults.spike_policy=rollback", "faults.spike_window=5", "faults.spike_mads=20"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_spike_rolls_back_to_a_memory_snapshot_older_than_a_suspect_durable_save(
        tmp_path: Path) -> None:
    """A spike from step 7 on rank 3, declared at step 9 (patience 3): steps 7-9 are suspect,
    so step 8's durable save is too. The held snapshots are step 8's (durable) and step 6's
    (memory-only): the rollback reads step 6 from memory, deletes step 8's checkpoint first
    (a restart must never restore it), and the run equals one that skipped batches 6-8."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    _inject(run, kind="spike", rank=3, at_step=7)
    torchrun(run, 4, sets=SPIKE_SETS, timeout=500)
    assert [(f["cause"], f["step"]) for f in records(run, 0, "fault")] == [("spike", 9)]
    [rec] = records(run, 0, "recovery")
    assert (rec["source"], rec["recovered_to"], rec["dropped_checkpoints"]) == (
        "memory", 6, [8]), rec
    assert rec["skipped_batches"] == [6, 9]  # batches 6..8 fed steps 7..9
    held = [r["step"] for r in records(run, 0, "checkpoint")
            if r.get("phase") == "held_in_memory"]
    assert held == [2, 6, 10], held  # 4 and 8 are durable saves (8 again after the rollback)
    torchrun(ref, 4, sets=SPIKE_SETS + ["data.skip_batches=[[6, 9]]"], timeout=500)
    _assert_same_run(run, ref)
