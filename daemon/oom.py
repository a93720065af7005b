"""Out-of-memory: one event that names the rank, the numbers and the fix, and a recovery that
does not spend the restart budget on a failure that will repeat.

Two ways a worker runs out of memory:
* an allocation fails (CUDA OOM, the CPU allocator under a process limit): the worker writes a
  `fault` record with cause `oom` and its evidence (trainer/oom.py) and exits;
* the kernel's OOM killer SIGKILLs it: nothing is written. The daemon notices the `oom_kill`
  counter of its own memory cgroup (cgroup v2 memory.events, v1 memory.oom_control; the workers
  live in the daemon's cgroup, e.g. ds3dd.service) grow around the time a worker group died.
  That is circumstantial (another process of the cgroup may have been the victim), so the
  event says "probably"; it is unit-tested against a fake cgroup directory only.

Policy: an OOM is restarted once from the newest checkpoint (it may have been transient:
fragmentation, another process on the device, a leak). An OOM at a step that already ran out of
memory before is deterministic: the job fails with the diagnosis as its reason instead of
burning the rest of the budget. Restarts are counted under the cause `oom`.
"""

from __future__ import annotations

import time
from typing import Any

from ds3d.trainer.config import JobConfig
from ds3d.trainer.kinds import EventKind, RecordKind
from ds3d.trainer.oom import CgroupMemory, memory_knobs

from .detectors import Fault, agent_error
from .reports import Observation
from .states import JobState
from .store import Job

KILL_WINDOW_S = 120.0  # an OOM kill explains a worker death seen this long after it


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f", or {items[-1]}"


def fixes(ev: dict[str, Any]) -> list[str]:
    """What to change, adapted to the evidence: where it failed (activations during a step,
    weights and optimizer state at build/load) and what is already set."""
    phase = ev.get("phase", "step")
    mb, ac = int(ev.get("micro_batch_size", 1)), int(ev.get("activation_checkpoint_interval", 0))
    pp, tp, layers = int(ev.get("pp", 1)), int(ev.get("tp", 1)), int(ev.get("n_layers", 0))
    out: list[str] = []
    if phase in ("step", "train", "kernel"):  # activations grow with micro-batch x sequence
        if mb > 1:
            out.append(f"lower train.micro_batch_size (now {mb})")
        else:
            out.append(f"shorten model.seq_len (now {ev.get('seq_len')}; the micro-batch is "
                       f"already 1)")
        if ac == 0:
            out.append("set parallel.activation_checkpoint_interval = 1")
        elif ac > 1:
            out.append(f"lower parallel.activation_checkpoint_interval to 1 (now {ac})")
    if phase == "checkpoint save":
        out.append("give the host memory for the checkpoint snapshot (a copy of this rank's "
                   "weights and optimizer state)")
    if not layers or pp < layers:  # each stage holds fewer layers, their weights and activations
        out.append(f"add pipeline stages (parallel.pp, now {pp})")
    elif tp < int(ev.get("n_heads", tp + 1)):
        out.append(f"add tensor-parallel ranks (parallel.tp, now {tp})")
    if phase in ("build", "checkpoint load") and int(ev.get("dp", 1)) > 1 and \
            int(ev.get("zero_stage", 1)) == 0:
        out.append("shard the optimizer state over the data-parallel ranks "
                   "(parallel.zero_stage = 1)")
    if ev.get("limit_kind") and ev.get("limit_kind") != "GPU memory" and ev.get("limit_bytes"):
        out.append(f"raise the {ev['limit_kind']} limit ({_gib(ev['limit_bytes'])})")
    return out


def diagnose(rank: int, ev: dict[str, Any], also: list[int] | None = None) -> str:
    """One sentence from a worker's `oom` evidence: who, when, the numbers, the fix."""
    stage = ev.get("stage")
    who = f"rank {rank}" + (f" (stage {stage})" if stage is not None else "")
    if also:
        who += f" and rank{'s' if len(also) > 1 else ''} {', '.join(map(str, also))}"
    step = ev.get("step")
    phase = ev.get("phase", "step")
    when = "while building the engine" if step is None else f"at step {step}" + (
        "" if phase in ("step", "train") else f" ({phase})")
    numbers = []
    if ev.get("requested_bytes"):
        numbers.append(f"tried to allocate {_gib(ev['requested_bytes'])}")
    if ev.get("peak_virtual_bytes") and ev.get("limit_kind") == "RLIMIT_AS":
        numbers.append(f"peak {_gib(ev['peak_virtual_bytes'])} virtual "
                       f"({_gib(ev.get('peak_bytes') or 0)} resident)")
    elif ev.get("peak_bytes"):
        numbers.append(f"peak {_gib(ev['peak_bytes'])} {ev.get('peak_kind', '')}".rstrip())
    if ev.get("limit_bytes"):
        numbers[-1:] = [f"{numbers[-1]} of a {_gib(ev['limit_bytes'])} "
                        f"{ev.get('limit_kind', '')} limit".rstrip()] if numbers else \
            [f"limit {_gib(ev['limit_bytes'])}"]
    ac = int(ev.get("activation_checkpoint_interval", 0))
    numbers.append(f"micro-batch {ev.get('micro_batch_size')} x {ev.get('seq_len')} tokens")
    numbers.append("activation checkpointing " + (f"every {ac} layer{'s' if ac > 1 else ''}"
                                                  if ac else "off"))
    return (f"{who} ran out of memory {when} ({', '.join(numbers)}): "
            f"{_join(fixes(ev))}")


