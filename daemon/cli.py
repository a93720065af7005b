"""`ds3dctl`: the command line of ds3d (also `python -m ds3d.daemon.cli`).

    ds3dctl start tiny --name t1 --steps 20 --set train.lr=1e-3
    ds3dctl check gpt125m --deepspeed ds_config.json   (no daemon: effective job + DeepSpeed config)
    ds3dctl start --neox 125M.yml --store s3://b/p      (a GPT-NeoX YAML, translated)
    ds3dctl status [JOB] [--json]      ds3dctl list [--all] [--limit N]
    ds3dctl pause JOB [--fast] | resume JOB | stop JOB [--now]
    ds3dctl events JOB [--follow]      ds3dctl logs JOB
    ds3dctl checkpoints JOB | save JOB | rollback JOB STEP
    ds3dctl start tiny --nodes 2 --dp 2 --hosts HEAD_ADDR,NODE2_ADDR --store URL   (multi-node)
    ds3dctl inject JOB nan|hang|crash|slow|spike|unloadable|unconvertible --rank R [--at-step S]
                                       (ds3dd --enable-fault-injection)
    ds3dctl rebalance JOB [--dry-run] [--json]   pipeline partition from measured layer costs

The daemon address comes from --addr or DS3D_ADDR (default 127.0.0.1:7531); the token from
--token-file or DS3D_TOKEN. The job configuration is validated here first (same schema as the
daemon), so mistakes are reported before anything is sent. Bad input — a wrong flag, an invalid
configuration, or a request the daemon refuses — is a message on stderr and exit code 2, never a
traceback; an unreachable daemon is exit code 3.

This module imports grpc, the generated stubs and the pydantic config only — never torch or
deepspeed — so the CLI starts in a fraction of a second; `start` and `check` import DeepSpeed's
config parser (~1.5 s) to check the DeepSpeed config a job's workers will get.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import grpc

from ds3d.trainer.config import job_warnings
from ds3d.trainer.errors import Ds3dError
from ds3d.trainer.kinds import EventKind, FaultKind
from ds3d.v1 import control_pb2 as pb
from ds3d.v1 import control_pb2_grpc as pb_grpc

from .auth import read_token, token_problem
from .check import check_sections, render, source_with_files, validated_job
from .job_pages import MAX_PAGE_SIZE

DEFAULT_ADDR = "127.0.0.1:7531"
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
_USER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
}


class UsageError(Exception):
    """A command line that cannot be run; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _address(value: str) -> str:
    """--addr / DS3D_ADDR: HOST:PORT or unix:PATH (grpc takes port 99999 as 34463, and an
    empty address as an internal error)."""
    if value.startswith("unix:"):
        if value[len("unix:"):].strip():
            return value
    else:
        host, _, port = value.rpartition(":")
        if host.strip() and port.isascii() and port.isdigit() and len(port) <= 5 and \
                1 <= int(port) <= 65535:
            return value
    raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (port 1-65535) or unix:PATH")


INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1  # the proto fields' ranges


def _count(low: int, high: int) -> Callable[[str], int]:
    """An integer argument the request carries in a proto int32/int64 field: out of range, the
    stub raised ValueError (a traceback) before anything was sent."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number from {low} to "
                                             f"{high}")
        return n
    return parse


def _seconds(value: str) -> float:
    """--timeout: a finite number of seconds above 0 (nan, inf or -1 became an instant
    DEADLINE_EXCEEDED, as if the daemon were slow)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds above 0")
    return seconds


