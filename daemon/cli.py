"""`ds3dctl`: the command line of ds3d (also `python -m ds3d.daemon.cli`).

    ds3dctl start tiny --name t1 --steps 20 --set train.lr=1e-3
    ds3dctl status [JOB] [--json]      ds3dctl list [--all]
    ds3dctl pause JOB [--fast] | resume JOB | stop JOB [--now]
    ds3dctl events JOB [--follow]      ds3dctl logs JOB
    ds3dctl checkpoints JOB | save JOB | rollback JOB STEP
    ds3dctl start tiny --nodes 2 --dp 2 --hosts HEAD_ADDR,NODE2_ADDR --store URL   (multi-node)
    ds3dctl inject JOB nan|hang|crash|slow --rank R [--at-step S]  (ds3dd --enable-fault-injection)
    ds3dctl rebalance JOB [--dry-run] [--json]   pipeline partition from measured layer costs

The daemon address comes from --addr or DS3D_ADDR (default 127.0.0.1:7531); the token from
--token-file or DS3D_TOKEN. The job configuration is validated here first (same schema as the
daemon), so mistakes are reported before anything is sent. Bad input — a wrong flag, an invalid
configuration, or a request the daemon refuses — is a message on stderr and exit code 2, never a
traceback; an unreachable daemon is exit code 3.

This module imports grpc, the generated stubs and the pydantic config only — never torch or
deepspeed — so the CLI starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import Ds3dError
from ds3d.v1 import control_pb2 as pb
from ds3d.v1 import control_pb2_grpc as pb_grpc

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


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ds3dctl", description="control ds3d training jobs")
    ap.add_argument("--addr", default=os.environ.get("DS3D_ADDR", DEFAULT_ADDR),
                    help="daemon address HOST:PORT or unix:PATH (env DS3D_ADDR)")
    ap.add_argument("--token-file", default=os.environ.get("DS3D_TOKEN_FILE"),
                    help="file with the bearer token (or env DS3D_TOKEN)")
    ap.add_argument("--tls-ca", default=os.environ.get("DS3D_TLS_CA"))
    ap.add_argument("--tls-cert", default=os.environ.get("DS3D_TLS_CERT"))
    ap.add_argument("--tls-key", default=os.environ.get("DS3D_TLS_KEY"))
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("start", help="validate and start a job")
    s.add_argument("source", metavar="PRESET|CONFIG.toml")
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
    s.add_argument("--json", action="store_true")

    p = sub.add_parser("pause", help="save a checkpoint and stop the workers")
    p.add_argument("job")
    p.add_argument("--fast", action="store_true", help="do not wait for the upload")
    sub.add_parser("resume", help="start a paused job again").add_argument("job")
    p = sub.add_parser("stop", help="end a job (saves a checkpoint unless --now)")
    p.add_argument("job")
    p.add_argument("--now", action="store_true", help="kill the workers without saving")
    p = sub.add_parser("status", help="one job, or all live jobs")
    p.add_argument("job", nargs="?")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("list", help="jobs of this daemon")
    p.add_argument("--all", action="store_true", help="include finished jobs")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("events", help="a job's event history")
    p.add_argument("job")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--kind", action="append", default=[])
    p.add_argument("--step-every", type=int, default=1, help="one step event per N steps")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("logs", help="tail of the agent and worker logs")
    p.add_argument("job")
    p.add_argument("--source", default="", help="agent or rank:N (local rank)")
    p.add_argument("--lines", type=int, default=50)
    p.add_argument("--tensorboard", action="store_true",
                   help="print where the job's TensorBoard event files are and how to view them")
    p = sub.add_parser("export", help="consolidated model weights (safetensors + config.json) "
                       "of a committed checkpoint, from any (TP, PP, DP) layout")
    p.add_argument("job")
    p.add_argument("--step", type=int, help="default: the newest committed checkpoint")
    p.add_argument("--out", required=True, help="output folder, or s3://bucket/prefix")
    p.add_argument("--store", help="the job's store prefix, when RUN_DIR/job.json cannot be "
                   "read from here")
    p = sub.add_parser("checkpoints", help="checkpoints of a job")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    sub.add_parser("save", help="save a checkpoint now").add_argument("job")
    p = sub.add_parser("rollback", help="restart from the checkpoint of STEP")
    p.add_argument("job")
    p.add_argument("step", type=int)
    p = sub.add_parser("rebalance", help="measured per-stage times and predicted bubble/step "
                       "time of the current and the best pipeline partition; applies the best "
                       "one (checkpoint, restart) unless --dry-run")
    p.add_argument("job")
    p.add_argument("--dry-run", action="store_true", help="only show; change nothing")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("inject", help="drills: make one rank misbehave (needs ds3dd "
                       "--enable-fault-injection)")
    p.add_argument("job")
    p.add_argument("kind", choices=("nan", "hang", "crash", "slow"))
    p.add_argument("--rank", type=int, required=True, help="global rank")
    p.add_argument("--at-step", type=int, default=0,
                   help="step at which it happens (default: the next step)")
    return ap


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
            try:
                token = open(args.token_file).read().strip()
            except OSError as e:
                raise UsageError(f"--token-file: {e}") from None
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.stub = pb_grpc.ControlStub(self.channel)

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)

    def stream(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata)


# ---- output ---------------------------------------------------------------------------------


def _state(n: int) -> str:
    return pb.JobState.Name(n) if n else "-"


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
        "eta_s": j.eta_s, "restarts": j.restarts, "last_checkpoint_step": j.last_checkpoint_step,
        "layout": {"tp": j.spec.tp, "pp": j.spec.pp, "dp": j.spec.dp,
                   "zero_stage": j.spec.zero_stage, "nnodes": j.spec.nnodes},
        "world_size": j.world_size, "message": j.message, "node": j.node, "run_dir": j.run_dir,
        "partition": {"boundaries": list(j.stage_boundaries), "source": j.partition_source},
        "created_at": j.created_at, "updated_at": j.updated_at,
    }


def job_table(jobs: Sequence[pb.JobStatus]) -> str:
    head = ("NAME", "STATE", "STEP", "LOSS", "TOKENS/S", "ETA", "RESTARTS", "LAYOUT", "MESSAGE")
    rows = [head]
    for j in jobs:
        state = _state(j.state)
        if j.desired_state != j.state and j.state in (pb.RUNNING, pb.STARTING, pb.RECOVERING):
            state += f"->{_state(j.desired_state)}"
        rows.append((j.spec.name, state, f"{j.step}/{j.spec.total_steps}", _loss(j.loss),
                     f"{j.tokens_per_s:,.0f}" if j.tokens_per_s else "-", _duration(j.eta_s),
                     str(j.restarts), f"tp{j.spec.tp} pp{j.spec.pp} dp{j.spec.dp}" + (
                         f" {'|'.join(map(str, j.stage_boundaries))}" if j.spec.pp > 1 and
                         j.stage_boundaries else ""),
                     j.message[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def event_line(e: pb.Event) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(e.time))
    step = f"step {e.step}" if e.step >= 0 else ""
    where = f"rank {e.rank}" if e.rank >= 0 else "daemon"
    if e.kind == "state":
        text = f"{_state(e.from_state)} -> {_state(e.to_state)}: {e.message}"
    else:
        text = e.message
    return f"{t}  {e.kind:<10} {step:<10} {where:<8} {text}"


# ---- commands -------------------------------------------------------------------------------


def run(args: argparse.Namespace, out: Any = sys.stdout) -> int:
    if args.command == "start":
        cfg = build_job_config(args.source, start_overrides(args), args.name)
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
            jobs = list(client.call("ListJobs", pb.ListJobsRequest(
                include_finished=c == "status" or args.all)).jobs)
        if args.json:
            data: Any = [job_dict(j) for j in jobs]
            print(json.dumps(data[0] if c == "status" and args.job else data, indent=2),
                  file=out)
        else:
            print(job_table(jobs) if jobs else "no jobs", file=out)
    elif c == "events":
        req = pb.WatchEventsRequest(name=args.job, follow=args.follow, kinds=args.kind,
                                    step_every=args.step_every)
        for e in client.stream("WatchEvents", req):
            if args.json:
                print(json.dumps({"seq": e.seq, "time": e.time, "kind": e.kind, "step": e.step,
                                  "rank": e.rank, "cause": e.cause, "message": e.message,
                                  "from": _state(e.from_state), "to": _state(e.to_state)}),
                      file=out, flush=True)
            else:
                print(event_line(e), file=out, flush=True)
    elif c == "logs" and args.tensorboard:
        run_dir = client.call("GetJob", pb.JobRef(name=args.job)).job.run_dir
        path = os.path.join(run_dir, "tensorboard")
        print(f"{path}\nview: tensorboard --logdir {path} --bind_all  (then open port 6006)",
              file=out)
    elif c == "export":
        _export(client, args, out)
    elif c == "logs":
        resp = client.call("GetLogs", pb.GetLogsRequest(name=args.job, tail_lines=args.lines,
                                                        source=args.source))
        for f in resp.files:
            print(f"==> {f.path} ({f.size} bytes) <==\n{f.text}", file=out)
        if not resp.files:
            print("no logs yet", file=out)
    elif c == "checkpoints":
        cks = client.call("ListCheckpoints", pb.ListCheckpointsRequest(name=args.job)).checkpoints
        if args.json:
            print(json.dumps([{"step": k.step, "phase": k.phase, "path": k.path,
                               "time": k.time, "blocked_s": k.blocked_s, "present": k.present}
                              for k in cks], indent=2), file=out)
        elif not cks:
            print("no checkpoints", file=out)
        else:
            for k in cks:
                print(f"step {k.step:<8} {k.phase:<10} blocked {k.blocked_s:6.2f} s  "
                      f"{'present' if k.present else 'absent '}  {k.path}", file=out)
    elif c == "save":
        cid = client.call("SaveCheckpoint", pb.SaveCheckpointRequest(name=args.job)).command_id
        print(f"{args.job}: checkpoint requested (command {cid}); watch with "
              f"`ds3dctl events {args.job} --follow --kind checkpoint`", file=out)
    elif c == "inject":
        resp = client.call("InjectFault", pb.InjectFaultRequest(
            name=args.job, kind=args.kind, rank=args.rank, at_step=args.at_step))
        print(f"{args.job}: {args.kind} on rank {args.rank} at step {resp.at_step} "
              f"(injection {resp.id}, {resp.path})", file=out)
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
                     " ".join(f"{s * 1e3:.1f}" for s in plan.stage_s), f"{plan.slowest_s * 1e3:.1f}",
                     f"{plan.step_s * 1e3:.0f}", f"{plan.bubble:.1%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return (f"{job}: {p} pipeline stages, {r.micro_batches} micro-batches per step; layer costs "
            f"profiled at step {r.profile_step}\n{table}\n"
            f"slowest stage {-r.improvement:+.1%} (threshold {r.threshold:.0%})\n{r.message}")


def _export(client: Any, args: argparse.Namespace, out: Any) -> None:
    """Runs the export here (it needs torch, imported only now), reading the job's store from
    its job.json on this node unless --store is given."""
    import tempfile
    from pathlib import Path

    from ds3d.checkpoints.storage import job_store_url, open_storage
    from ds3d.trainer.config import JobConfig
    from ds3d.trainer.errors import NotFoundError

    store = args.store
    if store is None:
        run_dir = client.call("GetJob", pb.JobRef(name=args.job)).job.run_dir
        job_json = Path(run_dir) / "job.json"
        if not job_json.is_file():
            raise NotFoundError(f"{job_json} is not readable from here; run export on the job's "
                                "head node, or give --store (the job's store prefix)")
        cfg = JobConfig.load_json(job_json)
        store = job_store_url(cfg.checkpoint.store, cfg.name, run_dir)
    from ds3d.checkpoints.export import export

    if args.out.startswith("s3://"):
        with tempfile.TemporaryDirectory(prefix="ds3d-export-") as tmp:
            cfg_out = export(store, tmp, args.step)
            dest = open_storage(args.out)
            for name in ("model.safetensors", "config.json"):
                dest.put_file(Path(tmp) / name, name)
    else:
        cfg_out = export(store, args.out, args.step)
    print(f"{args.job}: exported step {cfg_out['step']} ({cfg_out['parameters']:,} parameters, "
          f"{cfg_out['dtype']}) to {args.out}; load with "
          "ds3d.checkpoints.export.load_exported(PATH)", file=out)


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
        status = e.code()  # type: ignore[attr-defined]
        answered = ("ds3d-error", "1") in tuple(e.trailing_metadata() or ())  # type: ignore[attr-defined]
        if status == grpc.StatusCode.UNAVAILABLE and not answered:
            addr = args.addr if args is not None else DEFAULT_ADDR
            print(f"ds3dctl: cannot reach ds3dd at {addr}: {e.details()}; is it running? "  # type: ignore[attr-defined]
                  "(--addr or DS3D_ADDR)", file=sys.stderr)
            code = EXIT_UNREACHABLE
        else:
            print(f"ds3dctl: {status.name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            code = EXIT_BAD_INPUT if status in _USER_CODES or answered else 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
