"""The bad-input table: malformed requests and configurations against a real ds3dd, each
answered with the right status code and an actionable message — and the daemon still serves.

Cases that need an existing job (duplicate name, pause of a stopped job, rollback to a missing
step) start one through the real elastic agent with the stand-in worker (slow, serialised with
`flock /tmp/ds3d-heavy.lock`)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
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


def test_ds3dd_refuses_to_listen_beyond_loopback_without_tls(tmp_path):
    d = DaemonProc(tmp_path / "state")
    d.argv[d.argv.index("127.0.0.1:0")] = "0.0.0.0:0"
    import subprocess

    r = subprocess.run(d.argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "refusing to listen on '0.0.0.0:0'" in r.stderr and "--token-file" in r.stderr


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
