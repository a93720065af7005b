"""The ranks' report files are bounded: a writer moves to a new segment once its segment is full,
the daemon tails the segments in order and deletes one only once it is stored and two newer
ones exist, and no record is lost or stored twice on the way: across a daemon restart, a
daemon away while many segments pile up, two writers of one rank, a torn last line, and the
copies a multi-node job's head pulls from another node over gRPC."""

import json
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from ds3d.daemon.api import ControlServicer
from ds3d.daemon.jobdir import JobDir
from ds3d.daemon.launcher import Launcher
from ds3d.daemon.metrics import Metrics
from ds3d.daemon.multinode import JobNodes
from ds3d.daemon.peers import PeerClient, Shares
from ds3d.daemon.reports import ReportTail
from ds3d.daemon.store import Store
from ds3d.trainer.config import build_job_config
from ds3d.trainer.report import (
    KEPT_SEGMENTS,
    Reporter,
    parse_segment_name,
    read_rank_records,
    read_records,
    report_segments,
)
from ds3d.v1 import control_pb2_grpc as pb_grpc

pytest_plugins = ["fixtures.tmpfs"]
pytestmark = pytest.mark.timeout(60)

SEGMENT = 2000  # bytes: a record is ~200, so a segment holds about ten


def _job(tmp_path: Path, name: str = "j") -> tuple[Store, JobDir]:
    store = Store(tmp_path / "db.sqlite")
    jd = JobDir(tmp_path / "jobs", name)
    jd.create("{}")
    store.create_job(name, "{}", "n1", str(jd.path))
    return store, jd


def _steps(rep: Reporter, first: int, last: int) -> None:
    for s in range(first, last + 1):
        rep.emit("step", step=s, loss=1.0 / s, tokens_per_s=100.0, step_time_s=0.1)


def _stored_steps(store: Store, name: str = "j") -> list[int]:
    return [e.step for e in store.events(job=name, kinds=["step"], limit=1 << 20)]


def _segments(folder: Path, rank: int = 0) -> list[int]:
    return [parse_segment_name(p.name)[1] for p in report_segments(folder, rank)]


def test_segments_are_dropped_once_stored_and_nothing_is_lost(tmp_path):
    store, jd = _job(tmp_path)
    rep = Reporter(jd.path, 0, 0, segment_bytes=SEGMENT)
    tail = ReportTail(store, jd)
    for batch in range(20):
        _steps(rep, batch * 15 + 1, batch * 15 + 15)
        tail.poll()
        segs = _segments(jd.reports)
        assert len(segs) <= KEPT_SEGMENTS  # bounded right after each poll
        assert segs[-1] >= batch  # the writer moved on (15 records > a segment)
    assert _stored_steps(store) == list(range(1, 301))  # each step once, in order
    # an offset row only for the segments on disk (dropped ones forgot theirs)
    assert set(store.offsets("j")) == {p.name for p in report_segments(jd.reports)}
    assert all(p.stat().st_size <= SEGMENT + 300 for p in report_segments(jd.reports))
    assert [r["step"] for r in read_rank_records(jd.path, 0)][-1] == 300
    rep.close()
    store.close()


def test_nothing_unread_is_dropped_while_the_daemon_is_away(tmp_path):
    """Segments pile up while no daemon reads; the next daemon (a new store connection and
    tail: a restart) reads them all, in order, and only then drops them."""
    store, jd = _job(tmp_path)
    rep = Reporter(jd.path, 0, 0, segment_bytes=SEGMENT)
    _steps(rep, 1, 10)
    ReportTail(store, jd).poll()
    store.close()
    _steps(rep, 11, 200)  # the daemon is down: about twenty segments
    assert len(_segments(jd.reports)) > 15
    store = Store(tmp_path / "db.sqlite")
    ReportTail(store, jd).poll()
    assert _stored_steps(store) == list(range(1, 201))
    assert len(_segments(jd.reports)) == KEPT_SEGMENTS
    rep.close()
    store.close()


