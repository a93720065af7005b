"""`ds3dd`: the per-node ds3d daemon.

    ds3dd --state-dir /var/lib/ds3d [--listen 127.0.0.1:7531 | unix:/run/ds3d.sock]
          [--token-file F] [--tls-cert C --tls-key K --tls-ca CA] [--metrics-port P]
          [--rdzv-host H] [--node-addr A] [--enable-fault-injection]

Listening beyond loopback requires mutual TLS and a bearer token (auth.py). Startup problems
are one clear line on stderr and exit code 2. SIGTERM/SIGINT shut down gracefully: every running job
this node heads is paused (checkpoint, then its workers stop) and resumed by the next ds3dd on
the same state directory; `--drain-timeout 0` leaves the workers running instead (the next
ds3dd reattaches to them, as after a crash or SIGKILL).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from ds3d.checkpoints.upload import retry_interval_from_env
from ds3d.trainer.errors import Ds3dError

from .auth import peer_auth, read_token, tls_files
from .backlog_upload import MAX_RETRY_S, RETRY_S
from .launcher import WORKER_MODULE
from .logging import configure, get_logger


def _number(text: str) -> float:
    """The flag's value as a float, NaN when it is none (every range check then fails)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _seconds(text: str) -> float:
    """A duration flag: a finite number of seconds above 0 (argparse then exits 2 with it)."""
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def _seconds_or_zero(text: str) -> float:
    """A duration flag where 0 has a meaning of its own (--drain-timeout 0: do not wait)."""
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 or a number of seconds above 0")
    return value


