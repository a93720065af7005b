"""The etcd rendezvous mode (`launch.rendezvous = "etcd://..."`) against a real etcd server.

Two daemons on loopback (127.0.0.1 and 127.0.0.2, as test_multinode_daemons.py) run one 2-node
job whose agents meet through torch elastic's own etcd rendezvous ("etcd-v2"): the head starts
no store process, and etcd's own record shows both nodes in the rendezvous. An etcd that does
not answer, or answers without the v2 API, refuses the job at `ds3dctl start`. The fixture's
3-member cluster is checked here too (it is the base of the leadership work of issue 23).

Heavy: run serialised,
`flock /tmp/ds3d-heavy.lock .venv/bin/pytest -q tests/integration/test_etcd_rendezvous.py`."""

from __future__ import annotations

import json
import math
import pickle
from base64 import b64decode
from pathlib import Path

import pytest

from fixtures.s3 import free_port
from test_daemon_support import DaemonProc, kill_job_processes, loopback_nodes, new_token

pytest_plugins = ["fixtures.etcd"]
pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(600)]

RDZV_PREFIX = "/torch/elastic/rendezvous"  # torch's etcd_rendezvous_backend.create_backend
STORE_PREFIX = "/torch/elastic/store"


def test_cluster_fixture_keeps_serving_after_a_member_stops(etcd_cluster):
    members = etcd_cluster(3)
    client = members[0].client()
    assert sorted(client.machines) == sorted(f"http://{m.endpoint}" for m in members)
    client.write("/ds3d/probe", "1")
    members[0].stop()
    # quorum reads: a plain v2 read is answered from the member's own copy, which may not have
    # applied the write yet (CI of 12-06 read "1" after the "2" was written)
    assert members[1].client().read("/ds3d/probe", quorum=True).value == "1"  # 2 of 3: a quorum
    members[2].client().write("/ds3d/probe", "2")
    assert members[1].client().read("/ds3d/probe", quorum=True).value == "2"


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProc(tmp_path / "d", token=new_token(), node="node-a")
    d.start()
    yield d
    d.stop()
    kill_job_processes(d.state_dir)


def _refused(d: DaemonProc, rendezvous: str) -> str:
    r = d.ctl("start", "tiny", "--name", "er", "--steps", "2",
              "--set", f"launch.rendezvous={rendezvous}")
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    assert "launch.rendezvous" in r.stderr, r.stderr
    return r.stderr


def test_start_refuses_an_etcd_that_cannot_hold_the_rendezvous(daemon, etcd_cluster):
    silent = free_port()  # nothing listens there
    err = _refused(daemon, f"etcd://127.0.0.1:{silent}")
    assert f"127.0.0.1:{silent} does not answer" in err and "was not started" in err, err
    (no_v2,) = etcd_cluster(1, enable_v2=False)
    assert "--enable-v2" in _refused(daemon, no_v2.url)
    assert "is not an etcd URL" in _refused(daemon, "http://127.0.0.1:2379")
    assert "outside 1-65535" in _refused(daemon, "etcd://127.0.0.1:70000")
    assert daemon.ctl("status", "er", "--json").returncode != 0  # no job was created


def _rendezvous_state(value: str):
    """torch's _RendezvousState as the backend stores it: base64 of a pickle."""
    return pickle.loads(b64decode(value))


@pytest.fixture
def nodes(tmp_path):
    with loopback_nodes(tmp_path) as pair:
        yield pair


def test_two_daemons_meet_through_etcd(etcd_server, nodes, tmp_path):
    a, b = nodes  # (etcd first: it outlives the daemons at teardown)
    store = tmp_path / "shared-store"
    r = a.ctl("start", "tiny", "--name", "me", "--dp", "2", "--steps", "30",
              "--hosts", f"{a.addr},{b.addr}", "--store", f"file://{store}",
              "--set", f"launch.rendezvous={etcd_server.url}")
    assert r.returncode == 0, r.stderr

    running = a.wait_for("me", lambda j: j["step"] >= 1 or j["state"] in ("FAILED", "COMPLETED"),
                         "step 1", timeout_s=300)
    assert running["state"] in ("RUNNING", "COMPLETED"), a.ctl("logs", "me").stdout[-5000:]
    # etcd's own record, read once training runs: the rendezvous of attempt 1, complete, with
    # one participant per node (both still in it: neither was dropped for a late heartbeat)
    head_dir, share_dir = Path(running["run_dir"]), b.state_dir / "shares" / "me"
    run_id = json.loads((head_dir / "control" / "agent-1.json").read_text())["run_id"]
    node = etcd_server.client().read(f"{RDZV_PREFIX}/{run_id}")
    state = _rendezvous_state(node.value)
    assert state.round == 0 and state.complete, vars(state)
    assert sorted(n.addr for n in state.participants) == ["127.0.0.1", "127.0.0.2"], vars(state)
    # ... and the agents' shared store (torch's EtcdStore: base64 key names under one prefix):
    # each node's role info and the assigned ranks, under this rendezvous' round 0
    stored = {b64decode(n.key.rsplit("/", 1)[1]).decode() for n in etcd_server.client().read(
        STORE_PREFIX, recursive=True).leaves}
    round0 = f"torch.rendezvous.{run_id}.0/torchelastic"
    assert {f"{round0}/role_info/0", f"{round0}/role_info/1", f"{round0}/assigned_ranks/0",
            f"{round0}/assigned_ranks/1"} <= stored, stored

    done = a.wait_state("me", "COMPLETED", "FAILED", timeout_s=300)
    assert done["state"] == "COMPLETED", a.ctl("logs", "me").stdout[-5000:]
    assert done["step"] == 30 and done["world_size"] == 2 and math.isfinite(done["loss"])

    # the head hosted no rendezvous store: both agents were pointed at etcd
    assert not (head_dir / "control" / "rdzv.port").exists()
    assert not (head_dir / "logs" / "rendezvous.log").exists()
    assert run_id.startswith("me-") and run_id.endswith("-a1") and run_id != "me-a1"
    for run_dir in (head_dir, share_dir):
        spec = json.loads((run_dir / "control" / "agent-1.json").read_text())
        assert spec["rdzv_backend"] == "etcd-v2", spec
        assert spec["rdzv_endpoint"] == etcd_server.endpoint and spec["run_id"] == run_id
        assert "is_host" not in spec["rdzv_configs"]
