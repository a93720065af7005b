"""multiprocessing's forkserver, started as a fork of the calling process instead of a fresh
interpreter.

Why: the agent has imported torch (~1.1 CPU-s) by the time it starts its forkserver
(daemon/agent.py), and multiprocessing execs a new Python for the server, which imports torch
again before its own preload (`torch._dynamo`, DeepSpeed, the trainer). Forked, the server
starts with torch imported: one import less per agent start, which every launch (and
relaunch) of every node paid: about half of the forkserver's CPU (2.4 -> 1.1-1.2 s on a 2-core
VM), and its workers are forked that much sooner.

How: `ForkServer.ensure_running` makes the listener socket and the "alive" pipe and hands them
to `util.spawnv_passfds`, which execs `python -c 'from multiprocessing.forkserver import main;
main(...)'`. `start` runs `ensure_running` with that one call swapped for a fork whose child
becomes the same server: it closes every other descriptor (as the exec's close_fds did: above
all the parent's end of the alive pipe, or the server would outlive its agent), sets every
signal handler the parent's Python code installed back to the default, runs `forkserver.main`
and leaves by `os._exit`, so that it never returns into the caller's stack (whose handlers
would write the agent's result file). What the parent had made before the fork is moved out
of the cycle collector's reach (`gc.freeze`): an object of the parent's collected in the server
would close a descriptor number the server may by then use for something else.

Only a single-threaded process forks (a thread holding a lock at the fork leaves it held forever
in the child), and only for the command line this module knows; otherwise the server is exec'd
as before. Nothing here initialises CUDA, and the caller must not have either: the workers are
forked from this server and could not use it.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing import forkserver, resource_tracker, util

_SERVER_COMMAND = "from multiprocessing.forkserver import main"


def start(preload: list[str]) -> bool:
    """Starts this process's forkserver, which imports `preload` before it forks any child;
    True if it is a fork of this process, False if it was exec'd (this process runs threads)
    or was already running."""
    resource_tracker.ensure_running()  # exec'd as ever: it must not be a fork of this process
    if not single_threaded():
        start_exec(preload)
        return False
    multiprocessing.set_forkserver_preload(preload)
    forked: list[int] = []
    spawnv_passfds = util.spawnv_passfds
    util.spawnv_passfds = partial(_fork_server, preload, spawnv_passfds, forked)
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawnv_passfds
    return bool(forked)


def start_exec(preload: list[str]) -> None:
    """Starts this process's forkserver as multiprocessing does: a new interpreter, which
    imports `preload` (torch first) beside this process."""
    multiprocessing.set_forkserver_preload(preload)
    forkserver.ensure_running()


def single_threaded() -> bool:
    """No other thread runs in this process, Python's or native (the kernel's task list)."""
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: the native threads cannot be counted
        return False
    return threading.active_count() == 1 and tasks == 1


def _fork_server(preload: list[str], spawnv_passfds: Callable[..., int], forked: list[int],
                 path: str | bytes, args: Sequence[str | bytes], passfds: Sequence[int]) -> int:
    """`util.spawnv_passfds` for the forkserver's command: the same server, forked."""
    if len(passfds) != 2 or not any(_SERVER_COMMAND in os.fsdecode(a) for a in args):
        return spawnv_passfds(path, args, passfds)  # not the command this module knows
    listener_fd, alive_r = passfds
    for stream in (sys.stdout, sys.stderr):  # the child must not write the parent's buffers
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid:
        forked.append(pid)
        return pid
    code = 1
    try:
        gc.freeze()
        _close_fds_except((0, 1, 2, listener_fd, alive_r))
        _default_signal_handlers()
        _title_as_forkserver()
        forkserver.main(listener_fd, alive_r, preload)
        code = 0
    except SystemExit as e:  # main's way out once every client has gone
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - reported, then the server ends
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:  # noqa: BLE001 - nothing left to report it to
                pass
        os._exit(code)


def _title_as_forkserver() -> None:
    """`ps` would show the server with its parent's command line: a second agent, it seemed."""
    import setproctitle

    setproctitle.setproctitle(f"multiprocessing forkserver of: {setproctitle.getproctitle()}")


def _close_fds_except(keep: tuple[int, ...]) -> None:
    """Closes every descriptor but `keep`. No empty range is passed to os.closerange: CPython
    hands close_range(2) the range's end minus one, and os.closerange(0, 0) closed every
    descriptor of the process (its end, -1, is the largest unsigned)."""
    low = 0
    for fd in sorted(set(keep)):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _default_signal_handlers() -> None:
    """The handlers an exec'd interpreter would start with: every handler Python code of this
    process installed is back to the default (SIGINT's to KeyboardInterrupt). Dispositions
    that are not Python functions stay: an exec keeps the ignored signals it inherits, and
    Python ignores SIGPIPE and SIGXFSZ itself."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            current = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if not callable(current) or current is signal.default_int_handler:
            continue  # SIG_DFL, SIG_IGN, None (set outside Python), or SIGINT's own default
        try:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
