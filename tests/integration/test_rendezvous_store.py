"""The job's rendezvous store process (daemon/rendezvous.py) listens on the host it was given
only: torch's TCPStore server binds every interface by itself, so an unauthenticated store was
reachable from other machines while ds3dd listened on loopback (a hostile-client probe,
2026-12-06, saw `*:PORT`)."""

from __future__ import annotations

import psutil

from ds3d.daemon.rendezvous import start_store


def test_the_store_listens_on_its_host_only_and_serves_there(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist

    ref, port = start_store(tmp_path, "127.0.0.1", timeout_s=60)
    try:
        listening = [c.laddr for c in psutil.Process(ref.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        assert port in {addr.port for addr in listening}
        client = dist.TCPStore("127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                               timeout=timedelta(seconds=30))
        client.set("key", "value")
        assert client.get("key") == b"value"
    finally:
        ref.terminate(grace_s=5)


def test_a_store_started_but_never_recorded_is_ended_by_the_next_start(tmp_path):
    """A probe SIGKILLed ds3dd right after StartJob: the store it had spawned (not yet recorded)
    ran on, listening, beside the one the restarted daemon started. The next start of the
    job's store ends such strays first."""
    first, _ = start_store(tmp_path, "127.0.0.1", timeout_s=60)
    second = None
    try:
        second, port = start_store(tmp_path, "127.0.0.1", timeout_s=60)
        assert not first.alive() and second.alive()
        assert [c.laddr.port for c in psutil.Process(second.pid).net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN] == [port]
    finally:
        for ref in (first, second):
            if ref is not None:
                ref.terminate(grace_s=5)
