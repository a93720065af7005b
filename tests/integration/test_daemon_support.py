"""Helpers for the daemon integration tests (no tests here): run the real `ds3dd` as a
subprocess, drive it with the real `ds3dctl`, and a contract-following stand-in worker.

The stand-in worker exists so that lifecycle tests exercise the real elastic agent, rendezvous
process, command files and report tailing in seconds instead of DeepSpeed start-up minutes; the
production launcher still runs `ds3d.trainer.worker` (ds3dd's hidden --worker-module flag is how
the tests swap it).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil

from ds3d.v1 import control_pb2 as pb
from ds3d.v1 import control_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent

FAKE_WORKER = r'''
"""Stand-in worker following the job-directory contract (daemon/jobdir.py), no torch."""
import json, os, sys, time
from pathlib import Path

run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
world = int(os.environ["WORLD_SIZE"])
cfg = json.loads((run_dir / "job.json").read_text())
steps = cfg["train"]["steps"]
step_s = float(os.environ.get("FAKE_STEP_S", "0.2"))
ckpt = run_dir / "ckpt"
(run_dir / "reports").mkdir(exist_ok=True)
fh = open(run_dir / "reports" / f"rank-{rank:05d}.jsonl", "a", buffering=1)

def emit(kind, **f):
    fh.write(json.dumps({"kind": kind, "time": time.time(), "rank": rank, "restart": restart,
                         "node": "test", "pid": os.getpid(), **f}) + "\n")

def saved_steps():
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))

def save(step):
    (ckpt / f"step-{step}").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        emit("checkpoint", step=step, phase="saved", path=str(ckpt / f"step-{step}"),
             blocked_s=0.01)

restore = run_dir / "control" / "restore.json"
have = saved_steps()
step = json.loads(restore.read_text())["step"] if restore.exists() else (have[-1] if have else 0)
emit("start", step=step, world_size=world, tp=1, pp=1, dp=world)
seen = 0
crash_marker = run_dir / "crashed-once"
while True:
    try:
        cmd = json.loads((run_dir / "control" / "command.json").read_text())
    except (FileNotFoundError, ValueError):
        cmd = {"id": 0}
    if cmd["id"] > seen:
        seen = cmd["id"]
        if cmd["action"] != "stop_now":
            save(step)
        emit("command", id=cmd["id"], action=cmd["action"], status="done", step=step)
        if cmd["action"] in ("pause", "stop", "stop_now"):
            emit("done", step=step, reason="paused" if cmd["action"] == "pause" else "stopped")
            sys.exit(0)
    if step >= steps:
        save(step)
        emit("done", step=step, reason="completed")
        sys.exit(0)
    crash_at = int(os.environ.get("FAKE_CRASH_AT_STEP", "-1"))
    if step == crash_at and rank == 0 and not crash_marker.exists():
        crash_marker.write_text("x")
        sys.exit(3)
    time.sleep(step_s)
    step += 1
    if rank == 0:
        emit("step", step=step, loss=10.0 / step, tokens_per_s=1000.0, step_time_s=step_s)
    emit("heartbeat", step=step, phase="train")
'''


def write_fake_worker(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ds3d_fake_worker.py").write_text(FAKE_WORKER)
    return "ds3d_fake_worker"


class DaemonProc:
    """A real ds3dd subprocess on a free loopback port; `stop()`/`kill()` always clean up."""

    def __init__(self, state_dir: Path, *, token: str | None = None,
                 worker_dir: Path | None = None, extra_env: dict[str, str] | None = None,
                 args: list[str] | None = None, listen: str = "127.0.0.1:0",
                 node: str = "test-node", peer_token: str | None = None) -> None:
        """`peer_token` (default: derived from `token`, so daemons given the same token are
        peers of one another) is the node-to-node credential (ds3dd --peer-token-file)."""
        self.state_dir = state_dir
        self.token = token
        self.env = dict(os.environ)
        self.env.update(extra_env or {})
        args = list(args or [])
        if "--drain-timeout" not in args:  # teardown leaves jobs to kill_job_processes
            args += ["--drain-timeout", "0"]
        self.argv = [str(BIN / "ds3dd"), "--state-dir", str(state_dir), "--listen",
                     listen, "--node-name", node, *args]
        if token:
            tf = state_dir.parent / f"{state_dir.name}.token"
            tf.write_text(token)
            self.argv += ["--token-file", str(tf)]
            self.token_file = tf
        self.peer_token = peer_token or (f"{token}.peer" if token else None)
        if self.peer_token:
            pf = state_dir.parent / f"{state_dir.name}.peer-token"
            pf.write_text(self.peer_token)
            self.argv += ["--peer-token-file", str(pf)]
        if worker_dir is not None:
            self.argv += ["--worker-module", write_fake_worker(worker_dir)]
            self.env["PYTHONPATH"] = f"{worker_dir}:{self.env.get('PYTHONPATH', '')}"
        self.proc: subprocess.Popen[str] | None = None
        self.addr = ""
        self._channel: tuple[str, grpc.Channel, pb_grpc.ControlStub] | None = None

    def start(self, timeout_s: float = 30.0) -> DaemonProc:
        addr_file = self.state_dir / "ds3dd.addr"
        addr_file.unlink(missing_ok=True)
        # stdout to a file, not a pipe: a pipe nobody reads fills (64 KiB) and then blocks the
        # daemon inside its logger, hanging every RPC of a long or chatty test
        self.output = self.state_dir.parent / f"{self.state_dir.name}.stdout"
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        while not addr_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"ds3dd exited: {self.output.read_text(errors='replace')}")
            if time.monotonic() > deadline:
                raise TimeoutError("ds3dd did not start")
            time.sleep(0.05)
        self.addr = addr_file.read_text()
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> DaemonProc:
        return self.start()

    def __exit__(self, *exc) -> None:
        """Stops the daemon and ends every process its jobs left (agents, rendezvous)."""
        self.stop()
        kill_job_processes(self.state_dir)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel[1].close()
            self._channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def stub(self) -> tuple[grpc.Channel, pb_grpc.ControlStub]:
        channel = grpc.insecure_channel(self.addr)
        return channel, pb_grpc.ControlStub(channel)

    def md(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def ctl(self, *argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        env = dict(self.env)
        env["DS3D_ADDR"] = self.addr
        if self.token:
            env["DS3D_TOKEN"] = self.token
        return subprocess.run([str(BIN / "ds3dctl"), *argv], env=env, capture_output=True,
                              text=True, timeout=timeout_s)

    def job(self, name: str) -> dict:
        """`ds3dctl status NAME --json`'s fields, asked in-process: the waits poll this several
        times a second, and a ds3dctl process per poll (~0.25 CPU-s) took a quarter of a 2-core
        machine from the job under test (the CLI itself is driven by `ctl`)."""
        from ds3d.daemon.cli import job_dict

        try:
            job = self._polling_stub().GetJob(pb.JobRef(name=name), metadata=self.md(),
                                              timeout=30).job
        except grpc.RpcError as e:
            raise AssertionError(f"GetJob {name}: {e.code()}: {e.details()}") from None
        return job_dict(job)

    def _polling_stub(self) -> pb_grpc.ControlStub:
        """One channel to the daemon for the in-process polls (job, events), renewed when the
        daemon restarted on another address."""
        if self._channel is None or self._channel[0] != self.addr:
            if self._channel is not None:
                self._channel[1].close()
            channel = grpc.insecure_channel(self.addr)
            self._channel = (self.addr, channel, pb_grpc.ControlStub(channel))
        return self._channel[2]

    def wait_state(self, name: str, *states: str, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        job: dict = {}
        while time.monotonic() < deadline:
            job = self.job(name)
            if job["state"] in states:
                return job
            time.sleep(0.3)
        raise AssertionError(f"{name} not in {states} after {timeout_s} s: {job}"
                             + self.diagnostics(job))

    def wait_for(self, name: str, pred, what: str, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        job: dict = {}
        while time.monotonic() < deadline:
            job = self.job(name)
            if pred(job):
                return job
            time.sleep(0.3)
        raise AssertionError(f"{name}: {what} not reached after {timeout_s} s: {job}"
                             + self.diagnostics(job))

    def diagnostics(self, job: dict, lines: int = 25) -> str:
        """What a timed-out wait needs to be understood from a CI log alone: the tails of the
        daemon's log, the agent's log, every worker's stdout/stderr and every rank's reports."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # ds3dd's threads' stacks, to its stdout file
        files = [self.state_dir / "ds3dd.log", getattr(self, "output", None)]
        run_dir = Path(job.get("run_dir") or "/nonexistent")
        for pid in worker_procs(run_dir) if run_dir.is_dir() else []:
            try:  # each worker's faulthandler writes its threads' stacks to its stderr log
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(1.0)
        files += [run_dir / "logs" / "agent.log"]
        files += sorted((run_dir / "logs").glob("attempt-*/**/std*.log"))
        files += sorted((run_dir / "reports").glob("rank-*.jsonl"))
        out = []
        for f in files:
            if f is None or not Path(f).is_file():
                continue
            try:
                tail = Path(f).read_text(errors="replace").splitlines()[-lines:]
            except OSError as e:
                tail = [f"(unreadable: {e})"]
            out.append(f"\n--- {f} (last {len(tail)} lines) ---\n" + "\n".join(tail))
        return "".join(out)

    def events(self, name: str) -> list[dict]:
        """The job's events as `ds3dctl events NAME --json` prints them (the CLI's own
        event_json), asked in-process: waits poll this too, and a ds3dctl process per poll
        (~0.3 CPU-s) competes with the job under test (the CLI itself is driven by `ctl`)."""
        from ds3d.daemon.cli import event_json

        try:
            return [event_json(e) for e in self._polling_stub().WatchEvents(
                pb.WatchEventsRequest(name=name, follow=False, step_every=1), metadata=self.md(),
                timeout=30)]
        except grpc.RpcError as e:
            raise AssertionError(f"WatchEvents {name}: {e.code()}: {e.details()}") from None

    def event_details(self, name: str) -> list[dict]:
        """Events with their detail (`ds3dctl events --json` leaves it out): for an event made
        from a report record, the detail is that record."""
        channel, stub = self.stub()
        try:
            return [{"seq": e.seq, "kind": e.kind, "cause": e.cause, "rank": e.rank,
                     "step": e.step, "message": e.message,
                     "detail": json.loads(e.detail_json or "{}")}
                    for e in stub.WatchEvents(pb.WatchEventsRequest(name=name, follow=False),
                                              metadata=self.md(), timeout=30)]
        finally:
            channel.close()


