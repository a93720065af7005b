"""A checkpoint saved at one (TP, PP, DP) layout restores at another through DeepSpeed's
universal checkpoint (DP 2 -> 1 after a lost node; TP 2 -> PP 2), and the losses continue the
uninterrupted reference run."""

import json

import pytest

from support import losses, records, torchrun

BASE = ["train.steps=8", "train.warmup_steps=2", "parallel.zero_stage=1"]
CASES = {  # name: (saved layout, restored layout)
    "dp-2-to-1": ((1, 2, 2), (1, 2, 1)),
    "tp2-to-pp2": ((2, 1, 1), (1, 2, 1)),
}


def _sets(layout):
    tp, pp, dp = layout
    return BASE + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}"]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted one-process run every case continues (the same for all of them)."""
    ref = tmp_path_factory.mktemp("ref")
    torchrun(ref, 1, sets=_sets((1, 1, 1)))
    return losses(ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_restore_into_another_layout(tmp_path, case, reference_losses):
    before, after = CASES[case]
    run = tmp_path / "run"
    torchrun(run, before[0] * before[1] * before[2], sets=_sets(before),
             extra=["--stop-at-step", "4"])
    torchrun(run, after[0] * after[1] * after[2], sets=_sets(after))  # same store, new shape
    reshaped = [r for r in records(run, 0, "checkpoint") if r["phase"] == "reshaped"]
    assert len(reshaped) == 1
    assert f"{','.join(map(str, before))} -> {','.join(map(str, after))}" in reshaped[0]["detail"]
    manifest = json.loads((run / "store" / "tiny" / "ckpt" / "step-00000008" / "MANIFEST.json")
                          .read_text())
    assert [manifest["layout"][k] for k in ("tp", "pp", "dp")] == list(after)
    want, got = reference_losses, losses(run)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        # every layout computes the same maths, summed in another order (see
        # test_parallel_equivalence), so the continued run matches the reference to 1e-5
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), step


def _inject_unconvertible(run) -> None:
    """The drill's UNCONVERTIBLE fault on rank 0 from step 1 (what `ds3dctl inject` writes):
    every checkpoint it saves then carries a universal-checkpoint pattern no parameter
    matches, which DeepSpeed's converter refuses."""
    control = run / "control"
    control.mkdir(parents=True, exist_ok=True)
    (control / "inject.json").write_text(json.dumps(
        {"id": "u1", "kind": "unconvertible", "rank": 0, "at_step": 1}))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_the_converter_refuses_is_reported_and_loads_as_saved(tmp_path):
    """DP 2 -> 1 (a lost node) of a checkpoint DeepSpeed's converter refuses: the restore
    fails with the converter's own error, reported as the checkpoint's (`load_failed`, cause
    `reshape`: the daemon pauses the job); the same checkpoint still restores into the layout
    it was saved with."""
    run = tmp_path / "run"
    _inject_unconvertible(run)
    torchrun(run, 2, sets=_sets((1, 1, 2)), extra=["--stop-at-step", "4"])
    with pytest.raises(AssertionError, match="agent exited"):
        torchrun(run, 1, sets=_sets((1, 1, 1)))
    [failed] = [r for r in records(run, 0, "checkpoint") if r["phase"] == "load_failed"]
    assert failed["step"] == 4 and failed["cause"] == "reshape", failed
    assert failed["reshape"] == "(tp,pp,dp) 1,1,2 -> 1,1,1"
    assert "Unused patterns" in failed["detail"] and "ds3d_drill" in failed["detail"], failed
    assert (run / "ckpt" / "global_step4").is_dir()
    assert not (run / "ckpt" / "global_step4_universal").exists()  # the half-written copy

    torchrun(run, 2, sets=_sets((1, 1, 2)))  # the layout it was saved with: no conversion
    assert sorted(losses(run)) == list(range(1, 9))
    loaded = [r for r in records(run, 0, "checkpoint") if r["phase"] == "loaded"]
    assert [(r["step"], r["universal"]) for r in loaded] == [(4, False)], loaded


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_split_the_checkpoint_cannot_take_keeps_the_saved_one(tmp_path):
    """A new pipeline split (a measured re-split, `ds3dctl rebalance`: partition.json) whose
    conversion the checkpoint fails: the job trains on in the split it was saved with, keeps
    it in partition.json (source `checkpoint`: no conversion nor profile at later starts),
    and its losses are those of the uninterrupted run."""
    from ds3d.trainer.config import build_job_config
    from ds3d.trainer.partition import method_boundaries, write_partition_file

    sets = BASE + ["parallel.pp=2"]
    cfg = build_job_config("tiny", sets)
    saved = method_boundaries(cfg)
    moved = [0, saved[1] + 1, saved[2]]
    ref, run = tmp_path / "ref", tmp_path / "run"
    torchrun(ref, 2, sets=sets)
    _inject_unconvertible(run)
    torchrun(run, 2, sets=sets, extra=["--stop-at-step", "4"])
    write_partition_file(run, cfg, moved, "rebalance", decision="applied")
    torchrun(run, 2, sets=sets)

    [failed] = [r for r in records(run, 0, "checkpoint") if r["phase"] == "reshape_failed"]
    assert failed["step"] == 4 and f"stages {saved} -> {moved}" in failed["detail"], failed
    assert "Unused patterns" in failed["detail"], failed
    kept = json.loads((run / "partition.json").read_text())
    assert kept["boundaries"] == saved and kept["source"] == "checkpoint", kept
    assert kept["previous"] == moved and kept["step"] == 4
    starts = records(run, 0, "start")
    assert [(s["step"], s["partition"], s["partition_source"]) for s in starts] == \
        [(0, saved, "parameters"), (4, saved, "checkpoint")], starts
    want, got = losses(ref), losses(run)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    assert got == want  # the same split, the checkpoint loaded as saved: the same arithmetic
