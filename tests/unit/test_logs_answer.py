"""GetLogs answers fit what a gRPC client receives (4 MiB by default): a job of many ranks and
restarts has hundreds of log files, and the whole answer failed with RESOURCE_EXHAUSTED once
their tails passed it. Newest files come first; the oldest past the budget are listed with
their size and a note instead of their text."""

from __future__ import annotations

import os

import pytest

from ds3d.daemon.api import ControlServicer
from ds3d.daemon.service import LOGS_ANSWER_MAX_BYTES, JobService
from ds3d.daemon.store import Store
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError, NotFoundError
from ds3d.v1 import control_pb2 as pb

pytestmark = pytest.mark.timeout(60)
GRPC_RECEIVE_LIMIT = 4 << 20


def _service(tmp_path) -> JobService:
    store = Store(tmp_path / "ds3d.db")
    run_dir = tmp_path / "jobs" / "lg"
    store.create_job("lg", build_job_config("tiny", name="lg").dump_json(), "n1", str(run_dir))
    return JobService(store, None, tmp_path / "jobs", "n1")  # type: ignore[arg-type]


def test_many_big_logs_fit_one_answer_newest_first(tmp_path):
    logs = tmp_path / "jobs" / "lg" / "logs"
    line = "x" * 99 + "\n"
    for attempt in range(5):
        for rank in range(8):
            f = logs / f"attempt-{attempt}" / str(rank) / "stdout.log"
            f.parent.mkdir(parents=True)
            f.write_text(line * 2000)  # 200 KB each, 8 MB in all
            os.utime(f, (1000 + attempt * 10 + rank, 1000 + attempt * 10 + rank))
    servicer = ControlServicer(_service(tmp_path), shares=None, node="n1")  # type: ignore[arg-type]
    answer = servicer.GetLogs(pb.GetLogsRequest(name="lg", tail_lines=100000), None)
    assert len(answer.SerializeToString()) < GRPC_RECEIVE_LIMIT
    assert sum(len(f.text) for f in answer.files) <= LOGS_ANSWER_MAX_BYTES + 4096
    by_path = {f.path: f for f in answer.files}
    assert len(by_path) == 40 and all(f.size == 200_000 for f in answer.files)
    newest, oldest = by_path["attempt-4/7/stdout.log"], by_path["attempt-0/0/stdout.log"]
    assert newest.text == (line * 2000).rstrip("\n")
    assert oldest.text.startswith("[ds3d: not sent; this answer is capped")
    assert [f.path for f in answer.files] == sorted(by_path)  # still in path order


def test_a_rank_source_takes_ascii_digits_only(tmp_path):
    with pytest.raises(ConfigError, match="logs source 'rank:\u0661'"):
        _service(tmp_path).logs("lg", 10, "rank:\u0661")


def test_a_rank_without_logs_names_the_ranks_that_have_them(tmp_path):
    """Was: `ds3dctl logs JOB --source rank:99` of a four-rank job printed "no logs yet", as if
    rank 99 had only not written yet."""
    for rank in range(4):
        f = tmp_path / "jobs" / "lg" / "logs" / "attempt-1" / "run" / "attempt_0" / str(rank) / \
            "stderr.log"
        f.parent.mkdir(parents=True)
        f.write_text("x\n")
    service = _service(tmp_path)
    assert [t.path for t in service.logs("lg", 10, "rank:2")] == \
        ["attempt-1/run/attempt_0/2/stderr.log"]
    with pytest.raises(NotFoundError) as err:
        service.logs("lg", 10, "rank:99")
    assert "no logs of local rank 99 on node n1" in str(err.value)
    assert "local ranks 0, 1, 2, 3" in str(err.value)
    assert service.logs("lg", 10, "agent") == []  # no agent log yet: nothing, as before