def test_a_restarted_daemon_resumes_across_a_rotation(tmp_path):
    store, jd = _job(tmp_path)
    rep = Reporter(jd.path, 0, 0, segment_bytes=SEGMENT)
    _steps(rep, 1, 5)
    ReportTail(store, jd).poll()
    offsets = store.offsets("j")
    store.close()
    _steps(rep, 6, 25)  # on into the next segments, one partly read before
    assert list(offsets) == ["rank-00000.jsonl"] and len(_segments(jd.reports)) >= 2
    store = Store(tmp_path / "db.sqlite")
    ReportTail(store, jd).poll()
    assert _stored_steps(store) == list(range(1, 26))
    rep.close()
    # a restarted worker appends to the rank's newest segment, not to the first
    rep2 = Reporter(jd.path, 0, 1, segment_bytes=SEGMENT)
    assert rep2.path == report_segments(jd.reports, 0)[-1]
    _steps(rep2, 26, 27)
    ReportTail(store, jd).poll()
    assert _stored_steps(store) == list(range(1, 28))
    rep2.close()
    store.close()


def test_two_writers_of_one_rank_move_on_together(tmp_path):
    """The step loop and the worker each hold a Reporter of the rank (trainer/loop.py,
    worker.py): whichever writes next after a segment filled goes to the newest one."""
    store, jd = _job(tmp_path)
    a = Reporter(jd.path, 0, 0, segment_bytes=SEGMENT)
    b = Reporter(jd.path, 0, 0, segment_bytes=SEGMENT)
    tail = ReportTail(store, jd)
    for s in range(1, 201):
        _steps(a if s % 3 else b, s, s)
        if s % 20 == 0:
            tail.poll()
    tail.poll()
    assert _stored_steps(store) == list(range(1, 201))
    assert a.path == b.path == report_segments(jd.reports, 0)[-1]
    assert len(_segments(jd.reports)) <= KEPT_SEGMENTS
    a.close()
    b.close()
    store.close()


def test_a_torn_line_does_not_keep_an_old_segment_forever(tmp_path):
    """A writer killed mid-record leaves a line without its newline; once the rank wrote two
    newer segments nobody completes it, and its segment is dropped like any read one."""
    store, jd = _job(tmp_path)
    first = jd.reports / "rank-00000.jsonl"
    lines = [json.dumps({"kind": "step", "time": 1.0, "rank": 0, "step": s, "loss": 1.0})
             for s in range(1, 41)]
    first.write_text("\n".join(lines) + "\n" + '{"kind": "step", "st')  # torn, past SEGMENT
    tail = ReportTail(store, jd)
    tail.poll()
    rep = Reporter(jd.path, 0, 1, segment_bytes=SEGMENT)
    assert rep.path.name == "rank-00000.000001.jsonl"
    _steps(rep, 41, 80)
    tail.poll()
    assert not first.exists()
    assert _stored_steps(store) == list(range(1, 81))
    rep.close()
    store.close()


@pytest.mark.tmpfs
def test_records_held_on_a_full_disk_at_a_rotation_arrive_once(tmp_path, small_tmpfs,
                                                                fill_disk):
    """No room for the next segment's first record on a real, full tmpfs: the records are
    held (nothing torn, nothing lost) and written to that segment once there is room."""
    store = Store(tmp_path / "db.sqlite")
    jd = JobDir(small_tmpfs(1 << 20), "j")
    jd.create("{}")
    store.create_job("j", "{}", "n1", str(jd.path))
    rep = Reporter(jd.path, 0, 0, segment_bytes=SEGMENT)
    step = 0
    while rep.path.stat().st_size < SEGMENT:  # the first segment is full
        step += 1
        _steps(rep, step, step)
    filler = fill_disk(jd.path)
    _steps(rep, step + 1, step + 5)
    assert rep.held() == 5 and rep.path.name == "rank-00000.000001.jsonl"
    filler.unlink()
    _steps(rep, step + 6, step + 6)
    assert rep.held() == 0
    ReportTail(store, jd).poll()
    assert _stored_steps(store) == list(range(1, step + 7))
    rep.close()
    store.close()


