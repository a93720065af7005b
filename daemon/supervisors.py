"""The supervisor threads of one daemon: one JobSupervisor (daemon/supervisor.py) per live
job, started at the daemon's start, on a new job or a takeover, woken when an intent is
stored, and stopped (agents left running) at its shutdown."""

from __future__ import annotations

import threading

from ds3d.checkpoints.node_memory import remove_job_folder
from ds3d.trainer.errors import Ds3dError

from .job_leadership import JobRecord, Leadership
from .logging import get_logger
from .states import TERMINAL
from .step_analysis import StepAnalysis
from .supervisor import JobSupervisor, SupervisorContext


class Supervisors:
    """The supervisor threads of one daemon, one per live job."""

    def __init__(self, ctx: SupervisorContext) -> None:
        self.ctx = ctx
        self.stopping = threading.Event()
        self._sups: dict[str, JobSupervisor] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def resume_all(self) -> None:
        """Daemon start: supervise every job that is still live (reattach or restart)."""
        for job in self.ctx.store.list_jobs():
            if job.state not in TERMINAL:
                self.ensure(job.name)
            else:  # ended while this daemon was down (or before its cleanup finished)
                remove_job_folder(job.job_id)

    def ensure(self, name: str) -> None:
        with self._lock:
            t = self._threads.get(name)
            if t is not None and t.is_alive():
                return
            try:
                sup = JobSupervisor(name, self.ctx)
            except Ds3dError:
                get_logger("ds3d.supervisor", job=name).exception("cannot supervise")
                return
            t = threading.Thread(target=sup.run, args=(self.stopping,), name=f"sup-{name}",
                                 daemon=True)
            self._sups[name], self._threads[name] = sup, t
            t.start()

    def adopt(self, name: str, leadership: Leadership, record: JobRecord,
              noticed: float) -> None:
        """Supervises a job taken over from its lost leader (daemon/takeover.py), under the
        lease already won; its recovery is timed from the old leader's last step."""
        self.ctx.leaderships[name] = leadership
        with self._lock:
            self._sups.pop(name, None)
        self.ensure(name)
        sup = self._sups.get(name)
        if sup is not None:
            sup.incidents.last_step, sup.incidents.last_step_time = record.step, record.step_at
            sup.incidents.fault("leader_lost", noticed)
            sup.wake.set()

    def forward_control(self, name: str, file: str, text: str) -> None:
        """Copies a control file the service wrote on this (head) node to the job's other
        nodes, through its supervisor (which retries nodes it cannot reach)."""
        self.ensure(name)
        sup = self._sups.get(name)
        if sup is not None:
            sup.nodes.forward_control(file, text)

    def poke(self, name: str) -> None:
        """Wakes a job's supervisor now (a new intent was stored), starting one if needed."""
        self.ensure(name)
        sup = self._sups.get(name)
        if sup is not None:
            sup.wake.set()

    def analysis(self, name: str) -> StepAnalysis | None:
        """The job's step-time analysis as this daemon saw it (kept after the job ends)."""
        sup = self._sups.get(name)
        return sup.analysis if sup is not None else None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Daemon shutdown: supervision stops, the agents keep running (reattached on start)."""
        self.stopping.set()
        for sup in list(self._sups.values()):
            sup.wake.set()
        for t in list(self._threads.values()):
            t.join(timeout_s)
