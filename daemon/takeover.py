"""A node that runs a share of an etcd-mode job takes the job over when its leader is gone.

Every second, for each such share, this daemon reads the job's lease and record in etcd
(daemon/job_leadership.py). Once the lease has expired (the leader died, froze or lost etcd
for longer than its TTL) and the record says the job should be training (a paused job waits
for its leader: a drained head daemon comes back to it), it tries to take the lease:
etcd's create-if-absent lets exactly one contender win. The winner

1. ends its own share of the old group (the survivors' workers may still be training in a
   group that torch elastic re-formed without the leader's node: the new group starts clean),
2. stores the job as its own: the record's configuration with this node first in
   `launch.hosts` (the old leader stays in the list, so the elastic node-back path takes it
   back as a plain node when its daemon answers again), the same job id (its checkpoints), the
   restarts so far, and the old leader's events (one `fault` event `leader_lost` after them),
3. starts supervising it: the launch starts every reachable node's share with this node's
   configuration, restore picks the newest committed checkpoint and reshapes it to the smaller
   DP, and one `recovered` event times the whole recovery from the old leader's last step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from ds3d.checkpoints.identity import write_local_job_id
from ds3d.trainer.config import JobConfig
from ds3d.trainer.kinds import EventKind

from .job_leadership import (
    FailoverClient,
    JobRecord,
    Leadership,
    attempt_of_run_id,
    job_key_of_run_id,
    lease_holder,
    read_record,
)
from .jobdir import JobDir
from .logging import get_logger
from .peers import Shares
from .states import JobState
from .store import Store

log = get_logger("ds3d.takeover")


class Standby:
    """Watches the leases of the etcd-mode jobs this node runs a share of; takes a job that
    should be training over when its lease has expired (a paused job waits for its leader)."""

    def __init__(self, store: Store, shares: Shares, jobs_root: Path, node: str,
                 adopt: Callable[[str, Leadership, JobRecord, float], None],
                 address: Callable[[], str], every_s: float = 1.0) -> None:
        self.store, self.shares, self.jobs_root, self.node = store, shares, jobs_root, node
        self.adopt = adopt
        self.address = address
        self.every_s = every_s
        self._clients: dict[tuple[tuple[str, int], ...], FailoverClient] = {}

    def run(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.every_s):
            for cfg, run_id in self.shares.started():
                if not cfg.launch.etcd_endpoints or not self.address():
                    continue
                try:
                    self._check(cfg, run_id)
                except Exception:  # noqa: BLE001 - one job's trouble must not stop the watch
                    log.exception("standby check failed", job=cfg.name)

    def _client(self, cfg: JobConfig) -> FailoverClient:
        endpoints = tuple(cfg.launch.etcd_endpoints)
        if endpoints not in self._clients:
            self._clients[endpoints] = FailoverClient(list(endpoints))
        return self._clients[endpoints]

    def _check(self, cfg: JobConfig, run_id: str) -> None:
        import etcd

        client = self._client(cfg)
        key = job_key_of_run_id(run_id)
        try:
            holder = lease_holder(client, key)
            if holder:
                self.shares.leader_seen(cfg.name, holder)  # where this node forwards its calls
                return
            record, _ = read_record(client, key)
        except etcd.EtcdException:
            return  # etcd unreachable from here: no decision without it
        if record is None or record.name != cfg.name:
            return
        if not record.live:
            # ended (its leader writes the terminal record, then gives the lease up): calls go
            # to the job's first host again, never "being replaced"
            self.shares.forget(cfg.name)
            return
        self.shares.leader_seen(cfg.name, "")  # a live job without a leader: being replaced
        if record.desired_state != JobState.RUNNING.name:
            return  # paused (or pausing): it waits for its leader, nothing to supervise now
        local = self.store.get_job(cfg.name) if self.store.has_job(cfg.name) else None
        if local is not None and local.job_id != record.job_id:
            log.error("cannot take the job over: a job of the same name is stored here; "
                      "it is left to its other nodes", job=cfg.name, local_id=local.job_id,
                      job_id=record.job_id)
            self.shares.forget(cfg.name)
            return
        noticed = time.time()
        leadership = Leadership(client, key, self.address())
        if not leadership.hold():
            return  # another node won
        self.shares.leader_seen(cfg.name, "")  # "being replaced" until the job is stored here
        log.warning("taking over", job=cfg.name, old_leader=record.leader, token=
                    leadership.lease.term.token if leadership.lease.term else None)
        self.shares.stop_and_wait(cfg.name)
        # the next launch needs a run id no agent used: past the record's and this node's own
        record.attempt = max(record.attempt, attempt_of_run_id(run_id))
        self._store_job(record, leadership, noticed)
        self.adopt(cfg.name, leadership, record, noticed)

    def _store_job(self, record: JobRecord, leadership: Leadership, noticed: float) -> None:
        """The job as this node's own, led from here: see the module docstring."""
        me = self.address()
        cfg = JobConfig.model_validate_json(record.config_json)
        hosts = [me, *(h for h in cfg.launch.hosts if h != me)]
        config_json = cfg.model_copy(update={"launch": cfg.launch.model_copy(
            update={"hosts": hosts})}).dump_json()
        jobdir = JobDir(self.jobs_root, record.name)
        message = (f"leader {record.leader} lost (its etcd lease expired); {me} leads the job "
                   f"now and resumes it from the newest committed checkpoint (step "
                   f"{record.last_ckpt_step})")
        if self.store.has_job(record.name):  # led from here before, then followed
            self.store.update(record.name, config_json=config_json, leader="",
                                    restarts=record.restarts,
                                    restarts_in_a_row=record.restarts_in_a_row,
                                    progress_mark=record.progress_mark, agent_pid=0,
                                    agent_started=0,
                                    attempt=max(record.attempt,
                                                self.store.get_job(record.name).attempt))
        else:
            self.store.create_job(record.name, config_json, self.node, str(jobdir.path),
                                  message="taken over", job_id=record.job_id)
            self.store.import_events(record.name, record.events)
            self.store.update(record.name, restarts=record.restarts, step=record.step,
                              last_ckpt_step=record.last_ckpt_step, attempt=record.attempt,
                              restarts_in_a_row=record.restarts_in_a_row,
                              progress_mark=record.progress_mark)
        leadership.adopt_events(record.events)
        jobdir.create(config_json)
        write_local_job_id(jobdir.path, record.job_id)
        self.store.record(record.name, EventKind.FAULT, message, cause="leader_lost",
                          step=record.step, detail={"old_leader": record.leader,
                                                    "old_token": record.token, "new_leader": me,
                                                    "noticed_at": noticed})
        job = self.store.get_job(record.name)
        if job.state is JobState.PENDING:
            self.store.transition(record.name, JobState.STARTING, "starting workers after "
                                  "taking the job over", cause="leader_lost",
                                  desired_state=JobState.RUNNING, next_launch_at=0,
                                  done_reason="")
        elif job.state in (JobState.RUNNING, JobState.STARTING):
            self.store.transition(record.name, JobState.RECOVERING, "relaunching after taking "
                                  "the job over", cause="leader_lost", next_launch_at=0,
                                  done_reason="")
