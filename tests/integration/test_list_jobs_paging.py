"""A real ds3dd that has kept thousands of jobs (a sweep, months of use): ListJobs answers in
pages that a default gRPC client (4 MiB) receives, ds3dctl walks the pages and lists every job,
and hostile paging values from a raw client are INVALID_ARGUMENT with a message, after which
the daemon still serves. The jobs are written through the daemon's own store before it starts
(no training: they ended FAILED, as a sweep's rejected trials do)."""

from __future__ import annotations

import json

import grpc
import pytest

from ds3d.daemon.job_pages import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, PAGE_MAX_BYTES
from ds3d.daemon.states import JobState
from ds3d.daemon.store import Store
from ds3d.trainer.config import build_job_config

from test_daemon_support import DaemonProc, new_token, pb

pytestmark = pytest.mark.timeout(240)
N_JOBS = 3000
GRPC_RECEIVE_LIMIT = 4 << 20  # what a client receives unless it raises its limit


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    state = tmp_path_factory.mktemp("many-jobs") / "state"
    state.mkdir()
    store = Store(state / "ds3d.db")
    for i in range(N_JOBS):
        name = f"sweep-{i:05d}"
        store.create_job(name, build_job_config("tiny", name=name).dump_json(), "test-node",
                         str(state / "jobs" / name))
        store.transition(name, JobState.FAILED, f"trial {i} rejected: loss above the sweep's "
                         "cut at step 200 " + "(details in the agent log) " * 10)
    store.close()
    with DaemonProc(state, token=new_token()) as d:
        yield d


def _list(d: DaemonProc, request: pb.ListJobsRequest) -> pb.ListJobsResponse:
    channel, stub = d.stub()  # grpc's default receive limit: 4 MiB
    with channel:
        return stub.ListJobs(request, timeout=30, metadata=d.md())


def _refused(d: DaemonProc, request: pb.ListJobsRequest) -> str:
    with pytest.raises(grpc.RpcError) as e:
        _list(d, request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


def test_every_page_fits_a_default_client_and_all_pages_hold_every_job(daemon):
    old_client = _list(daemon, pb.ListJobsRequest(include_finished=True))  # no paging fields
    assert len(old_client.jobs) == DEFAULT_PAGE_SIZE and old_client.next_page_token
    assert [j.spec.name for j in old_client.jobs] == [f"sweep-{i:05d}" for i in range(100)]

    names, sizes, token = [], [], ""
    while True:
        page = _list(daemon, pb.ListJobsRequest(include_finished=True, page_size=MAX_PAGE_SIZE,
                                                page_token=token))
        sizes.append(page.ByteSize())
        names += [j.spec.name for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert names == [f"sweep-{i:05d}" for i in range(N_JOBS)]  # oldest first, each once
    assert sum(sizes) > GRPC_RECEIVE_LIMIT  # one answer of them all is what used to fail
    assert max(sizes) <= PAGE_MAX_BYTES + 1024 < GRPC_RECEIVE_LIMIT
    live = _list(daemon, pb.ListJobsRequest(page_size=MAX_PAGE_SIZE))
    assert list(live.jobs) == [] and live.next_page_token == ""


def test_hostile_paging_values(daemon):
    huge = _list(daemon, pb.ListJobsRequest(include_finished=True, page_size=2**31 - 1))
    assert 0 < len(huge.jobs) <= MAX_PAGE_SIZE and huge.next_page_token
    assert huge.ByteSize() < GRPC_RECEIVE_LIMIT
    for size in (-1, -2**31):
        assert f"page_size={size}: use 0 (default 100) or more" in \
            _refused(daemon, pb.ListJobsRequest(include_finished=True, page_size=size))
    for token in ("garbage", "jobs2.eyJ9", "\u0000" * 10, "jobs2." + "A" * 1_000_000,
                  "jobs1." + "A" * 1_000_000):
        details = _refused(daemon, pb.ListJobsRequest(include_finished=True, page_token=token))
        assert "is not a ListJobs page token of this daemon: pass the next_page_token" in \
            details and len(details) < 400
    assert "issued by an older ds3dd" in _refused(  # a (created_at, name) token
        daemon, pb.ListJobsRequest(include_finished=True, page_token="jobs1.eyJ9"))
    issued = huge.next_page_token
    assert "issued for include_finished=True" in _refused(
        daemon, pb.ListJobsRequest(include_finished=False, page_token=issued))
    again = _list(daemon, pb.ListJobsRequest(include_finished=True, page_size=5,
                                             page_token=issued))
    assert again.jobs[0].spec.name == f"sweep-{len(huge.jobs):05d}"  # still serving, in order


def test_ds3dctl_lists_every_job(daemon):
    r = daemon.ctl("list", "--all", "--json")
    assert r.returncode == 0, r.stderr
    assert [j["name"] for j in json.loads(r.stdout)] == [f"sweep-{i:05d}" for i in range(N_JOBS)]
    r = daemon.ctl("status")
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("sweep-")]
    assert len(rows) == N_JOBS and rows[-1].startswith(f"sweep-{N_JOBS - 1:05d}")
    r = daemon.ctl("list", "--all", "--limit", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert [j["name"] for j in json.loads(r.stdout)] == ["sweep-00000", "sweep-00001",
                                                         "sweep-00002"]
    assert "the 3 oldest jobs listed (--limit 3); the daemon has more" in r.stderr
    r = daemon.ctl("list", "--all", "--limit", "0")
    assert r.returncode == 2 and "'0' is not a whole number from 1" in r.stderr
    assert daemon.ctl("list").stdout.strip() == "no jobs"  # none is live


def test_a_job_created_while_the_clock_is_behind_is_on_a_later_page(tmp_path):
    """Was: a page token held the last job's creation time, so a job accepted while the wall
    clock was behind that time (NTP stepping back, a VM restored from a snapshot) sorted
    before the token and no later page held it. Jobs are written into the running daemon's
    own store, one of them dated an hour back."""
    state = tmp_path / "state"
    state.mkdir()
    store = Store(state / "ds3d.db")

    def add(name: str, hours_back: float = 0) -> None:
        store.create_job(name, build_job_config("tiny", name=name).dump_json(), "test-node",
                         str(state / "jobs" / name))
        store.transition(name, JobState.FAILED, "a finished trial")
        with store._tx() as db:
            db.execute("UPDATE jobs SET created_at = created_at - ? WHERE name=?",
                       (hours_back * 3600, name))

    try:
        for name in ("j-a", "j-b", "j-c"):
            add(name)
        with DaemonProc(state, token=new_token()) as d:
            first = _list(d, pb.ListJobsRequest(include_finished=True, page_size=2))
            add("j-d", hours_back=1)
            rest = _list(d, pb.ListJobsRequest(include_finished=True, page_size=2,
                                               page_token=first.next_page_token))
            assert [j.spec.name for j in [*first.jobs, *rest.jobs]] == \
                ["j-a", "j-b", "j-c", "j-d"] and rest.next_page_token == ""
            r = d.ctl("list", "--all", "--json")
            assert [j["name"] for j in json.loads(r.stdout)] == ["j-a", "j-b", "j-c", "j-d"]
    finally:
        store.close()
