"""The rendezvous of a job: by default a c10d store hosted in a process of its own on the head
node; with `launch.rendezvous = "etcd://..."` torch elastic's own etcd rendezvous (no process
here: `etcd_endpoint` picks the member the agents connect to, `etcd_problem` is the preflight).

Why not inside an elastic agent (torchrun's default): killing the agent that hosts the c10d
store ends the job for every node (FIELD-NOTES, "Node loss with c10d rendezvous"). This process
does nothing but hold a `TCPStore` server, so agents (and their nodes) can die and come back
while the rendezvous survives; every agent connects to it as a client (`is_host=False`).

It runs in its own session like the agents, and is recorded by pid + start time, so it also
outlives a restart of ds3dd. Run as `python -m ds3d.daemon.rendezvous --host H --port-file F`.
The store has no authentication: it listens on `--host` only (`listening_socket`), which is
loopback for single-node jobs and should be the cluster's private network otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from ds3d.trainer.errors import Ds3dError

from .procs import ProcessRef, exit_without_teardown, spawn_detached, stop_on_signals


class RendezvousError(Ds3dError):
    grpc_code = "UNAVAILABLE"
    retryable = True


# torch elastic's dynamic rendezvous on etcd's v2 API (etcd_rendezvous_backend.py, python-etcd);
# "etcd" would be the legacy rendezvous, which has no keep-alive and so no fast node-loss shrink
ETCD_BACKEND = "etcd-v2"
ETCD_PROBE_S = 3.0


def etcd_problem(host: str, port: int, timeout_s: float = ETCD_PROBE_S) -> str | None:
    """Why the etcd member at host:port cannot hold a rendezvous (None: it can). It must answer
    over HTTP and serve the v2 keys API, which etcd 3.4 serves only when started with
    `--enable-v2`."""
    import urllib.error
    import urllib.request

    url = f"http://{host}:{port}/v2/keys/"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            resp.read(4096)
        return None
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return (f"etcd at {host}:{port} answers but does not serve the v2 API that torch "
                    "elastic's etcd rendezvous uses; start it with --enable-v2")
        return f"etcd at {host}:{port} answered {url} with HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return f"etcd at {host}:{port} does not answer ({reason})"


def etcd_endpoint(endpoints: list[tuple[str, int]]) -> str:
    """The first member of `launch.rendezvous` that answers, as torch elastic's `rdzv_endpoint`
    (it takes one; python-etcd, with `allow_reconnect`, then learns the cluster's other members
    and fails over to them). Raises RendezvousError listing every member's problem."""
    problems = []
    for host, port in endpoints:
        problem = etcd_problem(host, port)
        if problem is None:
            return f"{host}:{port}"
        problems.append(problem)
    raise RendezvousError("no member of launch.rendezvous can hold the rendezvous: " +
                          "; ".join(problems))


def rendezvous_run_id(job: str, attempt: int, job_id: str, etcd: bool) -> str:
    """torch elastic's run id of one attempt. On etcd it also carries the job's unique id: the
    etcd cluster outlives jobs (a rendezvous key lives 2 h), and a job started again under the
    same name must not find the closed rendezvous of its predecessor's attempt."""
    return f"{job}-{job_id[:12]}-a{attempt}" if etcd and job_id else f"{job}-a{attempt}"


def stray_stores(port_file: Path) -> list[ProcessRef]:
    """Store processes serving `port_file`'s job, found by their command line. The daemon
    records a store once it listens; one it started but did not record (the daemon was killed
    in between) would otherwise run on, listening, beside the one its successor starts."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        argv = p.info["cmdline"] or []
        if "ds3d.daemon.rendezvous" in argv and str(port_file) in argv:
            out.append(ProcessRef(p.pid, p.info["create_time"]))
    return out


def start_store(run_dir: Path, host: str, timeout_s: float = 120.0) -> tuple[ProcessRef, int]:
    """Starts the store process for a job and waits until it listens; returns it and its port.
    Called when the job's recorded store is gone: any other store of the job is a stray
    (`stray_stores`) and is ended first (no agent was given its address: agents start after
    their store is recorded)."""
    control = run_dir / "control"
    control.mkdir(parents=True, exist_ok=True)
    port_file = control / "rdzv.port"
    for stray in stray_stores(port_file):
        stray.terminate(grace_s=2)
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "ds3d.daemon.rendezvous", "--host", host,
            "--port-file", str(port_file)]
    proc, ref = spawn_detached(argv, run_dir / "logs" / "rendezvous.log", dict(os.environ),
                               run_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return ref, int(port_file.read_text())
        if proc.poll() is not None:
            raise RendezvousError(f"the rendezvous store process exited with code "
                                  f"{proc.returncode}; see {run_dir}/logs/rendezvous.log")
        time.sleep(0.1)
    ref.terminate(grace_s=2)
    raise RendezvousError(f"the rendezvous store did not start within {timeout_s:.0f} s; see "
                          f"{run_dir}/logs/rendezvous.log")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `host` only. TCPStore's server binds every interface whatever
    host it is given (an unauthenticated store reachable from other machines although ds3dd
    listens on loopback); handed this socket (`master_listen_fd`) it serves on it instead."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address[:2], family=family, backlog=1024)


def serve(host: str, port: int, port_file: Path) -> None:
    """Holds the TCPStore server until SIGTERM/SIGINT."""
    from datetime import timedelta

    import torch.distributed as dist

    listener = listening_socket(host, port)
    tcp_store = dist.TCPStore  # type: ignore[attr-defined]  # public, not in torch's __all__
    store = tcp_store(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=300), master_listen_fd=listener.detach())
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(store.port))
    os.replace(tmp, port_file)
    print(f"rendezvous store listening on {host}:{store.port}", flush=True)
    stop = stop_on_signals()
    while not stop.wait(0.5):
        pass
    del store
    exit_without_teardown(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ds3d.daemon.rendezvous",
                                 description="host a c10d TCPStore for one ds3d job")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--port-file", type=Path, required=True,
                    help="where to write the bound port once listening")
    a = ap.parse_args(argv)
    serve(a.host, a.port, a.port_file)


if __name__ == "__main__":
    main()