def _limit_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=_count(1, INT32_MAX), default=None, metavar="N",
                   help="list the N oldest jobs only (default: all, fetched page by page)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ds3dctl", description="control ds3d training jobs")
    ap.add_argument("--addr", default=os.environ.get("DS3D_ADDR", DEFAULT_ADDR), type=_address,
                    help="daemon address HOST:PORT or unix:PATH (env DS3D_ADDR)")
    ap.add_argument("--token-file", default=os.environ.get("DS3D_TOKEN_FILE"),
                    help="file with the bearer token (or env DS3D_TOKEN)")
    ap.add_argument("--tls-ca", default=os.environ.get("DS3D_TLS_CA"))
    ap.add_argument("--tls-cert", default=os.environ.get("DS3D_TLS_CERT"))
    ap.add_argument("--tls-key", default=os.environ.get("DS3D_TLS_KEY"))
    ap.add_argument("--timeout", type=_seconds, default=30.0, help="seconds per request")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for command in ("start", "check"):
        s = sub.add_parser(command, help="validate and start a job" if command == "start" else
                           "validate a job without a daemon and print the effective job and "
                           "the DeepSpeed config its workers get")
        _job_arguments(s)
        s.add_argument("--json", action="store_true")

    p = sub.add_parser("pause", help="save a checkpoint and stop the workers")
    p.add_argument("job")
    p.add_argument("--fast", action="store_true",
                   help="ask the workers not to wait for the upload (passed on; the current "
                   "trainer still pauses after its checkpoint is committed)")
    sub.add_parser("resume", help="start a paused job again").add_argument("job")
    p = sub.add_parser("stop", help="end a job (saves a checkpoint unless --now)")
    p.add_argument("job")
    p.add_argument("--now", action="store_true", help="kill the workers without saving")
    p = sub.add_parser("status", help="one job, or every job (finished ones too; `list`: "
                       "live ones)")
    p.add_argument("job", nargs="?")
    p.add_argument("--json", action="store_true")
    _limit_argument(p)
    p = sub.add_parser("list", help="live jobs of this daemon (--all: finished ones too)")
    p.add_argument("--all", action="store_true", help="include finished jobs")
    p.add_argument("--json", action="store_true")
    _limit_argument(p)
    p = sub.add_parser("events", help="a job's event history")
    p.add_argument("job")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--kind", action="append", default=[],
                   choices=[k.value for k in EventKind])
    p.add_argument("--step-every", type=_count(1, INT32_MAX), default=1,
                   help="one step event per N steps")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per event, with its full detail (stacks included)")
    p.add_argument("--detail", action="store_true",
                   help="each event followed by its detail (evidence, stacks), readably")
    p = sub.add_parser("logs", help="tail of the agent and worker logs")
    p.add_argument("job")
    p.add_argument("--source", default="", help="agent or rank:N (local rank)")
    p.add_argument("--lines", type=_count(1, INT32_MAX), default=50)
    p.add_argument("--tensorboard", action="store_true",
                   help="print where the job's TensorBoard event files are and how to view them")
    p = sub.add_parser("export", help="consolidated model weights (safetensors + config.json) "
                       "of a committed checkpoint, from any (TP, PP, DP) layout")
    p.add_argument("job")
    p.add_argument("--step", type=_count(0, INT64_MAX),
                   help="default: the newest committed checkpoint")
    p.add_argument("--out", required=True, help="output folder, or s3://bucket/prefix")
    p.add_argument("--store", help="the job's store prefix, when RUN_DIR/job.json cannot be "
                   "read from here")
    p.add_argument("--format", choices=("ds3d", "hf"), default="ds3d", help="ds3d: safetensors "
                   "for load_exported; hf: a Hugging Face GPT-NeoX folder (transformers)")
    p.add_argument("--tokenizer", help="hf: tokenizer written beside the model (default: the "
                   "job's data.tokenizer)")
    p = sub.add_parser("checkpoints", help="checkpoints of a job")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verify", action="store_true",
                   help="first reconcile the daemon's index with the store: read every "
                        "manifest, check every file's size and sha256 (downloads them; give "
                        "--timeout for large checkpoints)")
    sub.add_parser("save", help="save a checkpoint now").add_argument("job")
    p = sub.add_parser("rollback", help="restart from the checkpoint of STEP")
    p.add_argument("job")
    p.add_argument("step", type=_count(0, INT64_MAX))
    p = sub.add_parser("rebalance", help="measured per-stage times and predicted bubble/step "
                       "time of the current and the best pipeline partition; applies the best "
                       "one (checkpoint, restart) unless --dry-run")
    p.add_argument("job")
    p.add_argument("--dry-run", action="store_true", help="only show; change nothing")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("inject", help="drills: make one rank misbehave (needs ds3dd "
                       "--enable-fault-injection)")
    p.add_argument("job")
    p.add_argument("kind", choices=[k.value for k in FaultKind])
    p.add_argument("--rank", type=_count(0, INT32_MAX), required=True, help="global rank")
    p.add_argument("--at-step", type=_count(0, INT64_MAX), default=0,
                   help="step at which it happens (default: the next step)")
    return ap