def wait_for_commit(daemon: DaemonProc, store: Path, name: str, step: int,
                    timeout_s: float = 400.0) -> None:
    """Until the job's checkpoint of `step` is committed in the file store `store` (its
    MANIFEST.json), polled often: drills that strike right after a commit need to see it
    at once. Fails with the job's logs."""
    committed = store / name / "ckpt" / f"step-{step:08d}" / "MANIFEST.json"
    deadline = time.monotonic() + timeout_s
    while not committed.is_file() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert committed.is_file(), daemon.ctl("logs", name).stdout[-5000:]


def kill_job_processes(state_dir: Path) -> None:
    """Ends every agent and rendezvous process the daemon under `state_dir` started (by the
    pids they recorded), so no test leaves processes behind."""
    import psutil

    for pattern in ("jobs/*/control/agent-*.pid", "shares/*/control/agent-*.pid"):
        for pid_file in state_dir.glob(pattern):
            _kill_tree(json.loads(pid_file.read_text())["pid"])
    for run_dir in [*state_dir.glob("jobs/*"), *state_dir.glob("shares/*")]:
        for pid in worker_procs(run_dir):
            _kill_tree(pid)
    db = state_dir / "ds3d.db"
    if db.exists():
        import sqlite3

        con = sqlite3.connect(db)
        for (pid,) in con.execute("SELECT rdzv_pid FROM jobs WHERE rdzv_pid > 0"):
            _kill_tree(pid)
        con.close()
    del psutil


