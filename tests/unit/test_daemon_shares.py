"""Pure logic of the multi-node plumbing and of fault injection files (no processes): a share's
report bytes are handed out in whole lines from the head's offsets, copies of other nodes'
reports are tailed under their own keys, control files are written atomically and only by name,
and peers beyond loopback are refused without TLS."""

import json
from pathlib import Path

import pytest

from ds3d.daemon.jobdir import JobDir
from ds3d.daemon.launcher import Launcher
from ds3d.daemon.peers import (
    HeadReplacingError,
    PeerClient,
    PeerError,
    Shares,
    check_peer_address,
)
from ds3d.daemon.reports import ReportTail
from ds3d.daemon.store import Store
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError, StateError
from ds3d.trainer.report import Reporter

pytestmark = pytest.mark.timeout(30)


def share(tmp_path: Path, name: str = "mn") -> tuple[Shares, JobDir]:
    root = tmp_path / "shares"
    cfg = build_job_config("tiny", ['launch.hosts=["127.0.0.1:7000", "127.0.0.1:7001"]',
                                    "launch.nnodes=2", "parallel.dp=2",
                                    'checkpoint.store="file:///tmp/x"'], name=name)
    jobdir = JobDir(root, name)
    jobdir.create(cfg.dump_json())
    return Shares(root, Launcher()), jobdir


def test_pull_hands_out_whole_lines_from_offsets(tmp_path):
    shares, jobdir = share(tmp_path)
    path = jobdir.reports / "rank-00001.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')  # last line still being written
    (chunk,) = shares.pull("mn", {})
    assert (chunk.file, chunk.offset, chunk.data) == ("rank-00001.jsonl", 0,
                                                     b'{"a": 1}\n{"b": 2}\n')
    (chunk,) = shares.pull("mn", {"rank-00001.jsonl": 9})
    assert chunk.offset == 9 and chunk.data == b'{"b": 2}\n'
    assert shares.pull("mn", {"rank-00001.jsonl": 18}) == []
    assert shares.pull("mn", {}, max_bytes=12)[0].data == b'{"a": 1}\n'
    assert shares.pull("other", {}) is None  # no share of that job here
    assert shares.head_address("mn") == "127.0.0.1:7000"
    assert shares.head_address("other") is None and shares.names() == ["mn"]


def test_pull_hands_out_the_agents_faults_lines_first(tmp_path):
    """The node's agent's group failures (control/agent-<attempt>.faults) reach the head by the
    same pull, ahead of a backlog of report bytes, in whole lines from the head's offsets; no
    other control file does."""
    shares, jobdir = share(tmp_path)
    (jobdir.reports / "rank-00001.jsonl").write_bytes(b'{"a": 1}\n' * 100)
    faults = jobdir.control / "agent-2.faults"
    faults.write_bytes(b'{"rank": 1}\n{"rank": ')
    (jobdir.control / "command.json").write_text('{"id": 1, "action": "pause"}\n')
    chunks = shares.pull("mn", {}, max_bytes=40)
    assert [(c.file, c.offset, c.data) for c in chunks] == [
        ("agent-2.faults", 0, b'{"rank": 1}\n'), ("rank-00001.jsonl", 0, b'{"a": 1}\n' * 3)]
    faults.write_bytes(b'{"rank": 1}\n{"rank": 0}\n')
    (chunk, _) = shares.pull("mn", {"agent-2.faults": 12})
    assert (chunk.file, chunk.offset, chunk.data) == ("agent-2.faults", 12, b'{"rank": 0}\n')
    assert [c.file for c in shares.pull("mn", {"agent-2.faults": 24})] == ["rank-00001.jsonl"]


def test_an_etcd_led_job_is_forwarded_to_its_lease_holder(tmp_path):
    """The takeover watch's reading of the lease decides where the job's calls go: the first
    host no more (it may be the dead head), a clear retryable refusal while nobody leads."""
    shares, _ = share(tmp_path)
    assert not shares.etcd_led("mn")
    shares.leader_seen("mn", "127.0.0.1:7000")
    assert shares.etcd_led("mn") and shares.head_address("mn") == "127.0.0.1:7000"
    shares.leader_seen("mn", "")  # the lease expired, nobody took it yet
    with pytest.raises(HeadReplacingError, match=r"being replaced \(leader lease expired "
                       r"\d+ s ago.*retry in a few seconds") as refused:
        shares.head_address("mn")
    assert refused.value.grpc_code == "UNAVAILABLE"
    shares.leader_seen("mn", "127.0.0.1:7001")  # a survivor won it
    assert shares.head_address("mn") == "127.0.0.1:7001"
    shares.forget("mn")
    assert not shares.etcd_led("mn") and shares.head_address("mn") == "127.0.0.1:7000"