def test_a_share_hands_out_segments_in_order_and_drops_what_the_head_dropped(tmp_path):
    root = tmp_path / "shares"
    cfg = build_job_config("tiny", ['launch.hosts=["127.0.0.1:7000", "127.0.0.1:7001"]',
                                    "launch.nnodes=2", "parallel.dp=2",
                                    'checkpoint.store="file:///tmp/x"'], name="mn")
    jd = JobDir(root, "mn")
    jd.create(cfg.dump_json())
    shares = Shares(root, Launcher())
    rep = Reporter(jd.path, 1, 0, segment_bytes=SEGMENT)
    _steps(rep, 1, 30)  # three segments
    assert _segments(jd.reports, 1) == [0, 1, 2]
    # a small budget ends inside segment 0: nothing of segment 1 may come before its end
    chunks = shares.pull("mn", {}, max_bytes=500)
    assert [c.file for c in chunks] == ["rank-00001.jsonl"]
    have = {"rank-00001.jsonl": len(chunks[0].data)}
    chunks = shares.pull("mn", have)
    assert [c.file for c in chunks] == ["rank-00001.jsonl", "rank-00001.000001.jsonl",
                                        "rank-00001.000002.jsonl"]
    # the head tailed and dropped its copy of segment 0: the share drops it too, and sends
    # nothing of it again
    sizes = {p.name: p.stat().st_size for p in report_segments(jd.reports)}
    del sizes["rank-00001.jsonl"]
    assert shares.pull("mn", sizes) == []
    assert _segments(jd.reports, 1) == [1, 2]
    rep.close()