def _kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and its descendants but multiprocessing's resource tracker, which
    unlinks the agent's semaphores in /dev/shm once the others are gone (daemon/procs.py)."""
    import psutil

    from ds3d.daemon.procs import is_resource_tracker

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:  # gone, or gone between the two calls (CI of 12-07)
        return
    procs = [p for p in tree if not is_resource_tracker(p)]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_ended(procs, timeout_s=10)


def _wait_ended(procs: list, timeout_s: float) -> None:
    """Until every process in `procs` has exited: gone, or a zombie. psutil.wait_procs also
    waits for a zombie to be reaped, and one whose parent (a stopped ds3dd) is gone waits for
    the init process, which on the CI VM reaps only every second or two: that was ~1.5 s of
    every daemon test's teardown."""
    import psutil

    deadline = time.monotonic() + timeout_s
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def worker_procs(run_dir: str | Path) -> list[int]:
    """Pids of the live worker processes of one job (by their process titles)."""
    from ds3d.daemon.procs import job_workers

    return sorted(p.pid for p in job_workers(run_dir))


def wait_reported_step(run_dir: Path, step: int, timeout_s: float = 300.0) -> None:
    """Until rank 0's report file says `step` was trained: read at the source, within ~20 ms
    (the daemon's status follows its tail of the same file, seconds later on a loaded host,
    which a short job outruns)."""
    from ds3d.trainer.report import read_rank_records

    deadline = time.monotonic() + timeout_s
    while not any(r["kind"] == "step" and r["step"] >= step
                  for r in read_rank_records(run_dir, 0)):
        assert time.monotonic() < deadline, f"{run_dir}: no step {step} in {timeout_s} s"
        time.sleep(0.02)


