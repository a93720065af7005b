"""A leader lease on an etcd v2 TTL key: at most one holder acts at any moment.

Why a lease and not a lock: a holder that stops (SIGSTOP, a partition, a dead node) cannot
release anything; its key expires after the TTL and another contender creates it anew. The
holder itself stops acting *before* the TTL can run out on the server: its deadline is counted
from the moment it sent its last successful write (which is before etcd started that key's TTL),
minus a safety margin. A renewal that fails or does not answer in time therefore never leaves
two holders acting at once, whatever the network does.

* acquire: create the key with `prevExist=false` (one winner among any number of contenders);
* renew: compare-and-swap on the key's modifiedIndex (only the holder's own, unchanged key);
* fencing token: the key's createdIndex, constant while one holder renews and larger for every
  later holder, so a store that remembers the highest token it saw can refuse a deposed writer.

Used by daemon/job_leadership.py (who supervises an etcd-mode job). Run one contender as
`python -m ds3d.daemon.leadership --endpoint H:P --key K --holder NAME`:
it prints one JSON line per change of role.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .procs import stop_on_signals

SAFETY_MARGIN = 0.25  # of the TTL: local clock rate error and scheduling delay before acting


@dataclass(frozen=True)
class Term:
    """One holder's tenure on this process's monotonic clock: it may act from `since` (when
    etcd's answer arrived) until `deadline` unless a renewal moves the deadline on. `token` is
    the fencing token."""

    token: int
    since: float
    deadline: float


class LeaderLease:
    """One contender for the key `key` (python-etcd client `client`, holder name `holder`)."""

    def __init__(self, client: Any, key: str, holder: str, ttl_s: int = 5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 2:
            raise ValueError("the lease TTL must be at least 2 s (etcd counts whole seconds)")
        self.client, self.key, self.holder, self.ttl_s, self.clock = \
            client, key, holder, ttl_s, clock
        self.term: Term | None = None
        self._index = 0  # modifiedIndex of the holder's last write: the CAS precondition

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 4

    def _valid_for(self) -> float:
        return self.ttl_s * (1 - SAFETY_MARGIN)

    def is_leader(self) -> bool:
        """True only while the current term's deadline has not passed; check before each act."""
        return self.term is not None and self.clock() < self.term.deadline

    def acquire(self) -> bool:
        """Becomes the holder if nobody holds the key; False if someone does (or etcd is
        unreachable)."""
        import etcd

        sent = self.clock()
        try:
            r = self.client.write(self.key, self.holder, ttl=self.ttl_s, prevExist=False)
        except etcd.EtcdAlreadyExist:
            return False
        except (etcd.EtcdException, OSError):
            return False
        self._index = int(r.modifiedIndex)
        self.term = Term(int(r.createdIndex), self.clock(), sent + self._valid_for())
        return True

    def renew(self) -> bool:
        """Extends the term if the key is still this holder's unchanged write; otherwise (taken
        over, expired, etcd unreachable) the term keeps its old deadline and runs out."""
        import etcd

        if self.term is None:
            return False
        sent = self.clock()
        if sent >= self.term.deadline:  # too late: the key may have expired and been taken
            self.term = None
            return False
        try:
            r = self.client.write(self.key, self.holder, ttl=self.ttl_s, prevIndex=self._index)
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            self.term = None  # someone else's key now, or none: not ours in any case
            return False
        except (etcd.EtcdException, OSError):
            return False
        self._index = int(r.modifiedIndex)
        self.term = Term(self.term.token, self.term.since, sent + self._valid_for())
        return True

    def release(self) -> None:
        """Gives the key up at once (a clean stop), only if it is still this holder's."""
        import etcd

        if self.term is not None:
            self.term = None
            try:
                self.client.delete(self.key, prevIndex=self._index)
            except (etcd.EtcdException, OSError):
                pass  # not ours any more, or unreachable: it expires by itself


def contend(lease: LeaderLease, emit: Callable[[dict[str, Any]], None],
            should_stop: Callable[[], bool], poll_s: float | None = None) -> None:
    """Holds or waits for the lease until `should_stop()`; reports each change of role on the
    monotonic clock: `leader` with its token and `since`, `follower` with `until`, the end of the
    term it left (its last deadline, or the moment a renewal was refused, whichever came
    first), so that tenures of different processes on one machine can be compared."""
    poll = poll_s if poll_s is not None else lease.renew_every_s
    held: Term | None = None
    while not should_stop():
        if held is not None:
            lease.renew()
        else:
            lease.acquire()
        term = lease.term if lease.is_leader() else None
        if held is None and term is not None:
            emit({"role": "leader", "holder": lease.holder, "token": term.token,
                  "since": term.since})
        elif held is not None and term is None:
            emit({"role": "follower", "holder": lease.holder, "token": held.token,
                  "until": min(held.deadline, lease.clock())})
        held = term
        time.sleep(poll)
    lease.release()


def main(argv: list[str] | None = None) -> None:
    import etcd

    ap = argparse.ArgumentParser(prog="python -m ds3d.daemon.leadership",
                                 description="contend for an etcd leader lease (a drill)")
    ap.add_argument("--endpoint", required=True, help="HOST:PORT of an etcd member (v2 API)")
    ap.add_argument("--key", required=True)
    ap.add_argument("--holder", required=True)
    ap.add_argument("--ttl", type=int, default=5, help="lease TTL in seconds (>= 2)")
    a = ap.parse_args(argv)
    host, _, port = a.endpoint.rpartition(":")
    stop = stop_on_signals()
    client = etcd.Client(host=host, port=int(port), read_timeout=1)
    lease = LeaderLease(client, a.key, a.holder, a.ttl)
    contend(lease, lambda rec: print(json.dumps(rec), flush=True), stop.is_set)
    sys.exit(0)


if __name__ == "__main__":
    main()