class _Once(argparse.Action):
    """A file option given twice is refused: argparse keeps the last, and every setting of
    the first file would be dropped without a word."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and earlier != values:
            parser.error(f"{option_string} given twice ({earlier} and {values}); give one file")
        setattr(namespace, self.dest, values)


def _job_arguments(s: argparse.ArgumentParser) -> None:
    """The job arguments `start` and `check` share."""
    s.add_argument("source", metavar="PRESET|CONFIG.toml|NEOX.yml", nargs="?")
    s.add_argument("--deepspeed", metavar="DS_CONFIG.json", action=_Once,
                   help="a DeepSpeed JSON, translated into the job's settings (sets "
                   "train.deepspeed_config; see docs/deepspeed-configs.md)")
    s.add_argument("--neox", metavar="NEOX.yml", action=_Once, help="a GPT-NeoX YAML as the "
                   "job, translated where ds3d's model can express it")
    s.add_argument("--name")
    s.add_argument("--tp", type=int)
    s.add_argument("--pp", type=int)
    s.add_argument("--dp", type=int)
    s.add_argument("--nodes", type=int)
    s.add_argument("--steps", type=int)
    s.add_argument("--store", metavar="URL", help="durable checkpoint store (file:// or s3://)")
    s.add_argument("--hosts", metavar="ADDR,ADDR",
                   help="daemon addresses of the job's nodes, comma-separated, the daemon this "
                   "command talks to (the head) first; sets launch.hosts (and launch.nnodes "
                   "unless --nodes is given)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def start_overrides(args: argparse.Namespace) -> list[str]:
    """The shorthand flags of `start` as `--set` overrides (shorthands first, --set wins)."""
    out = []
    for flag, key in (("tp", "parallel.tp"), ("pp", "parallel.pp"), ("dp", "parallel.dp"),
                      ("nodes", "launch.nnodes"), ("steps", "train.steps")):
        v = getattr(args, flag)
        if v is not None:
            out.append(f"{key}={v}")
    if args.store is not None:
        out.append(f"checkpoint.store={json.dumps(args.store)}")
    if args.hosts is not None:
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        if not hosts:
            raise UsageError("--hosts: give daemon addresses, e.g. --hosts 10.0.0.1:7531,"
                             "10.0.0.2:7531")
        out.append(f"launch.hosts={json.dumps(hosts)}")
        if args.nodes is None:
            out.append(f"launch.nnodes={len(hosts)}")
    return out + list(args.overrides)


# ---- connection -----------------------------------------------------------------------------


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.addr = args.addr
        self.timeout = args.timeout
        tls = (args.tls_ca, args.tls_cert, args.tls_key)
        if any(tls):
            if not all(tls):
                raise UsageError("TLS needs --tls-ca, --tls-cert and --tls-key together")
            try:
                ca, cert, key = (open(p, "rb").read() for p in tls)
            except OSError as e:
                raise UsageError(f"cannot read a TLS file: {e}") from None
            self.channel = grpc.secure_channel(self.addr, grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert))
        else:
            self.channel = grpc.insecure_channel(self.addr)
        token = os.environ.get("DS3D_TOKEN")
        if args.token_file:
            token = read_token(args.token_file)  # ds3dd's own rules for its --token-file
        elif token and (why := token_problem(token)) is not None:
            raise UsageError(f"the token of DS3D_TOKEN {why}")
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.stub = pb_grpc.ControlStub(self.channel)

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)

    def stream(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata)


def list_jobs(client: Client, include_finished: bool, limit: int | None) -> list[Any]:
    """Every job ListJobs pages through (oldest first), or the first `limit`; a note on stderr
    says when more were left out."""
    jobs: list[Any] = []
    token = ""
    seen = set()
    while limit is None or len(jobs) < limit:
        want = MAX_PAGE_SIZE if limit is None else min(MAX_PAGE_SIZE, limit - len(jobs))
        resp = client.call("ListJobs", pb.ListJobsRequest(
            include_finished=include_finished, page_size=want, page_token=token))
        jobs.extend(resp.jobs)
        token = resp.next_page_token
        if not token:
            break
        if token in seen:  # a daemon that repeats itself would page forever
            raise UsageError(f"the daemon at {client.addr} sent the same ListJobs page token "
                             "twice (a daemon bug); `--limit N` lists the first N jobs")
        seen.add(token)
    if limit is not None and (token or len(jobs) > limit):
        print(f"ds3dctl: the {limit} oldest jobs listed (--limit {limit}); the daemon has more",
              file=sys.stderr)
    return jobs[:limit]


# ---- output ---------------------------------------------------------------------------------


def _state(n: int) -> str:
    return pb.JobState.Name(cast("pb.JobState.ValueType", n)) if n else "-"


def _duration(s: float) -> str:
    if s < 0 or math.isnan(s):
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _loss(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.4f}"


def job_dict(j: pb.JobStatus) -> dict[str, Any]:
    return {
        "name": j.spec.name, "state": _state(j.state), "desired_state": _state(j.desired_state),
        "step": j.step, "total_steps": j.spec.total_steps,
        "loss": None if math.isnan(j.loss) else j.loss, "tokens_per_s": j.tokens_per_s,
        "eta_s": j.eta_s, "restarts": j.restarts, "restarts_in_a_row": j.restarts_in_a_row,
        "last_checkpoint_step": j.last_checkpoint_step,
        "memory_snapshot_step": j.memory_snapshot_step,
        "layout": {"tp": j.spec.tp, "pp": j.spec.pp, "dp": j.spec.dp,
                   "zero_stage": j.spec.zero_stage, "nnodes": j.spec.nnodes},
        "world_size": j.world_size, "message": j.message, "node": j.node, "run_dir": j.run_dir,
        "partition": {"boundaries": list(j.stage_boundaries), "source": j.partition_source},
        "step_split": split_dict(j.step_split) if j.HasField("step_split") else None,
        "created_at": j.created_at, "updated_at": j.updated_at,
    }


def _opt(msg: Any, field: str) -> float | None:
    return getattr(msg, field) if msg.HasField(field) else None


_SPLIT_PARTS = ("forward_s", "backward_s", "optimizer_s", "p2p_wait_s", "dp_reduce_s", "data_s",
                "compute_s", "step_s")


def split_dict(sp: pb.StepSplit) -> dict[str, Any]:
    """The step-time split as JSON, with each target's verdict (True = within the target)."""
    bubble, ratio = _opt(sp, "bubble"), _opt(sp, "reduce_to_forward")
    return {
        "stages": [{"stage": st.stage, "ranks": st.ranks, "step": st.step,
                    **{k: getattr(st, k) for k in _SPLIT_PARTS},
                    "bubble": _opt(st, "bubble"),
                    "reduce_to_forward": _opt(st, "reduce_to_forward")}
                   for st in sp.stages],
        "bubble": bubble, "bubble_theoretical": _opt(sp, "bubble_theoretical"),
        "reduce_to_forward": ratio,
        "targets": {"bubble": sp.bubble_target, "reduce_to_forward": sp.reduce_to_forward_target},
        "bubble_ok": None if bubble is None else bubble <= sp.bubble_target,
        "reduce_to_forward_ok": None if ratio is None else ratio <= sp.reduce_to_forward_target,
    }


