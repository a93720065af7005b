"""The node agent process: torch.distributed.elastic running this node's share of the workers.

Started by launcher.py as `python -m ds3d.daemon.agent --spec SPEC.json` in a session of its own,
so that SIGKILL of ds3dd does not take the training with it. It runs `elastic_launch` with a c10d
rendezvous on the job's store process (rendezvous.py) and the worker entry
`python -m ds3d.trainer.worker --run-dir RUN_DIR`; the agent restarts a failed worker group up
to `max_restarts` times by itself.

On its way out it writes `control/agent-<attempt>.exit` (JSON: exit_code, error) atomically:
after a daemon restart the agent is no longer the daemon's child, so its exit status can only be
learned from that file. No file means the agent itself was killed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any


def write_result(path: Path, exit_code: int, error: str = "") -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"exit_code": exit_code, "error": error, "time": time.time()}))
    os.replace(tmp, path)


def _write_pid_file(path: Path) -> None:
    """pid + start time of this agent, written first thing: a daemon that died between starting
    the agent and recording it finds the agent here (launcher.find)."""
    import psutil

    me = psutil.Process()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": me.pid, "started": me.create_time()}))
    os.replace(tmp, path)


def run(spec: dict[str, Any]) -> tuple[int, str]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=spec["min_nodes"],
        max_nodes=spec["max_nodes"],
        nproc_per_node=spec["nproc_per_node"],
        run_id=spec["run_id"],
        role="ds3d",
        rdzv_backend="c10d",
        rdzv_endpoint=spec["rdzv_endpoint"],
        rdzv_configs=spec["rdzv_configs"],
        max_restarts=spec["max_restarts"],
        monitor_interval=spec.get("monitor_interval", 0.5),
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=spec["log_dir"], redirects=Std.ALL),
        local_addr=spec.get("local_addr"),
    )
    entry = ["-m", spec["worker_module"], "--run-dir", spec["run_dir"]]
    try:
        elastic_launch(config, sys.executable)(*entry)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        print(f"ds3d agent: worker group failed: exit codes by rank {codes}", flush=True)
        if any(c == EXIT_CONFIG for c in codes.values()) and \
                all(c == EXIT_CONFIG or c < 0 for c in codes.values()):
            # ranks refused the configuration (the others were ended by the agent, < 0): passed
            # on, so that the daemon does not restart what cannot work
            return EXIT_CONFIG, _last_line(Path(spec["log_dir"]), _REFUSAL) or \
                "worker configuration refused (exit code 2)"
        error = _last_line(Path(spec["log_dir"]), _EXCEPTION)
        return 1, f"worker group failed: exit codes by rank {codes}" + \
            (f"; last worker error: {error}" if error else "")
    return 0, ""


EXIT_CONFIG = 2  # trainer/worker.py: configuration refused


# torch prefixes a worker's traceback lines with "[rankN]: "
_REFUSAL = re.compile(r"^(?:\[rank\d+\]:\s*)?ds3d-worker: (.*)$")
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+)(?:Error|Exception|Interrupt)\b.*)$")


def _last_line(log_dir: Path, pattern: re.Pattern[str]) -> str:
    """The last line matching `pattern` (its first group) in the newest worker stderr log of
    this agent that has one: the workers' refusal or exception, for the daemon's message."""
    best: tuple[float, str] = (0.0, "")
    for log in log_dir.glob("*/attempt_*/*/stderr.log"):
        try:
            found = [m.group(1) for ln in log.read_text(errors="replace").splitlines()
                     if (m := pattern.match(ln))]
            mtime = log.stat().st_mtime
        except OSError:
            continue
        if found and mtime >= best[0]:
            best = (mtime, found[-1][:500])
    return best[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ds3d.daemon.agent")
    ap.add_argument("--spec", type=Path, required=True, help="agent spec JSON (launcher.py)")
    a = ap.parse_args(argv)
    spec = json.loads(a.spec.read_text())
    result = Path(spec["result_file"])
    _write_pid_file(Path(spec["pid_file"]))
    code, error = 1, ""
    try:
        code, error = run(spec)
    except BaseException as e:  # noqa: BLE001 - recorded for the daemon, then re-raised
        error = f"{type(e).__name__}: {e}"
        write_result(result, 1 if not isinstance(e, SystemExit) else int(e.code or 0), error)
        raise
    write_result(result, code, error)
    sys.exit(code)


if __name__ == "__main__":
    main()
