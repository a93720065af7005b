"""Out-of-memory: the worker's evidence (what it caught, what it parsed), the daemon's sentence
and its adapted fix, the once-then-fail policy, and the cgroup OOM-kill reader (on a fake
cgroup directory: a real kernel OOM kill is not provoked on a shared machine)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from ds3d.daemon.oom import OomDetector, diagnose, fixes
from ds3d.daemon.reports import Observation
from ds3d.daemon.states import JobState
from ds3d.trainer.config import build_job_config
from ds3d.trainer.oom import CgroupMemory, is_oom, oom_evidence, requested_bytes

GiB = 2**30


def evidence(**over) -> dict:
    ev = {"step": 3, "phase": "step", "stage": 1, "pp": 2, "tp": 1, "dp": 1, "zero_stage": 1,
          "micro_batch_size": 8, "seq_len": 2048, "n_layers": 24, "n_heads": 16,
          "activation_checkpoint_interval": 0, "requested_bytes": GiB // 2,
          "peak_bytes": int(5.8 * GiB), "peak_kind": "allocated on the GPU",
          "limit_bytes": 6 * GiB, "limit_kind": "GPU memory"}
    ev.update(over)
    return ev


# ---- the sentence -----------------------------------------------------------------------------


def test_message_names_rank_stage_step_numbers_and_fix():
    assert diagnose(1, evidence()) == (
        "rank 1 (stage 1) ran out of memory at step 3 (tried to allocate 0.5 GiB, peak 5.8 GiB "
        "allocated on the GPU of a 6.0 GiB GPU memory limit, micro-batch 8 x 2048 tokens, "
        "activation checkpointing off): lower train.micro_batch_size (now 8), set "
        "parallel.activation_checkpoint_interval = 1, or add pipeline stages (parallel.pp, "
        "now 2)")


def test_fix_adapts_to_what_is_already_set():
    # checkpointing already every layer: not suggested again
    f = fixes(evidence(activation_checkpoint_interval=1))
    assert not any("activation_checkpoint" in x for x in f)
    # every 4 layers: tighten it
    assert "lower parallel.activation_checkpoint_interval to 1 (now 4)" in fixes(
        evidence(activation_checkpoint_interval=4))
    # micro-batch 1 cannot be lowered: shorter sequences instead
    f = fixes(evidence(micro_batch_size=1))
    assert not any("micro_batch_size" in x for x in f)
    assert "shorten model.seq_len (now 2048; the micro-batch is already 1)" in f
    # one layer per stage: more stages impossible, more tensor-parallel ranks instead
    f = fixes(evidence(pp=24))
    assert not any("parallel.pp" in x for x in f)
    assert "add tensor-parallel ranks (parallel.tp, now 1)" in f
    # a process limit (not the device): raising it is an option, a GPU's memory is not
    assert "raise the RLIMIT_AS limit (5.5 GiB)" in fixes(
        evidence(limit_kind="RLIMIT_AS", limit_bytes=int(5.5 * GiB)))
    assert not any("raise" in x for x in fixes(evidence()))


def test_fix_at_build_is_about_weights_not_activations():
    ev = evidence(step=None, phase="build", dp=4, zero_stage=0, requested_bytes=None)
    msg = diagnose(0, ev)
    assert msg.startswith("rank 0 (stage 1) ran out of memory while building the engine (")
    assert "micro_batch_size" not in msg and "activation_checkpoint" not in msg
    assert "add pipeline stages (parallel.pp, now 2)" in msg
    assert "shard the optimizer state over the data-parallel ranks (parallel.zero_stage = 1)" \
        in msg


def test_message_under_an_address_space_limit_shows_virtual_peak_and_other_ranks():
    ev = evidence(limit_kind="RLIMIT_AS", limit_bytes=int(5.5 * GiB), peak_bytes=int(3.5 * GiB),
                  peak_kind="resident", peak_virtual_bytes=5 * GiB)
    msg = diagnose(1, ev, also=[3])
    assert msg.startswith("rank 1 (stage 1) and rank 3 ran out of memory at step 3 (")
    assert "peak 5.0 GiB virtual (3.5 GiB resident) of a 5.5 GiB RLIMIT_AS limit" in msg


# ---- the worker's evidence -------------------------------------------------------------------


def test_allocator_failures_are_recognised_and_sizes_parsed():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                       "can't allocate memory: you tried to allocate 8589934592 bytes. Error "
                       "code 12 (Cannot allocate memory)")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                  "total capacity of 139.81 GiB of which 1.2 GiB is free.")
    assert is_oom(cpu) and is_oom(cuda) and is_oom(MemoryError())
    assert not is_oom(RuntimeError("Expected all tensors to be on the same device"))
    assert not is_oom(ValueError("out of memory"))  # not an allocator's error type
    assert requested_bytes(str(cpu)) == 8589934592
    assert requested_bytes(str(cuda)) == 2 * GiB
    assert requested_bytes("MemoryError") is None


def test_a_real_cpu_oom_under_rlimit_as_gives_the_evidence():
    """A real allocation failure in this process, under a temporary address-space limit."""
    cfg = build_job_config("tiny", ["train.micro_batch_size=4", "train.global_batch_size=8"])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = 64 * 2**40  # far above what this process uses, far below the request
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        try:
            torch.empty(128 * 2**40, dtype=torch.uint8)
        except RuntimeError as e:
            assert is_oom(e)
            ev = oom_evidence(e, cfg, torch.device("cpu"), last_step=6)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert ev["error"].startswith("DefaultCPUAllocator: can't allocate memory")
    assert ev["requested_bytes"] == 128 * 2**40
    assert ev["limit_bytes"] <= limit  # RLIMIT_AS, or a tighter cgroup limit of the host
    assert ev["step"] == 7 and ev["phase"] == "train" and ev["stage"] is None
    assert ev["micro_batch_size"] == 4 and ev["seq_len"] == 64
    assert ev["peak_bytes"] > 0
    if ev["limit_kind"] == "RLIMIT_AS":
        assert ev["peak_virtual_bytes"] > 0


# ---- the policy ------------------------------------------------------------------------------


class _Job:
    def __init__(self, step=0, state=JobState.RUNNING, cfg=None):
        self.step, self.state, self.attempt, self.run_dir = step, state, 1, "/nonexistent"
        self.config_json = (cfg or build_job_config("tiny")).dump_json()


def oom_record(rank=1, step=3, run_id="j-a1", restart=0, t=1.0) -> dict:
    return {"kind": "fault", "cause": "oom", "rank": rank, "restart": restart, "time": t,
            "run_id": run_id, **evidence(step=step)}


def test_first_oom_restarts_a_repeat_at_the_same_step_fails():
    det = OomDetector()
    f = det.check(_Job(), Observation([oom_record(), oom_record(rank=3, t=1.1)]), None)
    assert f.kind == "oom" and f.cause == "oom" and f.restart and not f.fatal
    assert f.rank == 1 and f.step == 3
    assert f.message.startswith("rank 1 (stage 1) and rank 3 ran out of memory at step 3")
    assert f.message.endswith("restarting once from the newest checkpoint (a second "
                              "out-of-memory at this step fails the job)")
    # a late record of the same group incarnation is not a second incident
    assert det.check(_Job(), Observation([oom_record(rank=2, t=1.2)]), None) is None
    # the relaunched group runs out at the same step: deterministic
    f = det.check(_Job(), Observation([oom_record(run_id="j-a2")]), None)
    assert f.fatal and not f.restart
    assert "it also ran out of memory at step 3 before the last restart" in f.message


def test_oom_at_a_later_step_restarts_again_and_memory_survives_a_daemon_restart():
    det = OomDetector()
    assert det.check(_Job(), Observation([oom_record(step=3)]), None).restart
    assert det.check(_Job(), Observation([oom_record(step=9, run_id="j-a2")]), None).restart
    # a new daemon seeds the steps from the stored `oom` events
    det = OomDetector(oom_steps=[3, 9])
    assert det.check(_Job(), Observation([oom_record(step=9, run_id="j-a3")]), None).fatal


# ---- the kernel's OOM killer -----------------------------------------------------------------


def fake_cgroup(tmp_path: Path, version: int, kills: int) -> CgroupMemory:
    if version == 2:
        (tmp_path / "memory.max").write_text(f"{8 * GiB}\n")
        (tmp_path / "memory.peak").write_text(f"{8 * GiB - 4096}\n")
        (tmp_path / "memory.events").write_text(
            f"low 0\nhigh 0\nmax 12\noom {kills}\noom_kill {kills}\noom_group_kill 0\n")
    else:
        (tmp_path / "memory.limit_in_bytes").write_text(f"{8 * GiB}\n")
        (tmp_path / "memory.max_usage_in_bytes").write_text(f"{8 * GiB - 4096}\n")
        (tmp_path / "memory.oom_control").write_text(
            f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
    return CgroupMemory(tmp_path, version)


@pytest.mark.parametrize("version", [2, 1])
def test_cgroup_reader(tmp_path, version):
    cg = fake_cgroup(tmp_path, version, kills=2)
    assert (cg.limit(), cg.peak(), cg.oom_kills()) == (8 * GiB, 8 * GiB - 4096, 2)
    unlimited = "max\n" if version == 2 else "9223372036854771712\n"
    (tmp_path / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(unlimited)
    assert cg.limit() is None
    assert CgroupMemory(tmp_path / "absent", version).oom_kills() is None


@pytest.mark.parametrize("version", [2, 1])
def test_kernel_oom_kill_is_attributed_to_the_worker_death(tmp_path, version):
    cg = fake_cgroup(tmp_path, version, kills=0)
    det = OomDetector(cgroup=cg)
    job = _Job(step=6)
    assert det.check(job, Observation(), None) is None  # nothing happened
    fake_cgroup(tmp_path, version, kills=1)               # the kernel killed a process
    assert det.check(job, Observation(), None) is None    # no worker died (yet): not ours
    # the agent restarted the group (a rank-0 start with restart > 0): a diagnosis, the agent
    # already restarted it, so the daemon does not restart again
    restart = {"kind": "start", "rank": 0, "restart": 1, "time": 2.0}
    f = det.check(job, Observation([restart]), None)
    assert f is not None and f.kind == "oom" and not f.restart and not f.fatal
    assert f.message.startswith("the kernel's OOM killer probably ended a worker at step 7 "
                                "(the daemon's memory cgroup counted 1 OOM kill, limit 8.0 GiB, "
                                "peak 8.0 GiB, micro-batch 2 x 64 tokens): host memory ran out; "
                                "lower train.micro_batch_size (now 2)")
    assert "raise the cgroup's memory limit" in f.message
    assert f.detail["oom_kills"] == 1 and f.detail["source"] == "cgroup"
    # a worker death without a new kill is not an OOM
    assert det.check(job, Observation([{**restart, "restart": 2}]), None) is None


def test_kernel_oom_kill_with_the_agent_gone_restarts_then_fails(tmp_path):
    cg = fake_cgroup(tmp_path, 2, kills=0)
    det = OomDetector(cgroup=cg)
    fake_cgroup(tmp_path, 2, kills=1)
    f = det.check(_Job(step=6), Observation(), agent_exit=1)
    assert f.restart and f.step == 7
    fake_cgroup(tmp_path, 2, kills=2)
    f = det.check(_Job(step=6), Observation(), agent_exit=1)
    assert f.fatal and "before the last restart" in f.message


def test_a_reported_oom_is_not_counted_again_as_a_kernel_kill(tmp_path):
    cg = fake_cgroup(tmp_path, 2, kills=0)
    det = OomDetector(cgroup=cg)
    fake_cgroup(tmp_path, 2, kills=1)
    f = det.check(_Job(step=2), Observation([oom_record(step=3)]), agent_exit=1)
    assert f.restart and f.message.startswith("rank 1 (stage 1) ran out of memory at step 3")
    assert det.oom_steps == {3}  # one incident, one entry in the once-then-fail policy
    assert det.check(_Job(step=2), Observation(), agent_exit=1) is None
