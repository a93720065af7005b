"""ListJobs paging (daemon/job_pages.py over the real store): pages in creation order, whatever
the wall clock did, tokens that continue exactly where the last page ended while jobs are added,
bounded answers, and tokens that are not this listing's refused with INVALID_ARGUMENT's
ConfigError."""

from __future__ import annotations

import base64
import json
import sqlite3

import pytest

from ds3d.daemon import job_pages
from ds3d.daemon.api import job_to_proto
from ds3d.daemon.job_pages import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    PAGE_MAX_BYTES,
    JobKey,
    decode_token,
    encode_token,
    own_key,
    page_size,
    shared_key,
    take_page,
)
from ds3d.daemon.states import JobState
from ds3d.daemon.store import Job, Store
from ds3d.trainer.errors import ConfigError
from ds3d.v1 import control_pb2 as pb

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "ds3d.db")
    yield s
    s.close()


def _key(job: Job) -> JobKey:
    return own_key(job.listed_seq, job.name)


def _page(store: Store, token: str, size: int, include_finished: bool = True
          ) -> tuple[list[str], str]:
    """One ListJobs page as the servicer makes it from the store (no shared jobs)."""
    after = decode_token(token, include_finished)
    rows = store.list_jobs_page(None if after is None else after.seq, page_size(size) + 1,
                                include_finished)
    jobs, last = take_page(rows, _key, page_size(size), lambda j: 100)
    return [j.name for j in jobs], "" if last is None else encode_token(last, include_finished)


def _all_pages(store: Store, size: int, include_finished: bool = True) -> list[str]:
    names, token = _page(store, "", size, include_finished)
    while token:
        more, token = _page(store, token, size, include_finished)
        names += more
    return names


def test_page_size_default_maximum_and_negative():
    assert page_size(0) == DEFAULT_PAGE_SIZE
    assert page_size(7) == 7
    assert page_size(MAX_PAGE_SIZE) == MAX_PAGE_SIZE
    assert page_size(2**31 - 1) == MAX_PAGE_SIZE
    with pytest.raises(ConfigError, match=r"page_size=-1: use 0 \(default 100\) or more"):
        page_size(-1)


def test_pages_cover_every_job_once_in_creation_order(store):
    names = [f"j{i:03d}" for i in range(23)]
    for n in names:
        store.create_job(n, "{}", "n1", f"/x/{n}")
    assert _all_pages(store, 5) == names
    first, token = _page(store, "", 5)
    assert first == names[:5] and token
    last, token = _page(store, _page(store, _page(store, _page(store, token, 5)[1], 5)[1], 5)[1],
                        5)
    assert last == names[20:] and token == ""
    assert _all_pages(store, MAX_PAGE_SIZE) == names  # one page, no token
    assert _page(store, "", 23)[1] == ""  # exactly full: nothing is left, no token


def test_jobs_created_while_paging_come_on_later_pages(store):
    for i in range(10):
        store.create_job(f"old{i}", "{}", "n1", "/x")
    seen, token = _page(store, "", 4)
    added = 0
    while token:  # a sweep adds a job before each page a client asks for
        store.create_job(f"new{added}", "{}", "n1", "/x")
        added += 1
        more, token = _page(store, token, 4)
        seen += more
    assert seen == [f"old{i}" for i in range(10)] + [f"new{i}" for i in range(added)]
    assert added == 2  # pages: old0-3 | old4-7 | old8 old9 new0 new1


def _clock_steps_back(store: Store, name: str, seconds: float) -> None:
    """`name` stored as if the wall clock had been `seconds` behind when it was created."""
    with store._tx() as db:
        db.execute("UPDATE jobs SET created_at = created_at - ? WHERE name=?", (seconds, name))


def test_a_job_created_after_the_clock_stepped_back_is_not_skipped(store):
    """Was: pages were keyed by (created_at, name), so a job created while a client paged, at
    a time the clock put before the token's job (NTP stepping back, a VM restored), sorted
    before the token and no page ever held it."""
    for n in ("a", "b", "c"):
        store.create_job(n, "{}", "n1", "/x")
    seen, token = _page(store, "", 2)
    assert seen == ["a", "b"] and token
    store.create_job("d", "{}", "n1", "/x")
    _clock_steps_back(store, "d", 3600)
    store.create_job("0-also-early", "{}", "n1", "/x")  # and a name that sorts first
    _clock_steps_back(store, "0-also-early", 7200)
    while token:
        more, token = _page(store, token, 2)
        seen += more
    assert seen == ["a", "b", "c", "d", "0-also-early"]  # each once, in the order created
    assert [j.name for j in store.list_jobs()] == seen


