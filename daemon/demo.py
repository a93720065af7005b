"""`make demo`: the main job on embedded defaults, end to end on this machine.

Starts `ds3dd` (state in ./.ds3d, listening on a Unix socket there), submits the `tiny` preset as
a 3D-parallel job (TP 2 x PP 2 x DP 1 = 4 worker processes on CPU, gloo) whose checkpoints go to
the embedded file store, follows its events to the end, prints its status and checkpoints, and
stops the daemon. Every step goes through the real binaries (`ds3dd`, `ds3dctl`), as an operator
would run them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def _ctl(addr: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ds3d.daemon.cli", "--addr", addr, *args]
    print(f"$ ds3dctl {' '.join(args)}", flush=True)
    proc = subprocess.run(cmd, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"ds3dctl {args[0]} failed with exit code {proc.returncode}")
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds3d.daemon.demo", description=__doc__)
    ap.add_argument("--state-dir", default=".ds3d", help="daemon state (default ./.ds3d)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fresh", action="store_true", help="delete the state dir first")
    args = ap.parse_args(argv)

    state = Path(args.state_dir).resolve()
    if args.fresh:
        shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    sock = state / "ds3dd.sock"
    addr = f"unix:{sock}"
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    print(f"starting ds3dd (state {state}, log {state / 'ds3dd.log'})", flush=True)
    with open(state / "ds3dd.out", "ab") as out:
        daemon = subprocess.Popen([sys.executable, "-m", "ds3d.daemon.main", "--state-dir",
                                   str(state), "--listen", addr], stdout=out, stderr=out, env=env)
    try:
        for _ in range(300):
            if sock.exists():
                break
            if daemon.poll() is not None:
                raise SystemExit(f"ds3dd exited with {daemon.returncode}; see {state}/ds3dd.out")
            time.sleep(0.1)
        name = f"demo-{time.strftime('%H%M%S')}"
        _ctl(addr, "start", "tiny", "--name", name, "--tp", "2", "--pp", "2", "--dp", "1",
             "--steps", str(args.steps), "--set", "checkpoint.interval=10")
        _ctl(addr, "events", name, "--follow")
        _ctl(addr, "status", name)
        _ctl(addr, "checkpoints", name)
        print(f"\njob folder: {state / 'jobs' / name}  (reports/, ckpt/, store/, logs/)")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
