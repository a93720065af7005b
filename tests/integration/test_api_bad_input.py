"""The bad-input table: malformed requests and configurations against a real ds3dd, each
answered with the right status code and an actionable message — and the daemon still serves.

Cases that need an existing job (duplicate name, pause of a stopped job, rollback to a missing
step) start one through the real elastic agent with the stand-in worker (slow, serialised with
`flock /tmp/ds3d-heavy.lock`)."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ds3d.daemon.auth import PEER_METHODS

from test_daemon_support import DaemonProc, kill_job_processes, new_token, pb, tiny_job_json

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    d = DaemonProc(root / "state", token=new_token(), worker_dir=root / "worker",
                   extra_env={"FAKE_STEP_S": "0.3"})
    d.start()
    yield d
    d.stop()
    kill_job_processes(d.state_dir)


def still_serving(d: DaemonProc) -> None:
    channel, stub = d.stub()
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=5, metadata=d.md())


def call(d: DaemonProc, method: str, request, metadata=None):
    channel, stub = d.stub()
    with channel:
        fn = getattr(stub, method)
        md = d.md() if metadata is None else metadata
        if method == "WatchEvents":
            return list(fn(request, timeout=10, metadata=md))
        return fn(request, timeout=10, metadata=md)


RPC_CASES = [
    ("unknown job", "GetJob", pb.JobRef(name="nosuchjob"), None,
     grpc.StatusCode.NOT_FOUND, "no job named 'nosuchjob'"),
    ("path traversal in a job name", "PauseJob", pb.PauseJobRequest(name="../../etc"), None,
     grpc.StatusCode.INVALID_ARGUMENT, "job name '../../etc' is not allowed"),
    ("path traversal in a config name", "StartJob",
     pb.StartJobRequest(config_json=tiny_job_json(name="../evil")), None,
     grpc.StatusCode.INVALID_ARGUMENT, "name="),
    ("oversized request", "StartJob", pb.StartJobRequest(config_json="x" * (2 << 20)), None,
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("no token", "ListJobs", pb.ListJobsRequest(), [],
     grpc.StatusCode.UNAUTHENTICATED, "requires a bearer token"),
    ("wrong token", "ListJobs", pb.ListJobsRequest(),
     [("authorization", "Bearer wrong-token-wrong-token")],
     grpc.StatusCode.UNAUTHENTICATED, "bearer token is wrong"),  # issue 17 item 10
    ("a token without its scheme", "ListJobs", pb.ListJobsRequest(),
     [("authorization", "x" * 32)],
     grpc.StatusCode.UNAUTHENTICATED, "does not start with the Bearer scheme"),
    ("unknown config key", "StartJob",
     pb.StartJobRequest(config_json=tiny_job_json(train={"bogus": 1})), None,
     grpc.StatusCode.INVALID_ARGUMENT, "train.bogus: unknown setting"),
    ("zero-3 with pp>1", "StartJob",
     pb.StartJobRequest(config_json=tiny_job_json(parallel={"pp": 2, "zero_stage": 3})), None,
     grpc.StatusCode.INVALID_ARGUMENT, "Use zero_stage=1 with pp>1"),
    ("global batch mismatch", "StartJob",
     pb.StartJobRequest(config_json=tiny_job_json(train={"global_batch_size": 8,
                                                         "grad_accum_steps": 3})), None,
     grpc.StatusCode.INVALID_ARGUMENT, "set global_batch_size=6"),
    ("negative steps", "StartJob",
     pb.StartJobRequest(config_json=tiny_job_json(train={"steps": -5})), None,
     grpc.StatusCode.INVALID_ARGUMENT, "train.steps=-5"),
    ("TP not dividing heads", "StartJob",
     pb.StartJobRequest(config_json=tiny_job_json(parallel={"tp": 3})), None,
     grpc.StatusCode.INVALID_ARGUMENT, "n_heads=4 is not divisible by parallel.tp=3"),
    ("not JSON", "StartJob", pb.StartJobRequest(config_json="{not json"), None,
     grpc.StatusCode.INVALID_ARGUMENT, "not valid JSON"),
    ("empty config", "StartJob", pb.StartJobRequest(), None,
     grpc.StatusCode.INVALID_ARGUMENT, "config_json is empty"),
    ("multi-node without hosts", "StartJob",
     pb.StartJobRequest(config_json=tiny_job_json(launch={"nnodes": 2, "device": "cpu"},
                                                  parallel={"dp": 2},
                                                  train={"global_batch_size": 8})), None,
     grpc.StatusCode.INVALID_ARGUMENT, "needs launch.hosts"),
    ("watch an unknown job", "WatchEvents", pb.WatchEventsRequest(name="ghost"), None,
     grpc.StatusCode.NOT_FOUND, "no job named 'ghost'"),
    ("rollback of an unknown job", "Rollback", pb.RollbackRequest(name="ghost", step=3), None,
     grpc.StatusCode.NOT_FOUND, "no job named 'ghost'"),
    ("missing job name", "StopJob", pb.StopJobRequest(), None,
     grpc.StatusCode.INVALID_ARGUMENT, "a job name is required"),
    ("negative log tail", "GetLogs", pb.GetLogsRequest(name="ghost", tail_lines=-1), None,
     grpc.StatusCode.INVALID_ARGUMENT, "tail_lines=-1"),
]


@pytest.mark.parametrize("what,method,request_,metadata,code,needle", RPC_CASES,
                         ids=[c[0] for c in RPC_CASES])
def test_rpc_refusals(daemon, what, method, request_, metadata, code, needle):
    with pytest.raises(grpc.RpcError) as e:
        call(daemon, method, request_, metadata)
    assert e.value.code() == code, e.value.details()
    assert needle in e.value.details()
    assert "Traceback" not in e.value.details()
    still_serving(daemon)


def test_two_authorization_headers_are_refused_whichever_comes_first(daemon):
    """Was: the daemon read one of two `authorization` headers and ignored the other, so which
    credential counted depended on the order a client or proxy sent them. Any two, the right
    token among them or not, on a client or a peer RPC, are UNAUTHENTICATED with the reason."""
    good = f"Bearer {daemon.token}"
    peer = f"Bearer {daemon.peer_token}"
    wrong = "Bearer wrong-token-wrong-token"
    for method, request_, headers in [
            ("ListJobs", pb.ListJobsRequest(), [good, wrong]),
            ("ListJobs", pb.ListJobsRequest(), [wrong, good]),
            ("ListJobs", pb.ListJobsRequest(), [good, good]),
            ("ListJobs", pb.ListJobsRequest(), [peer, good]),
            ("WatchEvents", pb.WatchEventsRequest(name="ghost"), [wrong, good]),
            ("NodeStatus", pb.NodeStatusRequest(), [peer, wrong])]:
        with pytest.raises(grpc.RpcError) as e:
            call(daemon, method, request_, [("authorization", h) for h in headers])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, e.value.details())
        assert "carries 2 authorization headers; send exactly one" in e.value.details()
    assert call(daemon, "ListJobs", pb.ListJobsRequest(), [("authorization", good)]) \
        is not None  # one header with the token: served
    still_serving(daemon)


CLI_CASES = [
    ("unknown preset", ["start", "gpt7"], "unknown preset 'gpt7'"),
    ("bad --set syntax", ["start", "tiny", "--set", "train.lr"], "expected KEY=VALUE"),
    ("negative steps", ["start", "tiny", "--steps", "-1"], "train.steps=-1"),
    ("unknown job", ["pause", "nosuchjob"], "NOT_FOUND: no job named 'nosuchjob'"),
    ("path traversal", ["logs", "../x"], "INVALID_ARGUMENT: job name '../x' is not allowed"),
    ("non-numeric step", ["rollback", "j", "last"], "invalid int value"),
]


@pytest.mark.parametrize("what,argv,needle", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_ctl_refusals_exit_2_with_one_message(daemon, what, argv, needle):
    r = daemon.ctl(*argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    still_serving(daemon)


@pytest.mark.parametrize("method, request_, needle", [
    ("WatchEvents", pb.WatchEventsRequest(name="", kinds=["x" * 1000] * 400),
     "unknown; use one of"),
    ("WatchEvents", pb.WatchEventsRequest(name="", kinds=[f"k\u00e9{i}" for i in range(20000)]),
     "unknown; use one of"),
    ("GetLogs", pb.GetLogsRequest(name="nosuchjob", source="x"), "no job named"),
])
def test_a_refusal_reaches_the_client_whatever_the_request_held(daemon, method, request_, needle):
    """Was: a refusal that quoted a huge request field (400 unknown event kinds of 1000
    characters) became a grpc-message header over the 16 KiB a client accepts, and the client
    got "Stream removed (received metadata size exceeds hard limit)" instead of the refusal.
    Every refusal is cut to fit, and the values it quotes are shortened."""
    with pytest.raises(grpc.RpcError) as err:
        call(daemon, method, request_)
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
        err.value.details()
    assert needle in err.value.details() and len(err.value.details()) < 4000, \
        err.value.details()[:300]
    still_serving(daemon)


def test_a_huge_logs_source_is_refused_readably(daemon):
    """GetLogs quoted its `source` whole in the refusal (the same metadata limit)."""
    job_name = "huge-source"
    channel, stub = daemon.stub()
    with channel:
        stub.StartJob(pb.StartJobRequest(config_json=tiny_job_json(name=job_name)), timeout=30,
                      metadata=daemon.md())
        for source in ("y" * 500_000, "rank:" + "9" * 500_000):
            try:
                stub.GetLogs(pb.GetLogsRequest(name=job_name, source=source), timeout=10,
                             metadata=daemon.md())
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.NOT_FOUND), e.details()[:300]
                assert "(500" in e.details() and len(e.details()) < 4000, e.details()[:300]
        stub.StopJob(pb.StopJobRequest(name=job_name, now=True), timeout=30,
                     metadata=daemon.md())
    still_serving(daemon)


@pytest.mark.timeout(300)
def test_export_checks_its_folder_and_tokenizer_before_downloading(daemon, tmp_path):
    """Was: `ds3dctl export JOB --format hf --tokenizer T` without --store dropped T for the
    job's data.tokenizer (none: the export went on without one, saying none was known); an
    --out that is a file or cannot be made was a traceback after the download; an empty --out
    (an unset shell variable) wrote into the current folder. All refused first, exit code 2."""
    job_name = "export-refusals"
    channel, stub = daemon.stub()
    with channel:
        stub.StartJob(pb.StartJobRequest(config_json=tiny_job_json(name=job_name)), timeout=30,
                      metadata=daemon.md())
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["--format", "hf", "--tokenizer", str(tmp_path / "no-tokenizer.json"),
          "--out", str(tmp_path / "hf")], f"tokenizer '{tmp_path / 'no-tokenizer.json'}' does "
         "not exist"),
        (["--out", str(a_file)], "is a file; give a folder"),
        (["--out", ""], "the export folder (--out) is empty"),
    ]
    try:
        for argv, needle in cases:
            r = daemon.ctl("export", job_name, *argv, timeout_s=180)
            assert r.returncode == 2, (argv, r.stdout, r.stderr)
            assert needle in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert a_file.read_text() == "x"
    finally:
        channel, stub = daemon.stub()
        with channel:
            stub.StopJob(pb.StopJobRequest(name=job_name, now=True), timeout=30,
                         metadata=daemon.md())


def test_followed_watches_past_the_limit_are_refused_and_every_other_call_is_answered(daemon):
    """Was: each WatchEvents with follow holds one of ds3dd's 32 RPC threads until its client
    leaves; 32 of them (forgotten `ds3dctl events -f`, dashboards) left none, and every other
    call (status, stop, health, the peers' calls) waited until its deadline. Past the limit a
    followed watch is refused RESOURCE_EXHAUSTED saying what to do, and the daemon answers."""
    from ds3d.daemon.server import FOLLOWED_WATCHES_MAX, RPC_THREADS

    channel, stub = daemon.stub()
    with channel:
        follow = pb.WatchEventsRequest(name="", follow=True, after_seq=2**62)
        watches = [stub.WatchEvents(follow, metadata=daemon.md())
                   for _ in range(RPC_THREADS + 4)]
        try:
            deadline = time.monotonic() + 20
            while sum(w.done() for w in watches) < len(watches) - FOLLOWED_WATCHES_MAX and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            refused = [w for w in watches if w.done()]
            assert len(refused) == len(watches) - FOLLOWED_WATCHES_MAX
            for w in refused:
                assert w.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, w.details()
                assert "event watches that follow are open" in w.details()
                assert "ds3dctl events --follow" in w.details()
            still_serving(daemon)
        finally:
            for w in watches:
                w.cancel()
        deadline = time.monotonic() + 20  # a left watch frees its slot within a second or so
        while True:
            try:
                list(stub.WatchEvents(follow, timeout=2, metadata=daemon.md()))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break  # served, following, until its deadline
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                    time.monotonic() < deadline, e.details()


def test_ds3dd_refuses_to_listen_beyond_loopback_without_tls(tmp_path):
    d = DaemonProc(tmp_path / "state")
    d.argv[d.argv.index("127.0.0.1:0")] = "0.0.0.0:0"
    import subprocess

    r = subprocess.run(d.argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "refusing to listen on '0.0.0.0:0'" in r.stderr and "--token-file" in r.stderr


def test_a_request_over_the_size_limit_names_the_flag(tmp_path):
    """gRPC's own refusal of a request over --max-request-bytes names no setting; ds3dctl
    says what to change. Nothing is created."""
    d = DaemonProc(tmp_path / "state", token=new_token(), args=["--max-request-bytes", "2000"])
    d.start()
    try:
        r = d.ctl("start", "tiny")
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "RESOURCE_EXHAUSTED" in r.stderr and "--max-request-bytes" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert d.ctl("list", "--all").stdout.count("tiny") == 0
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_refusals_about_an_existing_job(daemon):
    """Duplicate name, save/pause of a stopped job, rollback to a missing step, resume of a
    running job: each refused with FAILED_PRECONDITION / ALREADY_EXISTS / NOT_FOUND."""
    r = daemon.ctl("start", "tiny", "--name", "dup", "--steps", "1000")
    assert r.returncode == 0, r.stderr
    daemon.wait_state("dup", "RUNNING")

    r = daemon.ctl("start", "tiny", "--name", "dup")
    assert r.returncode == 2 and "ALREADY_EXISTS: a job named 'dup' already exists" in r.stderr
    r = daemon.ctl("resume", "dup")
    assert r.returncode == 2 and "FAILED_PRECONDITION: cannot resume job 'dup': it is " \
        "RUNNING" in r.stderr
    r = daemon.ctl("rollback", "dup", "999")
    assert r.returncode == 2 and "NOT_FOUND: job 'dup' has no checkpoint at step 999" in r.stderr

    assert daemon.ctl("stop", "dup", "--now").returncode == 0
    daemon.wait_state("dup", "STOPPED")
    for argv, needle in ((["pause", "dup"], "cannot pause job 'dup': it is STOPPED"),
                         (["save", "dup"], "cannot save job 'dup': it is STOPPED"),
                         (["stop", "dup"], "cannot stop job 'dup': it is STOPPED")):
        r = daemon.ctl(*argv)
        assert r.returncode == 2 and f"FAILED_PRECONDITION: {needle}" in r.stderr, r.stderr
    still_serving(daemon)


# ---- issue 17: hardening the boundaries ------------------------------------------------------

ISSUE17_REFUSED_STARTS = [
    ("1: lr Infinity", tiny_job_json(name="inf").replace('"lr": 0.003', '"lr": Infinity'),
     "train.lr=inf: must be a finite number"),
    ("1: weight_decay NaN", tiny_job_json(name="nan").replace('"weight_decay": 0.1',
                                                             '"weight_decay": NaN'),
     "train.weight_decay=nan: must be a finite number"),
    ("1: betas NaN", tiny_job_json(name="betas", train={"betas": [0.9, float("nan")]}),
     "train.betas.1=nan: must be a finite number"),
    ("2: steps 2**63", tiny_job_json(name="big", train={"steps": 2**63}),
     "train.steps=9223372036854775808"),
    ("2: steps 10**30", tiny_job_json(name="huge", train={"steps": 10**30}),
     "less than or equal to 1000000000"),
    ("3: trailing newline", tiny_job_json(name="nl\n"), "control character U+000A"),
    ("4: micro-batch 10**9", tiny_job_json(name="mb", train={"micro_batch_size": 10**9}),
     "train.micro_batch_size <= 65536"),
    ("4: tp true", tiny_job_json(name="tpb", parallel={"tp": True}), "true/false is not converted"),
    ("4: steps string", tiny_job_json(name="stepstr", train={"steps": "10"}),
     "a string is not converted"),
    ("4: duplicate hosts", tiny_job_json(name="hosts", launch={
        "nnodes": 2, "hosts": ["127.0.0.2:7531", "127.0.0.2:7531"]}, parallel={"dp": 2}),
     "listed more than once"),
]


@pytest.mark.parametrize("what,config_json,needle", ISSUE17_REFUSED_STARTS,
                         ids=[c[0] for c in ISSUE17_REFUSED_STARTS])
def test_issue17_refused_start_answers_invalid_argument_and_creates_nothing(
        daemon, what, config_json, needle):
    """Items 1-4: NaN, 2**63, "nl\\n", loose types, duplicate hosts: INVALID_ARGUMENT (not
    INTERNAL), no job row, no job folder, and every job RPC keeps answering."""
    before = sorted(p.name for p in (daemon.state_dir / "jobs").iterdir())
    with pytest.raises(grpc.RpcError) as e:
        call(daemon, "StartJob", pb.StartJobRequest(config_json=config_json))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert needle in e.value.details(), e.value.details()
    assert sorted(p.name for p in (daemon.state_dir / "jobs").iterdir()) == before
    name = json.loads(config_json.replace("Infinity", "1").replace("NaN", "1"))["name"]
    listed = call(daemon, "ListJobs", pb.ListJobsRequest(include_finished=True)).jobs
    assert name not in [j.spec.name for j in listed]
    with pytest.raises(grpc.RpcError) as e:
        call(daemon, "GetJob", pb.JobRef(name=name))
    assert e.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    still_serving(daemon)


def test_issue17_3_a_name_with_a_newline_is_refused_by_every_rpc(daemon):
    for method, request in (("GetJob", pb.JobRef(name="nl\n")),
                            ("StopJob", pb.StopJobRequest(name="nl\n")),
                            ("GetLogs", pb.GetLogsRequest(name="nl\n"))):
        with pytest.raises(grpc.RpcError) as e:
            call(daemon, method, request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "job name 'nl\\n' is not allowed" in e.value.details()


def test_issue17_5_refused_start_creates_nothing_in_the_store(daemon, tmp_path):
    """Item 5: the store check (which creates the job's prefix) runs after every other check."""
    store = tmp_path / "store"
    config_json = tiny_job_json(name="nostore", data={"source": str(tmp_path / "none.bin")},
                                checkpoint={"store": f"file://{store}"})
    with pytest.raises(grpc.RpcError) as e:
        call(daemon, "StartJob", pb.StartJobRequest(config_json=config_json))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not exist on this node" in e.value.details()
    assert not store.exists()


def _old_row(con: sqlite3.Connection, name: str, config_json: str, state: int, run_dir: str):
    """A job row as ds3dd before issue 17 wrote it (Store.create_job, then the supervisor's
    transitions): the configuration text as `cfg.dump_json()` made it."""
    now = time.time()
    con.execute("INSERT INTO jobs (name, config_json, state, desired_state, node, run_dir, "
                "created_at, updated_at, message) VALUES (?,?,?,?,?,?,?,?,?)",
                (name, config_json, state, 3, "test-node", run_dir, now, now, "accepted"))
    con.commit()


def _unvalidated_dump(**train) -> str:
    """What the old daemon stored for a request it should have refused: a JobConfig built
    without the checks (model_construct), dumped as `service.start` dumped it."""
    from ds3d.trainer.config import build_job_config

    cfg = build_job_config("tiny")
    bad = cfg.train.model_construct(**{**cfg.train.__dict__, **train})
    return cfg.model_construct(**{**cfg.__dict__, "train": bad}).dump_json()


def test_issue17_1_unreadable_stored_jobs_are_quarantined_and_the_daemon_serves(tmp_path):
    """Items 1-2 (and 5): rows an older ds3dd stored for `lr = inf` and `steps = 2**63` (with
    its checks, the stored text is `"lr": null`, `"steps": 9223372036854775808`) no longer
    take down the daemon: it starts, both jobs end FAILED with the cause, GetJob / ListJobs /
    StopJob answer, and a new job of one of those names is refused without touching the
    store."""
    state = tmp_path / "state"
    d = DaemonProc(state)
    d.start()
    d.stop()
    assert "null" in _unvalidated_dump(lr=float("inf"))
    con = sqlite3.connect(state / "ds3d.db")
    _old_row(con, "inflr", _unvalidated_dump(lr=float("inf")), 3, str(state / "jobs/inflr"))
    _old_row(con, "bigsteps", _unvalidated_dump(steps=2**63), 4, str(state / "jobs/bigsteps"))
    con.close()

    with DaemonProc(state) as d:
        for name, was in (("inflr", "RUNNING"), ("bigsteps", "PAUSED")):
            job = call(d, "GetJob", pb.JobRef(name=name)).job
            assert job.state == pb.FAILED
            assert f"quarantined at daemon start (was {was})" in job.message
            assert ("train.lr=None" if name == "inflr" else "train.steps=9223372036854775808") \
                in job.message
            assert job.spec.name == name and job.spec.config_json
            with pytest.raises(grpc.RpcError) as e:
                call(d, "StopJob", pb.StopJobRequest(name=name))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            events = call(d, "WatchEvents", pb.WatchEventsRequest(name=name))
            assert [e.cause for e in events if e.kind == "state"][-1] == "quarantined"
        names = [j.spec.name for j in call(d, "ListJobs",
                                            pb.ListJobsRequest(include_finished=True)).jobs]
        assert sorted(names) == ["bigsteps", "inflr"]
        assert "FAILED" in d.ctl("list", "--all").stdout
        store = tmp_path / "store"
        with pytest.raises(grpc.RpcError) as e:
            call(d, "StartJob", pb.StartJobRequest(config_json=tiny_job_json(
                name="inflr", checkpoint={"store": f"file://{store}"})))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert not store.exists()
        still_serving(d)
    with DaemonProc(state) as d:  # a second start: nothing quarantined twice
        events = call(d, "WatchEvents", pb.WatchEventsRequest(name="inflr"))
        assert sum(e.cause == "quarantined" for e in events) == 1
        still_serving(d)


def _one_line_refusal(argv: list[str], needle: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_issue17_6_listen_port_out_of_range_is_one_line_and_exit_2(tmp_path):
    d = DaemonProc(tmp_path / "state", listen="127.0.0.1:99999")
    _one_line_refusal(d.argv, "--listen '127.0.0.1:99999': use HOST:PORT with a port from 1 "
                      "to 65535")


def test_issue17_6_listen_port_in_use_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        d = DaemonProc(tmp_path / "state", listen=f"127.0.0.1:{port}")
        _one_line_refusal(d.argv, f"port {port} is already in use")


def test_a_metrics_port_in_use_names_the_port_and_the_flag(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        d = DaemonProc(tmp_path / "state", args=["--metrics-port", str(port)])
        r = subprocess.run(d.argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.splitlines()[-1] == (
            f"ds3dd: cannot serve metrics on 127.0.0.1:{port} (it is already in use); give "
            "another --metrics-port (0 picks a free one)"), r.stderr
        assert "Traceback" not in r.stderr + r.stdout


CONTROL_METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Control"].methods]


def test_issue17_10_undecodable_bytes_are_invalid_argument_for_every_rpc(daemon):
    """Item 10: grpcio answers a request it cannot deserialize with INTERNAL; ds3dd says
    INVALID_ARGUMENT (the client's error), on every Control method and on health."""
    channel = grpc.insecure_channel(daemon.addr)
    with channel:
        for method in CONTROL_METHODS:
            desc = pb.DESCRIPTOR.services_by_name["Control"].methods_by_name[method]
            path = f"/ds3d.v1.Control/{method}"
            fn = channel.unary_stream(path) if desc.server_streaming else \
                channel.unary_unary(path)
            # node-to-node RPCs are authorised before their bytes are read: the peer credential
            md = [("authorization", f"Bearer {daemon.peer_token}")] if path in PEER_METHODS \
                else daemon.md()
            with pytest.raises(grpc.RpcError) as e:
                r = fn(b"\x0a\xff\xff\xff\x0f", timeout=10, metadata=md)
                list(r) if desc.server_streaming else None
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
            assert f"not a valid {method} message" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff", timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    still_serving(daemon)


def test_issue17_10_reflection_v1_beside_v1alpha(daemon):
    from grpc_reflection.v1alpha import reflection_pb2 as r

    channel = grpc.insecure_channel(daemon.addr)
    with channel:
        for version in ("v1", "v1alpha"):
            info = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=r.ServerReflectionRequest.SerializeToString,
                response_deserializer=r.ServerReflectionResponse.FromString)
            answers = list(info(iter([r.ServerReflectionRequest(list_services=""),
                                      r.ServerReflectionRequest(
                                          file_containing_symbol="ds3d.v1.Control")]),
                                timeout=10, metadata=daemon.md()))
            services = {s.name for s in answers[0].list_services_response.service}
            assert {"ds3d.v1.Control", "grpc.health.v1.Health",
                    "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection"} <= services, (version, services)
            assert answers[1].file_descriptor_response.file_descriptor_proto, version


@pytest.mark.timeout(180)
def test_issue17_10_health_is_not_serving_while_draining(tmp_path):
    """Item 10: from SIGTERM on, while the daemon pauses its jobs, health says NOT_SERVING."""
    d = DaemonProc(tmp_path / "state", worker_dir=tmp_path / "worker",
                   extra_env={"FAKE_STEP_S": "1.0"}, args=["--drain-timeout", "60"])
    with d:
        call(d, "StartJob", pb.StartJobRequest(config_json=tiny_job_json(
            name="drainme", train={"steps": 1000})))
        deadline = time.monotonic() + 120
        while call(d, "GetJob", pb.JobRef(name="drainme")).job.state != pb.RUNNING:
            assert time.monotonic() < deadline, "drainme never RUNNING"
            time.sleep(0.3)
        channel = grpc.insecure_channel(d.addr)
        seen: list[int] = []
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="ds3d.v1.Control"), timeout=60)
        first = next(stream)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        d.proc.terminate()  # SIGTERM: drain
        try:
            for update in stream:
                seen.append(update.status)
                if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        except grpc.RpcError:
            pass
        assert seen and seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, seen
        assert d.proc.poll() is None  # still draining when it said so
        d.proc.wait(60)
        channel.close()
