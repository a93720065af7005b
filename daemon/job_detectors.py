"""The detectors ds3dd runs on every job, built once per job (each keeps state of its own:
clocks, step-time windows, the steps that ran out of memory before).

server.py passes `standard_detectors(...)` to the supervisors (SupervisorContext.detectors),
so a new fault needs a new detector here, not a change to the supervisor's loop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from ds3d.trainer.kinds import EventKind
from ds3d.trainer.oom import CgroupMemory

from .detectors import AgentExitDetector, Detector, HangDetector, StartupDetector
from .extension_cache import cache_roots, job_extensions_dir
from .load_failures import UnloadableCheckpoints
from .oom import OomDetector
from .step_analysis import StepAnalysis
from .store import Store


class DetectorFactory(Protocol):
    """Builds the detectors of one job, checked in order on every tick; `analysis` is the
    job's step-time analysis, which the supervisor also exports and the service reads."""

    def __call__(self, job: str, store: Store, analysis: StepAnalysis) -> list[Detector]: ...


def standard_detectors(hang_min_timeout_s: float, start_timeout_s: float) -> DetectorFactory:
    """Hang (`--hang-timeout`), start-up (`--start-timeout`), unloadable checkpoints, OOM,
    agent exit, stragglers."""

    def build(job: str, store: Store, analysis: StepAnalysis) -> list[Detector]:
        # OOM and an unloadable checkpoint before agent exit: a worker that ran out of memory
        # or could not load also ends its agent (once the budget is spent), and the diagnosis
        # (with its own policy) must win over the generic "agent exited"
        return [
            HangDetector(min_timeout_s=hang_min_timeout_s, startup_s=start_timeout_s),
            StartupDetector(start_timeout_s, lambda j: [
                job_extensions_dir(Path(j.run_dir)),
                *cache_roots(os.environ.get("TORCH_EXTENSIONS_DIR"))]),
            UnloadableCheckpoints(store, job), oom_detector(job, store), AgentExitDetector(),
            analysis]

    return build


def oom_detector(job: str, store: Store) -> OomDetector:
    """Remembers the steps that ran out of memory before (a daemon restart keeps the
    once-then-fail policy) and watches this daemon's memory cgroup for OOM kills."""
    before = [e.detail.get("step", e.step) for e in store.events(job=job, kinds=[EventKind.OOM])]
    return OomDetector(before, CgroupMemory.of_self())