def split_text(sp: pb.StepSplit) -> str:
    """Where the step time goes, one row per pipeline stage (its slowest rank per part), then
    the bubble and the reduce/forward ratio against the targets; `!` marks a missed target."""
    if not sp.stages:
        return "step-time split: no sampled step yet (step 2, then every train.timing_interval)"
    step = max(st.step for st in sp.stages)
    head = ("STAGE", "RANKS", "FORWARD", "BACKWARD", "OPTIMIZER", "P2P WAIT", "DP REDUCE", "DATA",
            "STEP", "BUBBLE", "REDUCE/FWD")
    rows: list[tuple[str, ...]] = [head]
    for st in sp.stages:
        b, r = _opt(st, "bubble"), _opt(st, "reduce_to_forward")
        rows.append((str(st.stage), str(st.ranks),
                     *(f"{getattr(st, k):.3f}" for k in _SPLIT_PARTS if k != "compute_s"),
                     _pct(b, sp.bubble_target), _pct(r, sp.reduce_to_forward_target)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                      for row in rows)
    lines = [f"step-time split, seconds, sampled step {step} (slowest rank of each stage):", table]
    bubble, theory = _opt(sp, "bubble"), _opt(sp, "bubble_theoretical")
    if bubble is not None:
        verdict = "ok" if bubble <= sp.bubble_target else "ABOVE TARGET"
        lines.append(f"pipeline bubble {bubble:.1%} measured vs {theory or 0:.1%} theoretical "
                     f"(p-1)/(m+p-1); target < {sp.bubble_target:.0%}: {verdict}")
    else:
        lines.append("pipeline bubble: none (one pipeline stage)")
    ratio = _opt(sp, "reduce_to_forward")
    if ratio is not None:
        verdict = "ok" if ratio <= sp.reduce_to_forward_target else "ABOVE TARGET"
        lines.append(f"DP reduce / forward {ratio:.1%}; target < "
                     f"{sp.reduce_to_forward_target:.0%}: {verdict}")
    else:
        lines.append("DP reduce / forward: not measured (DP = 1, or the reduction overlaps "
                     "backward and is counted in it)")
    return "\n".join(lines)


def _pct(v: float | None, target: float) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" + (" !" if v > target else "")


MESSAGE_COLUMN = 60  # characters of the status line in the table; `status JOB` adds it whole
_TRAINING = (pb.RUNNING, pb.STARTING, pb.RECOVERING)


def _cut(message: str) -> str:
    return message if len(message) <= MESSAGE_COLUMN else message[:MESSAGE_COLUMN - 1] + "…"


def job_table(jobs: Sequence[pb.JobStatus]) -> str:
    head = ("NAME", "STATE", "STEP", "LOSS", "TOKENS/S", "ETA", "RESTARTS", "LAYOUT", "MESSAGE")
    rows = [head]
    for j in jobs:
        state = _state(j.state)
        training = j.state in _TRAINING
        if j.desired_state != j.state and training:
            state += f"->{_state(j.desired_state)}"
        # a paused or ended job has no rate and no ETA (its last rate would promise one)
        rows.append((j.spec.name, state, f"{j.step}/{j.spec.total_steps}", _loss(j.loss),
                     f"{j.tokens_per_s:,.0f}" if j.tokens_per_s and training else "-",
                     _duration(j.eta_s) if training else "-",
                     str(j.restarts), f"tp{j.spec.tp} pp{j.spec.pp} dp{j.spec.dp}" + (
                         f" {'|'.join(map(str, j.stage_boundaries))}" if j.spec.pp > 1 and
                         j.stage_boundaries else ""),
                     _cut(j.message)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def budget_text(j: pb.JobStatus) -> str | None:
    """The restart budget of a job that restarted (None before its first restart)."""
    if not j.restarts:
        return None
    try:
        allowed = int(json.loads(j.spec.config_json)["launch"]["max_restarts"])
    except (ValueError, KeyError, TypeError):
        allowed = None
    of = f" of {allowed}" if allowed is not None else ""
    return (f"restart budget: {j.restarts_in_a_row}{of} used (restarts in a row without a new "
            f"checkpoint; {j.restarts} restart{'s' if j.restarts != 1 else ''} in all)")


def log_paths_text(j: pb.JobStatus) -> str:
    """Where everything a job writes lives on its head node (the tails above are from logs/)."""
    d, name = j.run_dir, j.spec.name
    return "\n".join([
        f"--- files of {name} on node {j.node or '?'}:",
        f"  worker and agent logs  {os.path.join(d, 'logs')}/ (agent.log, attempt-N/...)",
        f"  per-rank records       {os.path.join(d, 'reports')}/rank-*.jsonl"
        + ("  (other nodes' copies in reports/nodes/)" if j.spec.nnodes > 1 else ""),
        f"  TensorBoard            {os.path.join(d, 'tensorboard')}/  (ds3dctl logs {name} "
        "--tensorboard)",
        f"  daemon events          ds3dctl events {name} [--follow]  (stored in the daemon's "
        "state database)"])


def tensorboard_text(j: pb.JobStatus, rank0_host: str) -> str:
    """Where the job's TensorBoard event files are and how to view them. Only global rank 0
    writes them (trainer/tensorboard.py), into the job directory of the node it runs on."""
    path = os.path.join(j.run_dir, "tensorboard")
    lines = [f"TensorBoard event files of {j.spec.name} (written by global rank 0; each start "
             "of the worker group adds a file, read together as one run):", f"  {path}"]
    if j.spec.nnodes > 1:
        where = f"host {rank0_host}" if rank0_host else "the node global rank 0 runs on"
        lines.append(f"  on {where}, in that node's job directory (<ds3dd --state-dir>/jobs/"
                     f"{j.spec.name}/tensorboard); the other nodes hold no event files: their "
                     "ranks' step-time splits are in reports/ and the Prometheus metrics")
    elif rank0_host:
        lines.append(f"  on host {rank0_host}")
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.startswith("events.out.tfevents"))
        lines.append(f"  {len(files)} event file(s) here")
    else:
        lines.append("  (not on this machine: run the command below on that host, or copy the "
                     "folder here)")
    lines.append(f"view: tensorboard --logdir {path} --bind_all   then open http://HOST:6006")
    return "\n".join(lines)


def _newest_event(client: Client, job: str, kind: EventKind) -> pb.Event | None:
    """The job's newest event of `kind`; None when there is none, or when this daemon is not
    the job's head (its events are kept there; GetJob is forwarded, the event log is not)."""
    newest = None
    try:
        for e in client.stream("WatchEvents", pb.WatchEventsRequest(name=job, kinds=[kind])):
            newest = e
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise
    return newest


def event_line(e: pb.Event) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(e.time))
    step = f"step {e.step}" if e.step >= 0 else ""
    where = f"rank {e.rank}" if e.rank >= 0 else "daemon"
    if e.kind == EventKind.STATE:
        text = f"{_state(e.from_state)} -> {_state(e.to_state)}: {e.message}"
    else:
        text = e.message
    return f"{t}  {e.kind:<10} {step:<10} {where:<8} {text}"


def event_json(e: pb.Event) -> dict[str, Any]:
    """An event as `ds3dctl events --json` prints it: every field, the detail as an object."""
    try:
        detail = json.loads(e.detail_json) if e.detail_json else {}
    except ValueError:
        detail = {"unparsed": e.detail_json}
    return {"seq": e.seq, "time": e.time, "kind": e.kind, "step": e.step, "rank": e.rank,
            "node": e.node, "restart": e.restart, "cause": e.cause, "message": e.message,
            "from": _state(e.from_state), "to": _state(e.to_state), "detail": detail}


def detail_text(value: Any, indent: int = 4) -> str:
    """An event's detail for people: one `key: value` per line, nested objects indented, long
    or multi-line text (a stack) as an indented block under its key."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            if isinstance(v, dict | list) and v or isinstance(v, str) and "\n" in v:
                lines.append(f"{pad}{k}:\n{detail_text(v, indent + 2)}")
            else:
                lines.append(f"{pad}{k}: {json.dumps(v) if not isinstance(v, str) else v}")
        return "\n".join(lines)
    if isinstance(value, list):
        return "\n".join(f"{pad}- " + (detail_text(v, indent + 2).lstrip()
                                       if isinstance(v, dict | list) else str(v)) for v in value)
    return "\n".join(pad + ln for ln in str(value).rstrip().splitlines())


# ---- commands -------------------------------------------------------------------------------


def run(args: argparse.Namespace, out: Any = sys.stdout) -> int:
    if args.command in ("start", "check"):
        source, overrides = source_with_files(args.source, args.deepspeed, args.neox,
                                              start_overrides(args))
        cfg = validated_job(source, overrides, args.name)
        if args.command == "check":
            print(render(check_sections(cfg, source)), file=out)
            return 0
        for warning in job_warnings(cfg):
            print(f"ds3dctl: warning: {warning}", file=sys.stderr)
        client = Client(args)
        job = client.call("StartJob", pb.StartJobRequest(config_json=cfg.dump_json())).job
        if args.json:
            print(json.dumps(job_dict(job), indent=2), file=out)
        else:
            print(f"started {job.spec.name}: tp{job.spec.tp} pp{job.spec.pp} dp{job.spec.dp} "
                  f"x {job.spec.total_steps} steps, {job.spec.n_params / 1e6:.1f}M parameters "
                  f"({job.run_dir})", file=out)
        return 0
    client = Client(args)
    c = args.command
    if c in ("pause", "resume", "stop"):
        if c == "pause":
            job = client.call("PauseJob", pb.PauseJobRequest(name=args.job, fast=args.fast)).job
        elif c == "resume":
            job = client.call("ResumeJob", pb.ResumeJobRequest(name=args.job)).job
        else:
            job = client.call("StopJob", pb.StopJobRequest(name=args.job, now=args.now)).job
        print(f"{job.spec.name}: {_state(job.state)} -> {_state(job.desired_state)} requested",
              file=out)
    elif c in ("status", "list"):
        if c == "status" and args.job:
            jobs = [client.call("GetJob", pb.JobRef(name=args.job)).job]
        else:
            jobs = list_jobs(client, c == "status" or args.all, args.limit)
        # checkpoint.interval / memory_interval = "auto": the newest intervals and what they
        # were computed from (one record carries both)
        interval = _newest_event(client, args.job, EventKind.CHECKPOINT_INTERVAL) \
            if c == "status" and args.job else None
        if args.json:
            data: Any = [job_dict(j) for j in jobs]
            if interval is not None:
                data[0]["checkpoint_interval"] = json.loads(interval.detail_json or "{}")
            print(json.dumps(data[0] if c == "status" and args.job else data, indent=2),
                  file=out)
        else:
            print(job_table(jobs) if jobs else "no jobs", file=out)
            if c == "status" and args.job and len(jobs[0].message) > MESSAGE_COLUMN:
                print(f"\nmessage: {jobs[0].message}", file=out)  # the reason and its fix, whole
            if interval is not None:
                print(f"\n{interval.message} (as of step {interval.step})", file=out)
            if c == "status" and args.job and (budget := budget_text(jobs[0])):
                print(f"\n{budget}", file=out)
            if c == "status" and args.job and jobs[0].memory_snapshot_step >= 0:
                print(f"\nnewest memory-only snapshot: step {jobs[0].memory_snapshot_step} (held "
                      "in memory only, no files)", file=out)
            if c == "status" and args.job and jobs[0].HasField("step_split"):
                print("\n" + split_text(jobs[0].step_split), file=out)
    elif c == "events":
        req = pb.WatchEventsRequest(name=args.job, follow=args.follow, kinds=args.kind,
                                    step_every=args.step_every)
        for e in client.stream("WatchEvents", req):
            if args.json:
                print(json.dumps(event_json(e)), file=out, flush=True)
            elif args.detail and e.detail_json not in ("", "{}"):
                print(event_line(e) + "\n" + detail_text(event_json(e)["detail"]), file=out,
                      flush=True)
            else:
                print(event_line(e), file=out, flush=True)
    elif c == "logs" and args.tensorboard:
        job = client.call("GetJob", pb.JobRef(name=args.job)).job
        starts = [e for e in client.stream("WatchEvents", pb.WatchEventsRequest(
            name=args.job, kinds=[EventKind.START, EventKind.RECOVERY])) if e.rank == 0]
        print(tensorboard_text(job, starts[-1].node if starts else ""), file=out)
    elif c == "export":
        _export(client, args, out)
    elif c == "logs":
        resp = client.call("GetLogs", pb.GetLogsRequest(name=args.job, tail_lines=args.lines,
                                                        source=args.source))
        for f in resp.files:
            print(f"==> {f.path} ({f.size} bytes) <==\n{f.text}", file=out)
        if not resp.files:
            print("no logs yet", file=out)
        print(log_paths_text(client.call("GetJob", pb.JobRef(name=args.job)).job), file=out)
    elif c == "checkpoints":
        resp = client.call("ListCheckpoints", pb.ListCheckpointsRequest(name=args.job,
                                                                         verify=args.verify))
        cks = resp.checkpoints
        if args.json:
            print(json.dumps([{"step": k.step, "phase": k.phase, "path": k.path,
                               "time": k.time, "blocked_s": k.blocked_s, "present": k.present,
                               "detail": k.detail} for k in cks], indent=2), file=out)
        elif not cks:
            print("no checkpoints", file=out)
        else:
            for k in cks:
                print(f"step {k.step:<8} {k.phase:<10} blocked {k.blocked_s:6.2f} s  "
                      f"{'present' if k.present else 'absent '}  {k.path}", file=out)
                if k.detail:
                    print(f"    {k.detail}", file=out)
        if args.verify and not args.json:
            print("\n".join(["verified against the store: " + (
                f"{len(resp.changes)} index row(s) corrected" if resp.changes
                else "the index was right")] + [f"  {c}" for c in resp.changes]), file=out)
    elif c == "save":
        cid = client.call("SaveCheckpoint", pb.SaveCheckpointRequest(name=args.job)).command_id
        print(f"{args.job}: checkpoint requested (command {cid}); watch with "
              f"`ds3dctl events {args.job} --follow --kind checkpoint`", file=out)
    elif c == "inject":
        resp = client.call("InjectFault", pb.InjectFaultRequest(
            name=args.job, kind=args.kind, rank=args.rank, at_step=args.at_step))
        when = f"at step {resp.at_step}" if args.at_step else \
            f"at the first step it reads the request, step {resp.at_step} or later"
        print(f"{args.job}: {args.kind} on rank {args.rank} {when} (injection {resp.id}, "
              f"{resp.path})", file=out)
    elif c == "rollback":
        job = client.call("Rollback", pb.RollbackRequest(name=args.job, step=args.step)).job
        print(f"{job.spec.name}: rolling back to step {args.step}", file=out)
    elif c == "rebalance":
        resp = client.call("Rebalance", pb.RebalanceRequest(name=args.job, dry_run=args.dry_run))
        print(json.dumps(rebalance_dict(resp), indent=2) if args.json else
              rebalance_text(args.job, resp), file=out)
    return 0


def _plan_dict(p: pb.PartitionPlan) -> dict[str, Any]:
    return {"boundaries": list(p.boundaries), "stage_s": list(p.stage_s),
            "slowest_s": p.slowest_s, "step_s": p.step_s, "bubble": p.bubble,
            "stage_memory_bytes": list(p.stage_memory_bytes)}


def rebalance_dict(r: pb.RebalanceResponse) -> dict[str, Any]:
    return {"action": r.action, "message": r.message, "command_id": r.command_id,
            "current": _plan_dict(r.current), "proposed": _plan_dict(r.proposed),
            "improvement": r.improvement, "threshold": r.threshold,
            "micro_batches": r.micro_batches, "profile_step": r.profile_step,
            "memory_limit_bytes": r.memory_limit_bytes or None,
            "layers": [{"layer": c.layer, "forward_s": c.forward_s, "backward_s": c.backward_s,
                        "params": c.params, "activation_bytes": c.activation_bytes}
                       for c in r.layers]}


def rebalance_text(job: str, r: pb.RebalanceResponse) -> str:
    """The two partitions side by side: measured per-stage times (ms per micro-batch) and the
    predicted step time and bubble of a 1F1B step."""
    p = len(r.current.boundaries) - 1
    head = ("PARTITION", "BOUNDARIES", "STAGE MS/MICRO-BATCH", "SLOWEST MS", "STEP MS (PRED.)",
            "BUBBLE (PRED.)")
    rows = [head]
    for label, plan in (("current", r.current), ("proposed", r.proposed)):
        rows.append((label, "|".join(map(str, plan.boundaries)),
                     " ".join(f"{s * 1e3:.1f}" for s in plan.stage_s),
                     f"{plan.slowest_s * 1e3:.1f}",
                     f"{plan.step_s * 1e3:.0f}", f"{plan.bubble:.1%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                      for row in rows)
    return (f"{job}: {p} pipeline stages, {r.micro_batches} micro-batches per step; layer costs "
            f"profiled at step {r.profile_step}\n{table}\n"
            f"slowest stage {-r.improvement:+.1%} (threshold {r.threshold:.0%})\n{r.message}")


def _export(client: Any, args: argparse.Namespace, out: Any) -> None:
    """Runs the export here (it needs torch, imported only now), reading the job's store and
    data.tokenizer from its job.json on this node; with --store, ds3dd is not asked (the job
    may be unknown to it or ds3dd not running), so only --tokenizer is written. An --out URL
    is opened and must be empty before the checkpoint is downloaded."""
    import tempfile
    from pathlib import Path

    from ds3d.checkpoints.storage import job_store_url, open_storage
    from ds3d.trainer.config import JobConfig
    from ds3d.trainer.errors import NotFoundError

    store, tokenizer, tokenizer_from = args.store, args.tokenizer, "--tokenizer"
    if store is None:
        run_dir = client.call("GetJob", pb.JobRef(name=args.job)).job.run_dir
        job_json = Path(run_dir) / "job.json"
        if not job_json.is_file():
            raise NotFoundError(f"{job_json} is not readable from here; run export on the job's "
                                "head node, or give --store (the job's store prefix)"
                                + (" and --tokenizer" if args.format == "hf" else ""))
        cfg = JobConfig.load_json(job_json)
        store = job_store_url(cfg.checkpoint.store, cfg.name, run_dir)
        if args.format == "hf" and tokenizer is None and cfg.data.tokenizer is not None:
            tokenizer = cfg.data.tokenizer  # a --tokenizer given stays
            tokenizer_from = f"the job's data.tokenizer={tokenizer!r}"
    from ds3d.trainer.export import export

    if "://" in args.out:
        try:
            dest = open_storage(args.out)
        except Ds3dError as e:
            raise UsageError(f"--out {args.out}: {e}") from None
        if held := dest.list(""):
            names = ", ".join(o.key for o in held[:5]) + (" ..." if len(held) > 5 else "")
            raise UsageError(f"--out {args.out} is not empty (it holds {names}); give an empty "
                             "prefix, so that no earlier export's files mix with this one's")
        with tempfile.TemporaryDirectory(prefix="ds3d-export-") as tmp:
            cfg_out = export(store, tmp, args.step, args.format, tokenizer, tokenizer_from)
            for name in cfg_out["files"]:
                dest.put_file(Path(tmp) / name, name)
    else:
        cfg_out = export(store, args.out, args.step, args.format, tokenizer, tokenizer_from)
    how = ("transformers.AutoModelForCausalLM.from_pretrained(PATH)" if args.format == "hf"
           else "ds3d.trainer.export.load_exported(PATH)")
    where = ("give --tokenizer: with --store, the job's data.tokenizer is not read" if args.store
             else "set data.tokenizer or give --tokenizer")
    note = ("" if args.format != "hf" or tokenizer else
            f"; no tokenizer known ({where}), none written")
    print(f"{args.job}: exported step {cfg_out['step']} ({cfg_out['parameters']:,} parameters, "
          f"{cfg_out['dtype']}) to {args.out}: {', '.join(cfg_out['files'])}; load with "
          f"{how}{note}", file=out)


def _size_hint(details: str) -> str:
    """What to do about gRPC's own size refusals, which name no setting: a request over
    ds3dd's --max-request-bytes ("SERVER: ..."), an answer over what ds3dctl receives."""
    if "SERVER: Received message larger than max" in details:
        return ("; the request is larger than ds3dd accepts: make it smaller (e.g. the job file "
                "and the files it names), or start ds3dd with a larger --max-request-bytes")
    if "CLIENT: Received message larger than max" in details:
        return "; the answer is larger than ds3dctl receives: ask for less (e.g. --limit, --lines)"
    return ""


def main(argv: list[str] | None = None) -> None:
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        code = run(args)
    except UsageError as e:
        print(f"ds3dctl: error: {e}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except Ds3dError as e:
        print(f"ds3dctl: {e}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except grpc.RpcError as e:
        status = e.code()
        answered = ("ds3d-error", "1") in tuple(e.trailing_metadata() or ())
        if status == grpc.StatusCode.UNAVAILABLE and not answered:
            addr = args.addr if args is not None else DEFAULT_ADDR
            print(f"ds3dctl: cannot reach ds3dd at {addr}: {e.details()}; is it running? "
                  "(--addr or DS3D_ADDR)", file=sys.stderr)
            code = EXIT_UNREACHABLE
        else:
            print(f"ds3dctl: {status.name}: {e.details()}{_size_hint(e.details() or '')}",
                  file=sys.stderr)
            code = EXIT_BAD_INPUT if status in _USER_CODES or answered else 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