def config_evidence(cfg: JobConfig) -> dict[str, Any]:
    """The knobs of a job, for an OOM the worker could not report (a kernel OOM kill)."""
    return {**memory_knobs(cfg), "phase": "kernel"}


class OomDetector:
    """Detector (supervisor protocol) for both kinds of OOM, and the once-then-fail policy.

    `oom_steps`: steps that ran out of memory before (from the stored `oom` events, so the
    policy survives a daemon restart). `cgroup`: the daemon's memory cgroup (None: no kernel
    OOM-kill detection)."""

    def __init__(self, oom_steps: list[int | None] | None = None,
                 cgroup: CgroupMemory | None = None) -> None:
        self.oom_steps: set[int | None] = set(oom_steps or [])
        self.cgroup = cgroup
        self._kills = cgroup.oom_kills() if cgroup is not None else None
        self._kill_at: float | None = None  # monotonic time of an unexplained OOM kill
        self._incidents: set[tuple[str, int]] = set()  # (run id, elastic restart) handled

    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None:
        fault = self._worker_oom(job, obs)
        kill = self._kernel_oom(job, obs, agent_exit, explained=fault is not None)
        return fault or kill

    # -- an allocation failed: the worker reported it ----------------------------------------

    def _worker_oom(self, job: Job, obs: Observation) -> Fault | None:
        recs = [r for r in obs.kinds(RecordKind.FAULT) if r.get("cause") == "oom"]
        new = [r for r in recs if (str(r.get("run_id", "")), int(r.get("restart", 0)))
               not in self._incidents]
        if not new:
            return None
        self._incidents |= {(str(r.get("run_id", "")), int(r.get("restart", 0))) for r in new}
        first = min(new, key=lambda r: float(r.get("time", 0)))
        rank = int(first.get("rank", -1))
        also = sorted({int(r.get("rank", -1)) for r in new} - {rank})
        step = first.get("step")
        message = diagnose(rank, first, also)
        detail = {k: v for k, v in first.items() if k not in ("kind", "cause", "detail")}
        return self._decide(message, rank, step, detail)

    def _decide(self, message: str, rank: int, step: int | None,
                detail: dict[str, Any]) -> Fault:
        if step in self.oom_steps:
            where = "while building the engine" if step is None else f"at step {step}"
            return Fault("oom", f"{message}; it also ran out of memory {where} before the "
                         f"last restart, so retrying cannot help: the job fails (change the "
                         f"configuration and start a new job from its checkpoints)",
                         restart=False, fatal=True, rank=rank, step=step, detail=detail,
                         kind=EventKind.OOM)
        self.oom_steps.add(step)
        return Fault("oom", f"{message}; restarting once from the newest checkpoint (a "
                     f"second out-of-memory at this step fails the job)", restart=True,
                     rank=rank, step=step, detail=detail, kind=EventKind.OOM)

    # -- the kernel's OOM killer: nothing reported, the cgroup counted it --------------------

    def _kernel_oom(self, job: Job, obs: Observation, agent_exit: int | None,
                    explained: bool = False) -> Fault | None:
        """`explained`: a worker reported its OOM this tick; the death needs no other cause."""
        if self.cgroup is None:
            return None
        kills = self.cgroup.oom_kills()
        if kills is not None and self._kills is not None and kills > self._kills:
            self._kill_at = time.monotonic()
        self._kills = kills if kills is not None else self._kills
        if explained:
            self._kill_at = None
        if self._kill_at is None or time.monotonic() - self._kill_at > KILL_WINDOW_S:
            return None
        group_restarted = any(r.get("rank") == 0 and int(r.get("restart", 0)) > 0
                              for r in obs.kinds(RecordKind.START))
        agent_failed = agent_exit not in (None, 0) and job.state in (
            JobState.STARTING, JobState.RUNNING, JobState.RECOVERING)
        if not (group_restarted or agent_failed):
            return None
        self._kill_at = None
        ev = config_evidence(JobConfig.model_validate_json(job.config_json))
        limit, peak = self.cgroup.limit(), self.cgroup.peak()
        rank = _killed_rank(agent_error(job)) if agent_failed else -1
        who = f"rank {rank}'s worker" if rank >= 0 else "a worker"
        numbers = [f"the daemon's memory cgroup counted {kills} OOM kill"
                   f"{'s' if (kills or 0) > 1 else ''}"]
        if limit:
            numbers.append(f"limit {_gib(limit)}")
        if peak:
            numbers.append(f"peak {_gib(peak)}")
        numbers.append(f"micro-batch {ev['micro_batch_size']} x {ev['seq_len']} tokens")
        step = job.step + 1
        how = ["run fewer ranks per node (launch.nproc_per_node)",
               "raise the cgroup's memory limit (MemoryMax= of the ds3dd service)"]
        message = (f"the kernel's OOM killer probably ended {who} at step {step} "
                   f"({', '.join(numbers)}): host memory ran out; "
                   f"{_join(fixes(ev) + how)}")
        detail = {**ev, "oom_kills": kills, "limit_bytes": limit, "peak_bytes": peak,
                  "source": "cgroup"}
        fault = self._decide(message, rank, step, detail)
        if group_restarted and fault.restart:  # the agent restarted the group already
            return Fault(fault.cause, message, restart=False, rank=rank, step=step,
                         detail=detail, kind=EventKind.OOM)
        return fault


def _killed_rank(error: str) -> int:
    """The rank the agent saw die by SIGKILL ("exit codes by rank {1: -9}"), or -1."""
    import re

    m = re.search(r"(\d+): -9\b", error)
    return int(m.group(1)) if m else -1
