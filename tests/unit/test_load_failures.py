"""Checkpoints that verify but cannot be loaded: which load errors are the checkpoint's
(trainer/load_failure.py), the daemon's detector (daemon/load_failures.py) that turns a step
failing in two worker groups into a rollback past it, or a pause when the rollback's own target
failed too, and the drill's writer bug (a key the layer lacks) against a real strict load."""

from __future__ import annotations

import io

import pytest
import torch

from ds3d.daemon.load_failures import CAUSE, UnloadableCheckpoints
from ds3d.daemon.reports import Observation, record_to_event
from ds3d.trainer.faults import UNKNOWN_KEY, _add_unknown_key
from ds3d.trainer.kinds import EventKind
from ds3d.trainer.load_failure import brief, checkpoint_at_fault


def obs(*records):
    o = Observation()
    o.records = list(records)
    return o


def failed(step, restart, rank=0, detail="RuntimeError: Unexpected key(s) in state_dict"):
    return {"kind": "checkpoint", "phase": "load_failed", "step": step, "rank": rank,
            "restart": restart, "source": "local", "detail": detail}


def test_a_step_that_fails_in_two_groups_is_rolled_back_past(job_store):
    d = UnloadableCheckpoints(job_store, "j")
    job = job_store.get_job("j")
    # every rank of one group, and the same group's record read again: one group
    assert d.check(job, obs(failed(8, 1), failed(8, 1, rank=1)), None) is None
    assert d.check(job, obs(failed(8, 1)), None) is None
    f = d.check(job, obs(failed(8, 2)), None)
    assert f is not None and f.cause == CAUSE and f.roll_back_before == 8 and f.step == 8
    assert not f.restart and "rolled_back_from" not in f.detail
    assert f.message.startswith("checkpoint step 8 could not be loaded by 2 worker groups "
                                "(its files verified): rank 0: RuntimeError: Unexpected key")
    # counted again from nothing: a resumed job that fails once more is not rolled back at once
    assert d.check(job, obs(failed(8, 3)), None) is None


def test_the_target_of_a_rollback_failing_too_is_said(job_store):
    """The supervisor stores the fault with `rollback_to`; when that step fails in two groups
    as well, the detector says which rollback chose it (the supervisor then pauses)."""
    job_store.record("j", EventKind.FAULT, "step 8 unloadable", cause=CAUSE, step=8,
                     detail={"unloadable_step": 8, "rollback_to": 6})
    d = UnloadableCheckpoints(job_store, "j")  # a new daemon: read from the store
    job = job_store.get_job("j")
    d.check(job, obs(failed(6, 0)), None)
    f = d.check(job, obs(failed(6, 1)), None)
    assert f is not None and f.detail["rolled_back_from"] == 8, f
    assert "the checkpoint the job rolled back to after step 8 could not be loaded" in f.message
    assert d.rolled_back_here(4) is None


def test_the_newest_twice_failed_step_comes_first(job_store):
    d = UnloadableCheckpoints(job_store, "j")
    job = job_store.get_job("j")
    d.check(job, obs(failed(4, 0), failed(8, 0)), None)
    f = d.check(job, obs(failed(4, 1), failed(8, 1)), None)
    assert f is not None and f.roll_back_before == 8


def test_a_conversion_the_converter_refuses_pauses_rather_than_rolls_back(job_store):
    """A checkpoint DeepSpeed's converter refuses after a layout change (engine_io: cause
    `reshape`): the fault carries the change, for the supervisor to pause (an older checkpoint
    needs the same conversion) instead of rolling back past it."""
    d = UnloadableCheckpoints(job_store, "j")
    job = job_store.get_job("j")
    rec = {**failed(8, 0, detail="AssertionError: Unused patterns=['x']"), "cause": "reshape",
           "reshape": "(tp,pp,dp) 1,1,2 -> 1,1,1"}
    assert d.check(job, obs(rec), None) is None
    f = d.check(job, obs({**rec, "restart": 1}), None)
    assert f is not None and f.detail["reshape"] == "(tp,pp,dp) 1,1,2 -> 1,1,1", f
    assert f.message == ("checkpoint step 8 could not be converted to this layout ((tp,pp,dp) "
                         "1,1,2 -> 1,1,1) by 2 worker groups: rank 0: AssertionError: Unused "
                         "patterns=['x']")
    ev = record_to_event({**rec, "time": 1.0})
    assert ev["cause"] == "reshape" and ev["message"] == (
        "checkpoint step 8 could not be converted to this layout ((tp,pp,dp) 1,1,2 -> 1,1,1) by "
        "DeepSpeed's ds_to_universal: AssertionError: Unused patterns=['x']")


def test_a_conversion_failure_of_the_moment_is_not_the_checkpoints():
    from ds3d.checkpoints.reshape import converter_at_fault

    refused = "Traceback ...\nAssertionError: Unused patterns=['x'] while merging tp slices"
    assert converter_at_fault(1, refused)
    assert not converter_at_fault(-9, "")  # the kernel's OOM killer
    assert not converter_at_fault(1, "Traceback ...\nMemoryError")
    assert not converter_at_fault(1, "OSError: [Errno 28] No space left on device: 'x.pt'")


def test_the_event_of_a_failed_load_says_what_and_where():
    ev = record_to_event({**failed(8, 1), "time": 1.0})
    assert ev["cause"] == "load_failed" and ev["step"] == 8
    assert ev["message"] == ("checkpoint step 8 could not be loaded (its files verified): "
                             "RuntimeError: Unexpected key(s) in state_dict")


def test_only_the_checkpoints_own_errors_are_reported():
    assert checkpoint_at_fault(RuntimeError('Error(s) in loading state_dict for Layer:\n\t'
                                            'Unexpected key(s) in state_dict: "x".'))
    assert checkpoint_at_fault(KeyError("optimizer_state_dict"))
    lost_peer = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                             "closed by peer [127.0.0.1]:50864")
    assert not checkpoint_at_fault(lost_peer)
    assert not checkpoint_at_fault(torch.distributed.DistBackendError("NCCL error"))
    assert not checkpoint_at_fault(torch.OutOfMemoryError("CUDA out of memory."))
    assert not checkpoint_at_fault(RuntimeError("DefaultCPUAllocator: can't allocate memory: "
                                                "you tried to allocate 8 bytes"))
    # the disk at that moment, not the bytes that verified just before; but a file the load
    # looks for that the checkpoint lacks is the checkpoint's
    assert not checkpoint_at_fault(OSError(5, "Input/output error"))
    assert checkpoint_at_fault(FileNotFoundError(2, "No such file", "layer_03-model_00.pt"))
    assert brief(RuntimeError("a\n\n\tb  c")) == "RuntimeError: a b c"
    assert len(brief(ValueError("x" * 2000))) == 500


def test_the_drills_writer_bug_verifies_and_fails_a_strict_load():
    """The UNLOADABLE fault's hook: the bytes saved are whatever they are (a hash of them
    verifies), and torch's strict load of them refuses the key."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    _add_unknown_key(model)
    buf = io.BytesIO()
    torch.save(model[0].state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()))
    assert UNKNOWN_KEY in state
    with pytest.raises(RuntimeError, match="Unexpected key") as e:
        torch.nn.Linear(2, 2).load_state_dict(state, strict=True)
    assert checkpoint_at_fault(e.value)