def test_control_files_by_name_only(tmp_path):
    shares, jobdir = share(tmp_path)
    assert shares.control("mn", "command.json", '{"id": 3, "action": "pause"}')
    assert jobdir.command() == {"id": 3, "action": "pause"}
    assert shares.control("mn", "command.json", "") and jobdir.command() is None
    with pytest.raises(ConfigError, match="not one of"):
        shares.control("mn", "../job.json", "{}")
    assert not shares.control("other", "command.json", "{}")  # no share of that job here
    with pytest.raises(StateError, match="--enable-fault-injection"):
        shares.control("mn", "inject.json", "{}")  # this daemon was started without it


def test_inject_file_is_atomic_and_checked(tmp_path):
    jobdir = JobDir(tmp_path, "j")
    jobdir.create("{}")
    text = jobdir.write_inject(4, "hang", 1, 17)
    d = json.loads(text)
    assert (d["id"], d["kind"], d["rank"], d["at_step"]) == (4, "hang", 1, 17)
    assert jobdir.inject()["kind"] == "hang" and not list(jobdir.control.glob(".*.tmp*"))
    with pytest.raises(ValueError):
        jobdir.write_inject(5, "melt", 0, 1)


def test_report_copies_from_other_nodes_are_tailed_separately(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    jobdir = JobDir(tmp_path / "jobs", "mn")
    jobdir.create("{}")
    store.create_job("mn", "{}", "a", str(jobdir.path))
    Reporter(jobdir.path, 1, 0).emit("heartbeat", step=1, phase="train")
    mirror = jobdir.reports / "nodes" / "127.0.0.1_7001"
    mirror.mkdir(parents=True)
    (mirror / "rank-00000.jsonl").write_text(json.dumps(
        {"kind": "step", "time": 1.0, "rank": 0, "restart": 0, "step": 1, "loss": 2.5,
         "tokens_per_s": 10.0, "step_time_s": 0.1}) + "\n")
    tail = ReportTail(store, jobdir)
    obs = tail.poll()
    assert sorted(obs.last_seen) == [0, 1]
    assert set(store.offsets("mn")) == {"rank-00001.jsonl",
                                        "nodes/127.0.0.1_7001/rank-00000.jsonl"}
    assert store.get_job("mn").step == 1 and store.get_job("mn").loss == 2.5
    assert tail.poll().records == []  # nothing counted twice
    store.close()


def test_peers_beyond_loopback_need_tls():
    check_peer_address("127.0.0.1:7531", None)
    check_peer_address("unix:/run/ds3d.sock", None)
    with pytest.raises(ConfigError, match="mutual TLS"):
        check_peer_address("10.0.0.2:7531", None)
    with pytest.raises(PeerError, match="mutual TLS"):
        PeerClient(None, None).status("node2.cluster:7531")


# ---- ReturningNodes: which lost nodes answer again ------------------------------------------

class _Peers:
    """PeerClient stand-in: address -> the jobs with a live agent there, or None (down)."""

    def __init__(self, nodes):
        self.nodes, self.asked = nodes, []

    def status(self, address, timeout_s=None):
        from ds3d.daemon.peers import PeerError
        from ds3d.v1 import control_pb2 as pb

        self.asked.append((address, timeout_s))
        jobs = self.nodes[address]
        if jobs is None:
            raise PeerError(f"node {address}: NodeStatus failed: UNAVAILABLE")
        return pb.NodeStatusResponse(shares=[pb.ShareStatus(job=j, agent_alive=True) for j in jobs])


def test_returning_nodes_are_those_answering_without_a_live_share(monkeypatch):
    from ds3d.daemon import peers as peers_mod

    clock = [100.0]
    monkeypatch.setattr(peers_mod.time, "monotonic", lambda: clock[0])
    fake = _Peers({"a:1": None, "b:1": [], "c:1": ["job"], "d:1": ["other"]})
    nodes = peers_mod.ReturningNodes(fake, every_s=2.0, offered_wait_s=60.0, timeout_s=1.5)
    # down, back without the job, still running it, back (runs another job only)
    assert nodes.poll("job", ["a:1", "b:1", "c:1", "d:1"]) == ["b:1", "d:1"]
    assert {t for _, t in fake.asked} == {1.5}  # a short timeout: the tick must not stall
    assert nodes.poll("job", ["b:1"]) == []  # asked again only every 2 s
    nodes.offered("b:1")
    clock[0] += 2.5
    assert nodes.poll("job", ["a:1", "b:1", "d:1"]) == ["d:1"]  # b was just taken back
    clock[0] += 60
    assert nodes.poll("job", ["b:1"]) == ["b:1"]  # its agent never came: offered again


def test_a_restarted_daemon_knows_the_run_of_each_share_it_ran(tmp_path):
    """The takeover watch (daemon/takeover.py) needs each share's run id; a daemon restarted
    after it ran shares reads them from the newest agent spec of each share folder."""
    shares, jobdir = share(tmp_path)
    assert shares.started() == []
    for attempt in (1, 3, 2):
        (jobdir.control / f"agent-{attempt}.json").write_text(
            json.dumps({"run_id": f"mn-0123456789ab-a{attempt}"}))
    (jobdir.control / "agent-9.exit").write_text("0")  # not a spec
    restarted = Shares(shares.root, Launcher())
    (cfg, run_id), = restarted.started()
    assert cfg.name == "mn" and run_id == "mn-0123456789ab-a3"
    restarted.forget("mn")
    assert restarted.started() == []


def test_a_restarted_daemon_takes_back_share_agents_that_run_or_finished(tmp_path):
    """After a restart the newest agent of each share is found again by its pid file when it
    still runs or its workers finished (exit 0), so NodeStatus reports it and a finished
    share's backlog is resumed; not an agent that was killed or failed (the head relaunches
    it), an older attempt, or a share whose head ended the job (StopShare)."""
    import psutil

    me = psutil.Process()
    root = tmp_path / "shares"
    # name -> (pid file's start time: ours = this live process, 1.0 = a process now gone;
    #          the agent's exit file, None if it left none)
    cases = {"live": (me.create_time(), None), "done": (1.0, 0), "killed": (1.0, None),
             "failed": (1.0, 1), "ended": (1.0, 0)}
    for name, (started, code) in cases.items():
        _, jobdir = share(tmp_path, name)
        (jobdir.control / "agent-1.json").write_text(json.dumps({"run_id": f"{name}-a1"}))
        (jobdir.control / "agent-1.pid").write_text(json.dumps({"pid": me.pid,
                                                                "started": started}))
        if code is not None:
            (jobdir.control / "agent-1.exit").write_text(json.dumps({"exit_code": code}))
    # "ended": its head ended the job while this daemon ran
    Shares(root, Launcher()).stop("ended", now=True)
    assert (root / "ended" / "control" / "share-stopped.json").is_file()
    # an attempt newer than its pid file: that agent never started, the older one is not it
    _, older = share(tmp_path, "older")
    for attempt in (1, 2):
        (older.control / f"agent-{attempt}.json").write_text(json.dumps({"run_id": "o"}))
    (older.control / "agent-1.pid").write_text(json.dumps({"pid": me.pid,
                                                           "started": me.create_time()}))
    restarted = Shares(root, Launcher())
    status = {s.job: (s.agent_alive, s.exit_code) for s in restarted.status()}
    assert status == {"live": (True, -1), "done": (False, 0)}


@pytest.mark.parametrize("text", ["[1]", "5", '"x"', '{"id": "3", "action": "pause"}',
                                  '{"action": "pause"}', '{"id": 3, "time": "now"}', "{"])
def test_a_control_file_damaged_by_hand_reads_as_none(tmp_path, text):
    """Was: dict([1]) / dict(5) raised TypeError (every supervisor tick of the job failed, and
    InjectFault answered INTERNAL), and an id "3" failed int() comparisons later."""
    jobdir = JobDir(tmp_path / "jobs", "cj")
    jobdir.create("{}")
    for path, read in ((jobdir.command_file, jobdir.command), (jobdir.inject_file, jobdir.inject)):
        path.write_text(text)
        assert read() is None
    jobdir.command_file.write_text('{"id": 3, "action": "pause", "time": 1.5}')
    assert jobdir.command() == {"id": 3, "action": "pause", "time": 1.5}


@pytest.mark.parametrize("text", ["[]", "5", "null"])
def test_a_damaged_agent_spec_of_a_share_does_not_stop_the_daemon(tmp_path, text):
    """Was: json.loads(...)["run_id"] of a spec that is no object raised TypeError in Shares'
    constructor, so ds3dd did not start at all."""
    shares, jobdir = share(tmp_path)
    (jobdir.control / "agent-2.json").write_text(text)
    Shares(shares.root, launcher=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("file, text", [("command.json", "[1]"), ("command.json", "5"),
                                        ("command.json", '{"action": "pause"}'),
                                        ("inject.json", '{"id": "1"}'), ("restore.json", "{"),
                                        ("failures.json", "[]")])
def test_a_control_file_of_the_wrong_shape_from_a_peer_is_refused(tmp_path, file, text):
    """Was: written as sent; rank 0's CommandInbox (trainer/loop.py) then failed at every step
    on a command.json that is no JSON object (cmd.get on a list)."""
    shares, jobdir = share(tmp_path)
    shares.enable_fault_injection = True  # inject.json is refused without it, whatever its shape
    with pytest.raises(ConfigError, match=f"control file {file}: .* nothing was written"):
        shares.control("mn", file, text)
    assert not (jobdir.control / file).exists()
    good = '{"failures": 2, "observed_s": 60.0}' if file == "failures.json" else '{"id": 4}'
    assert shares.control("mn", file, good) and (jobdir.control / file).read_text() == good
