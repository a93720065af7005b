"""Who supervises a multi-node job whose rendezvous lives in etcd: the holder of the job's
etcd lease, not a fixed head node (issue 23).

A job started with `launch.rendezvous = "etcd://..."` on more than one node has two keys under
`/ds3d/jobs/<name>-<id12>/` (the prefix of its torch elastic run ids):

* `leader`: the lease (daemon/leadership.py, a TTL key renewed by compare-and-swap). The head
  daemon takes it when it starts supervising; while it holds it, it supervises.
* `record`: what a successor needs to continue where the leader stopped (a `JobRecord`: the
  configuration, job id, state, desired state, restarts, newest step and checkpoint, and the
  events so far). Only the leader writes it, and every write is a compare-and-swap on the
  record's own index: a successor's first write moves the index, so a deposed leader's next
  write is refused by etcd itself (fencing), even one sent after a SIGSTOP between its check of
  the lease and the write.

The other nodes' daemons watch the lease of each job they run a share of (daemon/takeover.py):
when it has expired, one of them takes it (etcd's create-if-absent picks one winner) and leads
the job from there; the old leader, if it comes back, finds the lease held by another and
follows (its API forwards the job's calls to the new leader).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ds3d.trainer.kinds import EventKind

from .leadership import LeaderLease
from .logging import get_logger
from .rendezvous import etcd_problem
from .states import TERMINAL, JobState
from .store import Job, Store

LEASE_TTL_S = 6             # a dead leader's job waits at most this long for a successor
REFRESH_RECORD_S = 5.0      # the record's step is refreshed this often (state changes at once)
EVENTS_KEPT = 500           # newest events carried in the record (their stacks left out)
# the event kinds carried in the record: all but the per-step ones (the metrics keep those)
RECORDED_KINDS = tuple(k for k in EventKind if k is not EventKind.STEP)

log = get_logger("ds3d.leadership")


def job_key(name: str, job_id: str) -> str:
    """The job's etcd folder: the prefix of its torch elastic run ids (rendezvous_run_id)."""
    return f"/ds3d/jobs/{name}-{job_id[:12]}"


def job_key_of_run_id(run_id: str) -> str:
    """The same folder from a run id `<name>-<id12>-a<attempt>` (what a share node is told)."""
    return f"/ds3d/jobs/{run_id[:run_id.rindex('-a')]}"


def attempt_of_run_id(run_id: str) -> int:
    return int(run_id[run_id.rindex("-a") + 2:])


class FailoverClient:
    """python-etcd's client on the first member of the cluster that answers, moved to the next
    answering member when a call cannot reach its member (a dead node's etcd goes with it)."""

    def __init__(self, endpoints: list[tuple[str, int]], read_timeout_s: float = 2.0) -> None:
        self.endpoints = endpoints
        self.read_timeout_s = read_timeout_s
        self._client: Any = None

    def _connect(self) -> Any:
        import etcd

        for host, port in self.endpoints:
            if etcd_problem(host, port, timeout_s=1.0) is None:
                self._client = etcd.Client(host=host, port=port, read_timeout=self.read_timeout_s)
                return self._client
        raise etcd.EtcdConnectionFailed("no etcd member of launch.rendezvous answers")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import etcd

        for attempt in range(2):
            client = self._client or self._connect()
            try:
                return getattr(client, method)(*args, **kwargs)
            except etcd.EtcdConnectionFailed:
                self._client = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def read(self, key: str, **kwargs: Any) -> Any:
        return self._call("read", key, **kwargs)

    def write(self, key: str, value: str, **kwargs: Any) -> Any:
        return self._call("write", key, value, **kwargs)

    def delete(self, key: str, **kwargs: Any) -> Any:
        return self._call("delete", key, **kwargs)