def _seconds_from(low: float) -> Callable[[str], float]:
    """A duration flag of at least `low` seconds (finite; argparse then exits 2 with it)."""
    def parse(text: str) -> float:
        value = _seconds(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is below {low:g} s")
        return value
    return parse


def _port(text: str) -> int:
    """A TCP port to listen on (argparse then exits 2 with it)."""
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port from 0 to 65535 (0 picks "
                                         "a free one)")
    return int(text)


def _bounded_int(low: int, high: int, unit: str) -> Callable[[str], int]:
    """An integer flag within [low, high] (argparse then exits 2 naming the flag and range)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number of {unit} from {low} to {high}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ds3dd", description="ds3d per-node daemon")
    ap.add_argument("--state-dir", type=Path, default=Path(os.environ.get(
        "DS3D_STATE_DIR", "~/.ds3d")).expanduser(), help="database, job folders, daemon log")
    ap.add_argument("--listen", default="127.0.0.1:7531",
                    help="HOST:PORT (port 0 picks one) or unix:PATH; default 127.0.0.1:7531")
    ap.add_argument("--node-name", default=socket.gethostname(), help="this node's name")
    ap.add_argument("--token-file", help="file holding the bearer token clients must send")
    ap.add_argument("--peer-token-file", help="file holding the peer token: the secret the "
                    "daemons of a multi-node job prove themselves to each other with (the "
                    "same file on every node; not the client token). Without it (or "
                    "--peer-names) node-to-node calls are refused")
    ap.add_argument("--peer-names", help="comma-separated certificate names (CN or DNS/IP "
                    "subject alternative name) of the daemons allowed node-to-node calls; "
                    "needs mutual TLS")
    ap.add_argument("--tls-cert", help="PEM certificate of this daemon")
    ap.add_argument("--tls-key", help="PEM private key of this daemon")
    ap.add_argument("--tls-ca", help="PEM CA that signs client and peer certificates")
    ap.add_argument("--metrics-port", type=_port,
                    help="serve Prometheus metrics on this port of 127.0.0.1 (0 picks a free "
                    "one, written to the log)")
    ap.add_argument("--rdzv-host", default="127.0.0.1",
                    help="address the jobs' rendezvous stores bind to (the cluster network for "
                    "multi-node jobs)")
    ap.add_argument("--node-addr", default=None,
                    help="address other nodes reach this node's workers at (MASTER_ADDR when "
                    "rank 0 runs here); default: the host's FQDN")
    ap.add_argument("--max-request-bytes", type=_bounded_int(1024, (1 << 31) - 1, "bytes"),
                    default=1 << 20, help="largest request accepted (bytes); default 1 MiB")
    ap.add_argument("--drain-timeout", type=_seconds_or_zero, default=300.0,
                    help="on SIGTERM, seconds to wait for running jobs to checkpoint and pause "
                    "(0: leave their workers running, to be reattached by the next ds3dd); "
                    "default 300 (the systemd unit's TimeoutStopSec must exceed it)")
    ap.add_argument("--hang-timeout", type=_seconds, default=120.0,
                    help="fewest seconds without a worker report before a hang is declared")
    ap.add_argument("--start-timeout", type=_seconds, default=600.0,
                    help="seconds a worker group may take from its launch to its first `start` "
                    "record (imports, rendezvous, DeepSpeed's op build, restore) before it is a "
                    "startup_timeout fault that names any build lock it waits on; default 600")
    ap.add_argument("--backlog-retry-max", type=_seconds_from(RETRY_S), default=MAX_RETRY_S,
                    help="longest wait, in seconds, between two attempts to upload a checkpoint "
                    "the exited workers left on the local tier during a store outage (the first "
                    f"retry comes after {RETRY_S:g} s, doubling up to this); default "
                    f"{MAX_RETRY_S:g}")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    ap.add_argument("--log-max-mb", type=_bounded_int(1, 1 << 20, "MiB"), default=100,
                    help="STATE_DIR/ds3dd.log is rotated when it reaches this size (MiB); "
                    "default 100")
    ap.add_argument("--log-backups", type=_bounded_int(1, 1000, "files"), default=5,
                    help="rotated logs kept (ds3dd.log.1 is the newest); default 5, so the log "
                    "takes at most (backups + 1) x --log-max-mb")
    ap.add_argument("--events-kept", type=_bounded_int(1000, 1 << 31, "events"),
                    default=100_000, help="newest `step` and `checkpoint` events kept per job "
                    "and kind in the event table (older ones are deleted; every other kind is "
                    "kept); default 100000")
    ap.add_argument("--enable-fault-injection", action="store_true",
                    help="accept fault-injection requests (drills only; off by default)")
    ap.add_argument("--report-gpu-memory", metavar="SIZE",
                    help="tests and dry runs only: report one GPU of SIZE (e.g. 141GB) instead "
                    "of the GPUs nvidia-smi finds, for the fit check at job start")
    ap.add_argument("--worker-module", default=WORKER_MODULE, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    state_dir: Path = args.state_dir
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        configure(state_dir / "ds3dd.log", args.node_name, args.log_level,
                  max_bytes=args.log_max_mb << 20, backups=args.log_backups)
        from .fit_check import parse_size
        from .server import Daemon, DaemonOptions

        retry_interval_from_env()  # the workers' DS3D_UPLOAD_RETRY_S, checked before any runs
        token = read_token(args.token_file) if args.token_file else None
        tls = tls_files(args.tls_cert, args.tls_key, args.tls_ca)
        opts = DaemonOptions(
            state_dir=state_dir, listen=args.listen, node=args.node_name, token=token,
            tls=tls, peer=peer_auth(args.peer_token_file, args.peer_names, token, tls),
            metrics_port=args.metrics_port, max_request_bytes=args.max_request_bytes,
            rdzv_host=args.rdzv_host, worker_module=args.worker_module, node_addr=args.node_addr,
            hang_timeout_s=args.hang_timeout, start_timeout_s=args.start_timeout,
            enable_fault_injection=args.enable_fault_injection, events_kept=args.events_kept,
            backlog_retry_max_s=args.backlog_retry_max,
            report_gpu_memory=parse_size(args.report_gpu_memory)
            if args.report_gpu_memory else None)
        daemon = Daemon(opts)
        daemon.start()
    except (Ds3dError, OSError) as e:
        print(f"ds3dd: {e}", file=sys.stderr)
        sys.exit(2)
    done = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        get_logger("ds3d.daemon").info("signal", signal=signal.Signals(signum).name)
        done.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # `kill -USR1 <ds3dd>` prints every thread's stack to stderr (the journal under systemd):
    # where a supervisor or an RPC is stuck, without stopping anything
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    resumed = daemon.resume_drained()
    if resumed:
        get_logger("ds3d.daemon").info("resuming jobs paused at the last shutdown", jobs=resumed)
    print(f"ds3dd: serving on {daemon.address}", flush=True)
    done.wait()
    if args.drain_timeout > 0:  # graceful: checkpoint, stop the workers, resume at next start
        paused = daemon.drain(args.drain_timeout)
        get_logger("ds3d.daemon").info("drained", jobs=paused)
    daemon.close()


if __name__ == "__main__":
    main()
