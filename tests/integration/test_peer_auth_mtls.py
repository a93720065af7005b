"""Peers and clients are different principals (issue 17 items 9 and 10).

A two-daemon job over mutual TLS with certificates made here (a CA, one certificate per daemon
with its loopback IP as subject alternative name, one client certificate), daemons on 127.0.0.1
and 127.0.0.2 only, peers recognised by certificate name (--peer-names); the node-to-node RPCs
called with the client's certificate are refused. Then the token rules on loopback: a wrong
token is UNAUTHENTICATED, a client token on a peer RPC PERMISSION_DENIED, a daemon without a
peer credential accepts StartShare from nobody, StartShare validates the job like StartJob,
ShareControl writes no inject.json without --enable-fault-injection.

Heavy (real ds3dd, agents): `flock /tmp/ds3d-heavy.lock .venv/bin/pytest -q
tests/integration/test_peer_auth_mtls.py`
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ds3d.trainer.config import build_job_config

from test_daemon_support import (
    DaemonProc,
    kill_job_processes,
    new_token,
    pb,
    pb_grpc,
    tiny_job_json,
)

PEER_RPCS = {
    "StartShare": lambda cfg: pb.StartShareRequest(config_json=cfg, head_node="evil",
                                                   rdzv_endpoint="127.0.0.1:1", run_id="x",
                                                   attempt=1),
    "ShareControl": lambda cfg: pb.ShareControlRequest(name="mtls", file="inject.json",
                                                       text='{"kind": "crash"}'),
    "StopShare": lambda cfg: pb.StopShareRequest(name="mtls", now=True),
    "PullReports": lambda cfg: pb.PullReportsRequest(name="mtls"),
    "NodeStatus": lambda cfg: pb.NodeStatusRequest(),
}


# ---- certificates ---------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(folder: Path, stem: str, key, cert) -> tuple[Path, Path]:
    k, c = folder / f"{stem}.key", folder / f"{stem}.pem"
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return c, k


def make_pki(folder: Path) -> dict[str, tuple[Path, Path]]:
    """A CA and certificates for node-a (127.0.0.1), node-b (127.0.0.2) and a client; each
    usable for both TLS ends (a daemon serves and calls its peers with one certificate)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("ds3d-test-ca"))
          .issuer_name(_name("ds3d-test-ca")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(1))
          .not_valid_after(now + dt.timedelta(1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": _write(folder, "ca", ca_key, ca)}
    for cn, ip in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2"), ("ds3dctl-user", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(cn)]
        if ip:
            sans.append(x509.IPAddress(ipaddress.ip_address(ip)))
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(1)).not_valid_after(now + dt.timedelta(1))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        out[cn] = _write(folder, cn, key, cert)
    return out


def tls_stub(addr: str, pki: dict, who: str) -> tuple[grpc.Channel, pb_grpc.ControlStub]:
    cert, key = pki[who]
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"][0].read_bytes(),
                                         private_key=key.read_bytes(),
                                         certificate_chain=cert.read_bytes())
    channel = grpc.secure_channel(addr, creds)
    return channel, pb_grpc.ControlStub(channel)


def code_of(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    """The status and details `fn(*args, **kwargs)` is refused with (it must be refused)."""
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kwargs)
    return e.value.code(), e.value.details()


# ---- a two-daemon job over mutual TLS --------------------------------------------------------