def test_jobs_of_an_older_store_are_numbered_in_the_order_it_listed_them(tmp_path):
    """A state database of a ds3dd before `listed_seq`: at the next start its jobs get their
    places in its (created_at, name) order, and new jobs come after them."""
    path = tmp_path / "ds3d.db"
    old = Store(path)
    for n in ("b", "a", "c"):
        old.create_job(n, "{}", "n1", "/x")
    old.close()
    db = sqlite3.connect(path)
    db.execute("DROP INDEX jobs_by_listed_seq")
    db.execute("ALTER TABLE jobs DROP COLUMN listed_seq")
    db.execute("UPDATE jobs SET created_at = 1000.0 WHERE name IN ('a', 'b')")  # same time
    db.commit()
    db.close()
    store = Store(path)
    try:
        store.create_job("d", "{}", "n1", "/x")
        assert [(j.name, j.listed_seq) for j in store.list_jobs()] == [
            ("a", 1), ("b", 2), ("c", 3), ("d", 4)]
        assert _all_pages(store, 1) == ["a", "b", "c", "d"]
    finally:
        store.close()


def test_without_finished_jobs(store):
    for n in ("a", "b", "c", "d", "e"):
        store.create_job(n, "{}", "n1", "/x")
    store.transition("b", JobState.FAILED, "gone")
    store.transition("d", JobState.STOPPED, "gone")
    assert _all_pages(store, 2, include_finished=False) == ["a", "c", "e"]
    assert _all_pages(store, 2, include_finished=True) == ["a", "b", "c", "d", "e"]


def test_shared_jobs_come_after_the_daemons_own():
    assert own_key(10**9, "zzz") < shared_key("aaa") < shared_key("bbb")
    assert decode_token(encode_token(shared_key("job-x"), False), False) == shared_key("job-x")


def test_answer_is_cut_at_the_byte_budget_and_continues():
    keys = [own_key(i, f"j{i}") for i in range(10)]
    big = PAGE_MAX_BYTES // 3
    page, last = take_page(keys, lambda k: k, 10, lambda k: big)
    assert page == keys[:2] and last == keys[1]  # 3 x (1/3 + overhead) does not fit
    page, last = take_page(keys[:1], lambda k: k, 10, lambda k: 2 * PAGE_MAX_BYTES)
    assert page == keys[:1] and last is None  # one job always goes, even alone over the budget


def test_real_job_statuses_stay_under_a_grpc_client_limit(store, tmp_path):
    from ds3d.trainer.config import build_job_config

    for i in range(MAX_PAGE_SIZE + 200):
        n = f"sweep-{i:05d}"
        store.create_job(n, build_job_config("tiny", name=n).dump_json(), "n1", f"/x/{n}")
        store.transition(n, JobState.FAILED, "worker exited 1: " + "x" * 1500)
    rows = store.list_jobs_page(None, MAX_PAGE_SIZE + 1, True)
    protos = [job_to_proto(j) for j in rows]
    by_name = {j.name: j.listed_seq for j in rows}
    jobs, last = take_page(protos, lambda j: own_key(by_name[j.spec.name], j.spec.name),
                           MAX_PAGE_SIZE, pb.JobStatus.ByteSize)
    answer = pb.ListJobsResponse(jobs=jobs, next_page_token=encode_token(last, True))
    assert last is not None and 0 < len(jobs) < MAX_PAGE_SIZE  # cut by bytes, not count
    assert answer.ByteSize() <= PAGE_MAX_BYTES + 200 < 4 << 20


def test_token_round_trip_and_foreign_tokens():
    key = own_key(42, "sweep-00042")
    assert decode_token(encode_token(key, True), True) == key
    assert decode_token("", False) is None
    with pytest.raises(ConfigError, match="issued for include_finished=True"):
        decode_token(encode_token(key, True), False)

    def forged(payload: object) -> str:
        return "jobs2." + base64.urlsafe_b64encode(json.dumps(payload).encode()).decode()

    hostile = ["garbage", "jobs2.", "jobs2.!!!!", "jobs2." + "A" * 5000, "jobs2.e30=",
               forged([True, False, 1]), forged([1, False, 1, "a"]),
               forged([True, False, "1", "a"]), forged([True, False, True, "a"]),
               forged([True, False, 1.5, "a"]), forged([True, False, -1, "a"]),
               forged([True, False, 2**63, "a"]), forged([True, True, 5, "a"]),
               forged([True, 0, 1, "a"]), forged([True, False, 1, "../../etc"]),
               forged({"after": 1}), "jobs2." + base64.urlsafe_b64encode(b"\xff\xfe").decode(),
               "jobs2." + base64.urlsafe_b64encode(b"[true, false, NaN, \"a\"]").decode(),
               encode_token(key, True)[:-3], encode_token(key, True) + "\n"]
    for token in hostile:
        with pytest.raises(ConfigError, match="is not a ListJobs page token of this daemon: "
                                              "pass the next_page_token"):
            decode_token(token, True)


def test_a_token_of_the_creation_time_listing_says_to_start_again():
    old = "jobs1." + base64.urlsafe_b64encode(b'[true,1764968000.1,"a"]').decode()
    with pytest.raises(ConfigError, match="issued by an older ds3dd .* start again without"):
        decode_token(old, True)


def test_long_token_is_shown_shortened():
    with pytest.raises(ConfigError) as e:
        decode_token("x" * 100_000, True)
    assert len(str(e.value)) < 400 and "(100000 characters)" in str(e.value)


def test_module_constants_fit_the_grpc_default():
    assert job_pages.PAGE_MAX_BYTES < 4 << 20
    assert DEFAULT_PAGE_SIZE <= MAX_PAGE_SIZE
