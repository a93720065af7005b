"""The agents of one attempt meet on the rendezvous's store before torch elastic's rendezvous
(daemon/arrivals.py): a late agent holds the others back instead of missing the first round."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ds3d.daemon.arrivals import meet, rendezvous_store
from ds3d.daemon.launcher import RDZV_CONFIGS


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    yield store


def _client(server: TCPStore, run_id: str):
    """A client built the way the agent builds it (torch's c10d backend, is_host False)."""
    return rendezvous_store("c10d", f"127.0.0.1:{server.port}", run_id, 2, 3, dict(RDZV_CONFIGS))


def _arrive_after(delay_s: float, server: TCPStore, run_id: str, expected: int | None,
                  out: dict[str, tuple[int, int | None, float]], name: str) -> threading.Thread:
    def go() -> None:
        time.sleep(delay_s)
        out[name] = meet(_client(server, run_id), run_id, expected, wait_s=30)
    t = threading.Thread(target=go)
    t.start()
    return t


def test_every_agent_waits_for_the_last_one_the_head_started(server):
    out: dict[str, tuple[int, int | None, float]] = {}
    threads = [_arrive_after(0.0, server, "job-a2", None, out, "b"),
               _arrive_after(0.3, server, "job-a2", 3, out, "head"),
               _arrive_after(2.0, server, "job-a2", None, out, "late")]
    ended = {}
    for t, name in zip(threads, ("b", "head", "late"), strict=True):
        t.join(timeout=40)
        ended[name] = time.monotonic()
    assert {name: out[name][:2] for name in out} == {"b": (3, 3), "head": (3, 3), "late": (3, 3)}
    assert out["b"][2] >= 1.8 and out["head"][2] >= 1.5  # held until the late one came
    assert out["late"][2] < 1.0
    assert max(ended.values()) - min(ended.values()) < 1.0  # all released together


def test_a_node_that_never_comes_costs_the_wait_once(server):
    run_id = "job-a3"
    t0 = time.monotonic()
    arrived, expected, waited = meet(_client(server, run_id), run_id, 2, wait_s=1.5)
    assert (arrived, expected) == (1, 2) and 1.5 <= waited < 5
    assert time.monotonic() - t0 < 6
    # an agent of another node that does not hear from the head: it waits as long, no more
    arrived, expected, waited = meet(_client(server, "job-a4"), "job-a4", None, wait_s=1.0)
    assert (arrived, expected) == (1, None) and 1.0 <= waited < 5


def test_attempts_do_not_count_each_others_arrivals(server):
    assert meet(_client(server, "job-a5"), "job-a5", 1, wait_s=5)[:2] == (1, 1)
    assert meet(_client(server, "job-a6"), "job-a6", 1, wait_s=5)[:2] == (1, 1)
