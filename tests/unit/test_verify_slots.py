"""ListCheckpoints with verify reads and hashes every file of every checkpoint in one of ds3dd's
RPC threads (minutes on a big store). Verifies are served two at once and one per job; past
that they are refused RESOURCE_EXHAUSTED saying what to do, while plain listings (and every
other call) are answered."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ds3d.daemon.api import VERIFIES_MAX, ControlServicer
from ds3d.daemon.errors import LongCallLimitError, status_code
from ds3d.daemon.service import JobService
from ds3d.daemon.store import Store
from ds3d.trainer.config import build_job_config
from ds3d.v1 import control_pb2 as pb

pytestmark = pytest.mark.timeout(60)


class SlowVerifies(JobService):
    """The daemon's service, its verify held until the test releases it (the store is ds3dd's
    own SQLite store; only the minutes of hashing are replaced by a wait)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.running = threading.Semaphore(0)

    def checkpoints(self, name, verify=False):
        if verify:
            self.running.release()
            assert self.release.wait(30)
        return self.store.checkpoints(name), []


def test_verifies_past_two_or_of_the_same_job_are_refused_and_listings_answered(tmp_path):
    store = Store(tmp_path / "ds3d.db")
    for name in ("a", "b", "c"):
        store.create_job(name, build_job_config("tiny", name=name).dump_json(), "n1",
                         str(tmp_path / "jobs" / name))
    service = SlowVerifies(store, None, tmp_path / "jobs", "n1")  # type: ignore[arg-type]
    servicer = ControlServicer(service, shares=None, node="n1")  # type: ignore[arg-type]

    def verify(name):
        return servicer.ListCheckpoints(pb.ListCheckpointsRequest(name=name, verify=True), None)

    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(verify, "a"), pool.submit(verify, "b")]
        for _ in range(VERIFIES_MAX):
            assert service.running.acquire(timeout=10)
        with pytest.raises(LongCallLimitError, match="a verify of a's checkpoints is under way") \
                as same:
            verify("a")
        with pytest.raises(LongCallLimitError, match=f"{VERIFIES_MAX} checkpoint verifies run") \
                as full:
            verify("c")
        assert status_code(same.value).name == status_code(full.value).name == \
            "RESOURCE_EXHAUSTED"
        listing = servicer.ListCheckpoints(pb.ListCheckpointsRequest(name="c"), None)
        assert list(listing.checkpoints) == []  # answered while both verifies run
        service.release.set()
        for f in held:
            f.result(timeout=10)
    service.release.clear()
    with ThreadPoolExecutor(1) as pool:  # the slots are free again
        done = pool.submit(verify, "c")
        assert service.running.acquire(timeout=10)
        service.release.set()
        assert done.result(timeout=10) is not None