@contextlib.contextmanager
def frozen_workers(run_dir: Path, count: int) -> Iterator[list[int]]:
    """The job's `count` live workers stopped (SIGSTOP) inside the block, continued after:
    whatever the test does meanwhile (a command, a daemon kill or drain) happens before the
    job's next step, however loaded the machine."""
    pids = worker_procs(run_dir)
    assert len(pids) == count, (pids, count)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30  # a stop lands when the process is next scheduled
    while any(psutil.Process(pid).status() != psutil.STATUS_STOPPED for pid in pids):
        assert time.monotonic() < deadline, "the workers did not stop within 30 s"
        time.sleep(0.01)
    try:
        yield pids
    finally:
        for pid in pids:
            # a worker may be gone: a daemon that took the job over meanwhile restarted it (its
            # old workers are killed, stopped or not; stress run of 12-06)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def loopback_nodes(root: Path, *args: str) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """Two daemons as two nodes of one host, sharing a token: A (the head) on 127.0.0.2, B on
    127.0.0.1. torch elastic ranks nodes by address, so global rank 0 lands on B and commands
    reach rank 0 only through the head's copy of command.json to B. `args`: both daemons'."""
    token = new_token()
    a = DaemonProc(root / "a", token=token, node="node-a",
                   args=["--hang-timeout", "300", "--node-addr", "127.0.0.2", *args])
    b = DaemonProc(root / "b", token=token, node="node-b",
                   args=["--hang-timeout", "300", "--node-addr", "127.0.0.1", *args])
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        for d in (a, b):
            d.stop()
        for d in (a, b):
            kill_job_processes(d.state_dir)


def new_token() -> str:
    return secrets.token_urlsafe(24)


def tiny_job_json(**sections: dict) -> str:
    """A valid tiny job's JSON with sections overridden (for raw StartJob requests)."""
    from ds3d.trainer.config import build_job_config

    data = json.loads(build_job_config("tiny", name="raw").dump_json())
    for key, over in sections.items():
        if isinstance(over, dict):
            data.setdefault(key, {}).update(over)
        else:
            data[key] = over
    return json.dumps(data)


__all__ = ["DaemonProc", "kill_job_processes", "loopback_nodes", "new_token", "pb",
           "tiny_job_json", "worker_procs"]