@pytest.mark.timeout(300)
def test_two_daemon_job_over_mutual_tls_and_peer_rpcs_refused_to_a_client(tmp_path):
    pki = make_pki(tmp_path)
    daemons = []
    for node, ip in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
        cert, key = pki[node]
        daemons.append(DaemonProc(
            tmp_path / node, node=node, listen=f"{ip}:0", worker_dir=tmp_path / "worker",
            extra_env={"FAKE_STEP_S": "0.05"},
            args=["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(pki["ca"][0]),
                  "--peer-names", "node-a,node-b", "--rdzv-host", "127.0.0.1",
                  "--node-addr", ip, "--hang-timeout", "120"]))
    a, b = daemons
    try:
        for d in daemons:
            d.start()
        assert a.addr.startswith("127.0.0.1:") and b.addr.startswith("127.0.0.2:")
        cfg = build_job_config("tiny", [
            "parallel.dp=2", "launch.nnodes=2", f"launch.hosts={json.dumps([a.addr, b.addr])}",
            "train.steps=20", f"checkpoint.store={json.dumps(f'file://{tmp_path}/store')}"],
            name="mtls").dump_json()
        channel, stub = tls_stub(a.addr, pki, "ds3dctl-user")
        with channel:
            stub.StartJob(pb.StartJobRequest(config_json=cfg), timeout=60)
            deadline, job = time.monotonic() + 200, None
            while time.monotonic() < deadline:
                job = stub.GetJob(pb.JobRef(name="mtls"), timeout=30).job
                if job.state in (pb.COMPLETED, pb.FAILED):
                    break
                time.sleep(0.5)
            assert job is not None and job.state == pb.COMPLETED, job
            assert job.world_size == 2 and job.step == 20, job
            events = list(stub.WatchEvents(pb.WatchEventsRequest(name="mtls"), timeout=30))
            assert any(e.kind == "share" and "node-b" in e.message for e in events), \
                [e.message for e in events]
        # the share on B ran: the head's StartShare, over mutual TLS as node-a, was accepted
        assert (b.state_dir / "shares" / "mtls" / "job.json").is_file()

        # the same node-to-node RPCs with the client's certificate: refused, nothing started
        channel, stub = tls_stub(b.addr, pki, "ds3dctl-user")
        with channel:
            for rpc, request in PEER_RPCS.items():
                code, details = code_of(getattr(stub, rpc), request(cfg), timeout=30)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (rpc, code, details)
                assert "ds3dctl-user" in details and "not a peer's" in details, details
            # the client's own RPCs still work with that certificate
            assert stub.ListJobs(pb.ListJobsRequest(include_finished=True), timeout=30)
        assert not (b.state_dir / "shares" / "mtls" / "control" / "inject.json").exists()
    finally:
        for d in daemons:
            d.stop()
        for d in daemons:
            kill_job_processes(d.state_dir)


# ---- token rules on loopback (regressions for items 9 and 10) --------------------------------

@pytest.fixture
def peered(tmp_path):
    """A loopback daemon with a client token and a peer token, fault injection off."""
    with DaemonProc(tmp_path / "state", token=new_token()) as d:
        yield d


def _call(d: DaemonProc, rpc: str, request, token: str | None):
    channel, stub = d.stub()
    with channel:
        md = [("authorization", f"Bearer {token}")] if token else []
        return getattr(stub, rpc)(request, metadata=md, timeout=30)


def test_issue17_10_wrong_token_is_unauthenticated_client_token_on_peer_rpc_is_denied(peered):
    d = peered
    valid = tiny_job_json()
    for rpc, request in PEER_RPCS.items():
        code, details = code_of(_call, d, rpc, request(valid), "wrong-token-0123456789")
        assert code == grpc.StatusCode.UNAUTHENTICATED and "token is wrong" in details, details
        code, details = code_of(_call, d, rpc, request(valid), None)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "peer token" in details, details
        code, details = code_of(_call, d, rpc, request(valid), d.token)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (rpc, details)
        assert "client credential cannot" in details, details
    # the peer token is no client credential
    code, details = code_of(_call, d, "ListJobs", pb.ListJobsRequest(), d.peer_token)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "node-to-node calls only" in details
    # and with the right principal the peer RPCs answer
    status = _call(d, "NodeStatus", pb.NodeStatusRequest(), d.peer_token)
    assert status.node == "test-node"


def test_issue17_9_start_share_validates_the_job_and_inject_needs_the_flag(peered):
    d = peered
    bad = json.loads(tiny_job_json())
    bad["train"]["lr"] = "Infinity"
    code, details = code_of(_call, d, "StartShare", PEER_RPCS["StartShare"](json.dumps(bad)),
                            d.peer_token)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert not (d.state_dir / "shares").exists() or not any((d.state_dir / "shares").iterdir())
    code, details = code_of(_call, d, "ShareControl", PEER_RPCS["ShareControl"](""),
                            d.peer_token)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "--enable-fault-injection" in details


def test_issue17_9_loopback_daemon_without_peer_credential_accepts_no_start_share(tmp_path):
    with DaemonProc(tmp_path / "state") as d:  # no client token, no peer token: a local setup
        assert _call(d, "ListJobs", pb.ListJobsRequest(), None) is not None  # clients: as before
        for rpc, request in PEER_RPCS.items():
            code, details = code_of(_call, d, rpc, request(tiny_job_json()), None)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (rpc, details)
            assert "--peer-token-file" in details, details
        assert not (d.state_dir / "shares").exists() or \
            not any((d.state_dir / "shares").iterdir())