@dataclass
class JobRecord:
    """What the leader publishes and a successor starts from. `token` is the lease token of
    the leader that wrote it (larger for every later leader); `step_at` is when the leader saw
    step `step` (a successor's time to detect counts from it)."""

    name: str
    job_id: str
    config_json: str
    leader: str
    token: int
    state: str
    desired_state: str
    restarts: int
    step: int
    step_at: float
    last_ckpt_step: int
    attempt: int = 0  # the newest launch: a successor's first is the next (a new run id)
    events: list[dict[str, Any]] = field(default_factory=list)
    # the restart budget's count (daemon/policies.py), so that a crash loop does not start
    # over with each new leader
    restarts_in_a_row: int = 0
    progress_mark: int = -1

    @property
    def live(self) -> bool:
        return JobState[self.state] not in TERMINAL and \
            JobState[self.desired_state] not in TERMINAL

    def dump(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def parse(cls, text: str) -> JobRecord:
        """A record of this daemon's version, or of an older or newer one (fields this one
        does not know are left out; those it has and the record lacks take their defaults)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


def read_record(client: Any, key: str) -> tuple[JobRecord | None, int]:
    """The job's record and its modifiedIndex (None, 0 when there is none). A quorum read: etcd
    v2 otherwise answers from the member's own copy, which may lag the leader's."""
    import etcd

    try:
        r = client.read(f"{key}/record", quorum=True)
    except etcd.EtcdKeyNotFound:
        return None, 0
    return JobRecord.parse(r.value), int(r.modifiedIndex)


def lease_holder(client: Any, key: str) -> str:
    """Who holds the job's lease now ("" when nobody does)."""
    import etcd

    try:
        return str(client.read(f"{key}/leader", quorum=True).value)
    except etcd.EtcdKeyNotFound:
        return ""


class Leadership:
    """The lease and the record of one job, as its (would-be) leader holds them."""

    def __init__(self, client: Any, key: str, holder: str, ttl_s: int = LEASE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.key, self.holder = client, key, holder
        self.lease = LeaderLease(client, f"{key}/leader", holder, ttl_s, clock)
        self.clock = clock
        self._lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._stop_renewing = threading.Event()
        self._record_index = 0          # modifiedIndex of our last record write (0: none yet)
        self._published: tuple[Any, ...] | None = None
        self._published_at = 0.0
        self._events: list[dict[str, Any]] = []
        self._event_seq = 0
        self.deposed_by = ""  # the leader whose record write refused ours
        self._last_token = 0

    def hold(self) -> bool:
        """Takes the lease if this daemon holds no term; True while it may act for the job.
        Renewal is not the caller's: a thread renews every TTL/4 from the moment the lease
        is won, so that a long supervisor tick (a launch that waits 30 s on a frozen node)
        cannot let the lease lapse under a live leader."""
        with self._lock:
            if not self.lease.is_leader() and self.lease.acquire():
                assert self.lease.term is not None
                self._last_token = self.lease.term.token
                log.info("leader", key=self.key, token=self._last_token)
                if self._renewer is None or not self._renewer.is_alive():
                    self._stop_renewing.clear()
                    self._renewer = threading.Thread(target=self._renew, daemon=True,
                                                     name=f"lease-{self.key}")
                    self._renewer.start()
            return self.lease.is_leader()

    def _renew(self) -> None:
        while not self._stop_renewing.wait(self.lease.renew_every_s):
            with self._lock:
                if self.lease.term is not None:
                    self.lease.renew()

    def token(self) -> int:
        """The fencing token of the newest term this daemon held (0: none yet), carried by its
        calls to the other nodes, which refuse a token lower than one they saw: kept after the
        term ran out, so that a late call of a deposed leader is refused, not unfenced."""
        return self._last_token

    def holder_now(self) -> str:
        """Who holds the lease by etcd's record ("" when nobody does or etcd cannot say)."""
        import etcd

        try:
            return lease_holder(self.client, self.key)
        except etcd.EtcdException:
            return ""

    def record(self) -> JobRecord | None:
        """The job's record as etcd has it now (None: none yet, or etcd cannot say)."""
        import etcd

        try:
            return read_record(self.client, self.key)[0]
        except etcd.EtcdException:
            return None

    def adopt_events(self, events: list[dict[str, Any]]) -> None:
        """A successor carries its predecessor's events on in the record."""
        self._events = list(events)[-EVENTS_KEPT:]

    def publish(self, job: Job, store: Store, force: bool = False) -> bool:
        """Writes the record when something a successor needs changed (the step at most every
        REFRESH_RECORD_S). False when etcd refused it because another leader wrote since: this
        daemon is deposed and must stop acting."""
        import etcd

        for ev in store.events(job=job.name, after_seq=self._event_seq, kinds=RECORDED_KINDS,
                               limit=10_000):
            self._event_seq = ev.seq
            row = {k: v for k, v in asdict(ev).items() if k not in ("seq", "job")}
            row["detail"] = {k: v for k, v in ev.detail.items()
                             if k not in ("stacks", "unanswered")}
            self._events.append(row)
            self._published = None
        self._events = self._events[-EVENTS_KEPT:]
        if not self.lease.is_leader() or self.lease.term is None:
            return True  # not ours to write now; whether we still lead is hold()'s to say
        key = (job.state, job.desired_state, job.restarts, job.restarts_in_a_row,
               job.last_ckpt_step, job.attempt, job.config_json)
        now = self.clock()
        if not force and key == self._published and now - self._published_at < REFRESH_RECORD_S:
            return True
        record = JobRecord(job.name, job.job_id, job.config_json, self.holder,
                           self.lease.term.token, job.state.name, job.desired_state.name,
                           job.restarts, job.step, job.updated_at, job.last_ckpt_step,
                           job.attempt, self._events, job.restarts_in_a_row, job.progress_mark)
        try:
            if not self._record_index:
                self._record_index = self._first_index()
            kwargs = {"prevIndex": self._record_index} if self._record_index > 0 else \
                {"prevExist": False}
            r = self.client.write(f"{self.key}/record", record.dump(), **kwargs)
        except (etcd.EtcdCompareFailed, etcd.EtcdAlreadyExist, etcd.EtcdKeyNotFound):
            return self._after_refusal()
        except etcd.EtcdException:
            return True  # etcd unreachable: the lease will say whether we still lead
        self._record_index = int(r.modifiedIndex)
        self._published, self._published_at = key, now
        return True

    def _first_index(self) -> int:
        """Where our first write goes: over the record as it is now (a successor's), or
        creating it (-1)."""
        _, index = read_record(self.client, self.key)
        return index or -1

    def _after_refusal(self) -> bool:
        """Our compare-and-swap lost: if the record is our own (a write whose answer we missed)
        we go on from it; otherwise another leader wrote it and we are deposed."""
        record, index = read_record(self.client, self.key)
        term = self.lease.term
        if record is not None and term is not None and record.token == term.token:
            self._record_index = index
            return True
        with self._lock:
            self.lease.term = None
        self.deposed_by = record.leader if record else ""
        log.warning("deposed", key=self.key, by=self.deposed_by)
        return False

    def release(self) -> None:
        """Stops renewing and gives the lease up if it is still ours (a job that ended, or a
        daemon that follows now)."""
        self._stop_renewing.set()
        with self._lock:
            self.lease.release()