@contextmanager
def _share_and_head(tmp_path: Path) -> Iterator[tuple[str, JobDir, Store, JobDir, JobNodes]]:
    """A share node of job "mn" served over real gRPC, and its head's store, job folder and
    JobNodes (what pulls the share's reports): (address, share dir, store, head dir, nodes)."""
    share_root = tmp_path / "shares"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    shares = Shares(share_root, Launcher())
    pb_grpc.add_ControlServicer_to_server(ControlServicer(None, shares, "b"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        cfg = build_job_config("tiny", [f'launch.hosts=["127.0.0.1:7000", "{address}"]',
                                        "launch.nnodes=2", "parallel.dp=2",
                                        'checkpoint.store="file:///tmp/x"'], name="mn")
        share_dir = JobDir(share_root, "mn")
        share_dir.create(cfg.dump_json())
        store, head_dir = _job(tmp_path / "head", "mn")
        nodes = JobNodes("mn", head_dir, store, Metrics(), PeerClient(None, None),
                         "127.0.0.1:7000", 60.0, lambda job: cfg)
        yield address, share_dir, store, head_dir, nodes
        store.close()
    finally:
        server.stop(0)


def test_a_heads_copies_of_another_nodes_segments_stay_bounded(tmp_path):
    """The head pulls a share's segments over gRPC (JobNodes.pull_reports -> PullReports ->
    Shares.pull), tails its copies and drops them; the share drops what the head dropped;
    every record is stored once."""
    with _share_and_head(tmp_path) as (address, share_dir, store, head_dir, nodes):
        tail = ReportTail(store, head_dir)
        rep = Reporter(share_dir.path, 1, 0, segment_bytes=SEGMENT)
        mirror = head_dir.reports / "nodes" / address.replace(":", "_")
        for batch in range(12):
            _steps(rep, batch * 25 + 1, batch * 25 + 25)
            nodes.pull_reports(store.get_job("mn"))
            tail.poll()
            assert len(_segments(mirror, 1)) <= KEPT_SEGMENTS
            assert len(_segments(share_dir.reports, 1)) <= KEPT_SEGMENTS + 3
        nodes.pull_reports(store.get_job("mn"))  # the share learns what the head dropped
        assert _stored_steps(store, "mn") == list(range(1, 301))
        assert _segments(share_dir.reports, 1) == _segments(mirror, 1)
        rep.close()


def test_a_backlog_of_reports_over_four_mib_reaches_the_head(tmp_path):
    """Seven ranks' ~5.7 MB of reports waiting on a share node (the head was away): each pull's
    answer stays under the 4 MiB a gRPC client receives by default, so every record arrives.
    A 4 MiB budget of report bytes made an answer of 4 MiB plus the chunks' framing, refused
    by the head on every pull: that node's reports never arrived again."""
    with _share_and_head(tmp_path) as (address, share_dir, store, head_dir, nodes):
        for rank in range(1, 8):
            rep = Reporter(share_dir.path, rank, 0)
            _steps(rep, 1, 5000)
            rep.close()
        backlog = sum(p.stat().st_size for p in report_segments(share_dir.reports))
        assert backlog > 5 << 20
        mirror = head_dir.reports / "nodes" / address.replace(":", "_")
        for _ in range(3):
            nodes.pull_reports(store.get_job("mn"))
        assert sum(p.stat().st_size for p in report_segments(mirror)) == backlog
        for rank in range(1, 8):
            steps = [r["step"] for p in report_segments(mirror, rank) for r in read_records(p)[0]]
            assert steps == list(range(1, 5001))


@pytest.mark.parametrize("bad", [
    b"[1]", b"5", b'"text"', b'{"kind": "step", "rank": 0, "step": "abc", "time": 1.0}',
    b'{"kind": "start", "rank": "x", "restart": 0}', b'{"kind": "step", "rank": true}',
    b'{"kind": "checkpoint", "phase": "retention", "step": 1, "deleted": 5}',
    b'{"kind": "recovery", "rank": 0, "step": 3, "skipped_batches": "ab"}',
    b'{"kind": "heartbeat", "rank": 0, "time": "now"}',
])
def test_a_record_that_does_not_convert_is_passed_over_not_a_wedged_job(tmp_path, bad):
    """Was: one such line (a report file edited or damaged by hand) raised in every poll: the
    file's offset was never committed, so every supervisor tick of the job failed forever and
    nothing after the line was ever read."""
    store, jd = _job(tmp_path)
    f = jd.reports / "rank-00000.jsonl"
    f.write_bytes(bad + b"\n" + b'{"kind": "step", "rank": 0, "step": 7, "loss": 1.5, '
                  b'"time": 2.0, "restart": 0}\n')
    obs = ReportTail(store, jd).poll()
    assert _stored_steps(store) == [7] and store.get_job("j").step == 7
    assert [r.get("step") for r in obs.records] == [7]  # the detectors see only usable ones
    assert store.offsets("j")[jd.report_key(f)] == f.stat().st_size


def test_profile_and_repartition_events_read_as_sentences():
    """The `profile` event's message was the record's raw JSON (cut at 200 characters)."""
    from ds3d.daemon.reports import record_to_event

    prof = record_to_event({"kind": "profile", "rank": 2, "step": 6, "stage": 1,
                            "partition": [0, 3, 6], "steps_sampled": 3,
                            "layers": [{"layer": 3}, {"layer": 4}, {"layer": 5}]})
    assert prof is not None and prof["message"] == (
        "layer profile of stage 1 (rank 2): 3 layer(s) over 3 step(s) at step 6, partition "
        "[0, 3, 6] (ds3dctl rebalance JOB --dry-run)")
    rep = record_to_event({"kind": "repartition", "rank": 0, "step": 6, "current": [0, 3, 6],
                           "proposed": [0, 4, 6], "source": "measured", "decision": "applied"})
    assert rep is not None and rep["message"] == \
        "pipeline stages [0, 3, 6] -> [0, 4, 6] (measured): applied"
