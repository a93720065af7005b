"""daemon/forked_forkserver.py: the forkserver is a fork of its caller (what the caller imported
is there without a second import), holds none of the caller's descriptors or signal handlers,
serves children, ends when its caller is gone without running the caller's exit code, and is
exec'd as before where the caller runs threads. Each case runs in a Python of its own: the
forkserver is one per process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

SCRIPT = textwrap.dedent("""
    import atexit, json, multiprocessing, os, signal, sys, threading, types
    from multiprocessing import forkserver
    from pathlib import Path

    from ds3d.daemon import forked_forkserver

    def child_view(queue):
        queue.put({"marker": getattr(sys.modules.get("parent_marker"), "pid", None),
                   "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                   "sigint_default": signal.getsignal(signal.SIGINT) == signal.default_int_handler,
                   "sighup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
                   "parent": os.getppid()})

    if __name__ == "__main__":
        out = Path(sys.argv[1])
        if sys.argv[2] == "thread":
            stop = threading.Event()
            threading.Thread(target=stop.wait, daemon=True).start()
        marker = types.ModuleType("parent_marker")  # imported by the parent alone
        marker.pid = os.getpid()
        sys.modules["parent_marker"] = marker
        held = open(out / "held", "w")  # a descriptor of the parent's
        signal.signal(signal.SIGTERM, lambda *_: None)  # a handler of the parent's
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as if inherited ignored (nohup)
        atexit.register(lambda: (out / f"atexit-{os.getpid()}").touch())
        forked = forked_forkserver.start(["json"])
        server = forkserver._forkserver._forkserver_pid
        ctx = multiprocessing.get_context("forkserver")
        queue = ctx.SimpleQueue()
        proc = ctx.Process(target=child_view, args=(queue,))
        proc.start()
        seen = queue.get()
        proc.join()
        # read once it has served a child: its set-up is done by then
        fds = [os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")]
        (out / "result.json").write_text(json.dumps({
            "forked": forked, "caller": os.getpid(), "server": server, "fds": fds,
            "held": os.readlink(f"/proc/self/fd/{held.fileno()}"), "exitcode": proc.exitcode,
            "cmdline": open(f"/proc/{server}/cmdline").read(), **seen}))
        if stop := globals().get("stop"):
            stop.set()
""")


def run_case(tmp_path: Path, mode: str) -> dict:
    script = tmp_path / "case.py"
    script.write_text(SCRIPT)
    # SIGINT at its default, whoever started pytest: a shell's background job (CI's `.ci/run &`)
    # starts with it ignored, and then an exec'd interpreter keeps it ignored too
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), mode],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(result["server"]) and time.monotonic() < deadline:
        try:
            if psutil.Process(result["server"]).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    result["server_gone"] = not psutil.pid_exists(result["server"]) or \
        psutil.Process(result["server"]).status() == psutil.STATUS_ZOMBIE
    result["atexit_runs"] = sorted(p.name for p in tmp_path.glob("atexit-*"))
    return result


def test_the_server_is_a_fork_that_holds_nothing_of_its_callers(tmp_path):
    r = run_case(tmp_path, "single")
    assert r["forked"] is True
    assert "multiprocessing forkserver of:" in r["cmdline"] and "case.py" in r["cmdline"]
    # none of the caller's descriptors: not its file, nor its end of the alive pipe (or the
    # server would not end with the caller, below)
    assert r["held"].endswith("/held") and r["held"] not in r["fds"], r
    # its child saw what the caller made before the start (a fork), an exec'd interpreter's
    # signal handlers, and was the server's child
    assert r["marker"] == r["caller"]
    assert r["exitcode"] == 0 and r["parent"] == r["server"]
    assert r["sigterm_default"] and r["sigint_default"]
    assert r["sighup_ignored"]  # an exec keeps an ignored signal too
    # the caller gone, the server ended, and only the caller ran its exit handlers
    assert r["server_gone"]
    assert r["atexit_runs"] == [f"atexit-{r['caller']}"], r["atexit_runs"]


def test_a_caller_running_threads_gets_the_execd_server(tmp_path):
    r = run_case(tmp_path, "thread")
    assert r["forked"] is False
    assert "from multiprocessing.forkserver import main" in r["cmdline"]
    assert r["marker"] is None  # a fresh interpreter
    assert r["exitcode"] == 0 and r["parent"] == r["server"] and r["server_gone"]
    assert r["atexit_runs"] == [f"atexit-{r['caller']}"]


AGENT_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from multiprocessing import forkserver

    from ds3d.daemon import agent

    agent.PARALLEL_IMPORT_CPUS = int(sys.argv[1])
    agent._start_forkserver([])
    pid = forkserver._forkserver._forkserver_pid
    for _ in range(600):  # until the server has exec'd or set its title
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
        if "forkserver" in cmdline:
            break
        time.sleep(0.05)
    print(json.dumps({"torch_in_agent": "torch" in sys.modules, "cmdline": cmdline}))
""")


def test_the_agent_starts_the_server_by_its_cpus():
    """Many CPUs: a new interpreter, importing beside the agent (which has not imported torch
    for it); few: a fork of the agent once torch is imported."""
    def start(cpus_needed: int) -> dict:
        out = subprocess.run([sys.executable, "-c", AGENT_SCRIPT, str(cpus_needed)],
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    parallel = start(1)
    assert "from multiprocessing.forkserver import main" in parallel["cmdline"]
    assert parallel["torch_in_agent"] is False
    forked = start(10**6)
    assert "from multiprocessing.forkserver import main" not in forked["cmdline"]
    assert forked["torch_in_agent"] is True
