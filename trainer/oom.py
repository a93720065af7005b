"""What a worker knows when it runs out of memory, gathered into one report record.

Why here and not in the daemon: only the process that failed knows what it tried to allocate,
how much it held at its peak and which limit it ran into; after it exits that evidence is gone.
The worker writes it as a `fault` record with cause `oom` (trainer/report.py) and exits with
`EXIT_OOM`; the daemon turns it into a diagnosis that names the fix (daemon/oom.py).

How an out-of-memory shows up, by allocator:
* CUDA: `torch.OutOfMemoryError` ("CUDA out of memory. Tried to allocate 2.00 GiB ...");
* CPU tensors: a plain `RuntimeError` from c10's DefaultCPUAllocator ("can't allocate memory:
  you tried to allocate 8589934592 bytes", torch 2.13 raises no OutOfMemoryError for it);
* Python objects (numpy, bytearray): `MemoryError`.
The kernel's OOM killer sends SIGKILL instead: nothing to catch, see daemon/oom.py.
"""

from __future__ import annotations

import os
import re
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

from .kinds import RecordKind

EXIT_OOM = 12  # ENOMEM: the agent restarts the group; the daemon reads the `fault` record (cause
#               "oom") first

_MARKERS = ("out of memory", "can't allocate memory", "std::bad_alloc",
            "cannot allocate memory")
_CPU_BYTES = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)
_CUDA_SIZE = re.compile(r"tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNLIMITED = 2**60  # cgroup v1 reports "no limit" as a huge page-rounded number


def is_oom(exc: BaseException) -> bool:
    """True for an allocation failure of any allocator (not for an error that only mentions
    memory in passing: the allocators' own phrases are matched)."""
    import torch

    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _MARKERS)


def requested_bytes(message: str) -> int | None:
    """The size of the allocation that failed, when the allocator said it."""
    if m := _CPU_BYTES.search(message):
        return int(m.group(1))
    if m := _CUDA_SIZE.search(message):
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return None


def _cgroup_dir(proc_cgroup: str) -> tuple[Path, int] | None:
    """This process's memory cgroup directory and its version (2 or 1)."""
    v1 = None
    for line in proc_cgroup.splitlines():
        hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hier == "0" and controllers == "":
            d = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (d / "memory.max").exists():
                return d, 2
        elif "memory" in controllers.split(","):
            v1 = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    if v1 is not None and (v1 / "memory.limit_in_bytes").exists():
        return v1, 1
    root = Path("/sys/fs/cgroup/memory")  # a container sees its own cgroup as the root
    return (root, 1) if (root / "memory.limit_in_bytes").exists() else None


class CgroupMemory:
    """The memory cgroup of a process: its limit, peak and OOM-kill counter (v2 or v1).

    Read by the worker (the limit it ran into) and by the daemon (did the kernel's OOM killer
    end a worker: `oom_kill` grew). `root` lets tests point it at a fake directory."""

    def __init__(self, root: Path, version: int) -> None:
        self.root, self.version = Path(root), version

    @classmethod
    def of_self(cls) -> CgroupMemory | None:
        try:
            found = _cgroup_dir(Path("/proc/self/cgroup").read_text())
        except OSError:
            return None
        return cls(*found) if found else None

    def _read(self, name: str) -> str | None:
        try:
            return (self.root / name).read_text()
        except OSError:
            return None

    def _int(self, name: str) -> int | None:
        text = self._read(name)
        if text is None or text.strip() in ("", "max"):
            return None
        try:
            value = int(text.split()[0])
        except ValueError:
            return None
        return value if value < _UNLIMITED else None

    def limit(self) -> int | None:
        return self._int("memory.max" if self.version == 2 else "memory.limit_in_bytes")

    def peak(self) -> int | None:
        return self._int("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")

    def oom_kills(self) -> int | None:
        """Processes the kernel's OOM killer ended in this cgroup (cumulative)."""
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return None


def memory_limit() -> tuple[int | None, str]:
    """The tightest memory limit of this process on the host: (bytes, what it is)."""
    found: list[tuple[int, str]] = []
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append((soft, "RLIMIT_AS"))
    cg = CgroupMemory.of_self()
    if cg is not None and (lim := cg.limit()) is not None:
        found.append((lim, "cgroup memory.max" if cg.version == 2 else
                      "cgroup memory.limit_in_bytes"))
    return min(found) if found else (None, "")


def _peak_virtual() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _phase(tb) -> str:
    """Where in the worker it failed, from the traceback's frames (innermost match wins)."""
    phase, engine, loop = "train", f"{__package__}.engine", f"{__package__}.loop"
    names = {(engine, "__init__"): "build", (engine, "run"): "step",
             (loop, "save"): "checkpoint save", (loop, "_load"): "checkpoint load",
             (loop, "__init__"): "build"}
    for frame, _ in traceback.walk_tb(tb):
        phase = names.get((frame.f_globals.get("__name__", ""), frame.f_code.co_name), phase)
    return phase


def memory_knobs(cfg) -> dict[str, Any]:
    """The job settings that decide memory use, which the diagnosis's fix refers to (also what
    the daemon knows of an OOM-killed worker that could not report, daemon/oom.py)."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    return {"pp": p.pp, "tp": p.tp, "dp": p.dp, "zero_stage": p.zero_stage,
            "micro_batch_size": t.micro_batch_size, "seq_len": m.seq_len,
            "n_layers": m.n_layers, "n_heads": m.n_heads,
            "activation_checkpoint_interval": p.activation_checkpoint_interval}


def oom_evidence(exc: BaseException, cfg, device, last_step: int | None,
                 layout=None) -> dict[str, Any]:
    """The `oom` fault record's fields: where (stage, step, phase), what (the error, the
    allocation that failed), how much (peak, limit) and the knobs that set memory use.
    `last_step` is the last completed step (None: the trainer was still being built)."""
    import torch

    phase = _phase(exc.__traceback__) if last_step is not None else "build"
    # a step is counted once it finished: the one that failed is the next
    step = None if last_step is None else last_step + (phase in ("step", "train"))
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = re.sub(r"^\[enforce fail at [^\]]*\] (err == 0\. )?", "", message)
    ev: dict[str, Any] = {
        "step": step, "phase": phase, "error": message[:300],
        "error_type": type(exc).__name__, "device": str(device),
        "stage": layout.stage if layout is not None else None,
        **memory_knobs(cfg), "requested_bytes": requested_bytes(str(exc)),
    }
    if device.type == "cuda":
        ev["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        ev["peak_kind"] = "allocated on the GPU"
        ev["limit_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
        ev["limit_kind"] = "GPU memory"
    else:
        # Linux reports ru_maxrss in KiB
        ev["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ev["peak_kind"] = "resident"
        ev["limit_bytes"], ev["limit_kind"] = memory_limit()
        if ev["limit_kind"] == "RLIMIT_AS":  # an address-space limit counts virtual memory
            ev["peak_virtual_bytes"] = _peak_virtual()
    return ev


def report_oom(ev: dict[str, Any], emit, rank: int) -> int:
    """Writes the evidence, one log line (no traceback: the record has what matters) and
    returns the worker's exit code."""
    emit(RecordKind.FAULT, cause="oom", detail=f"out of memory in {ev['phase']}: {ev['error']}",
         **ev)
    gib = (ev.get("peak_bytes") or 0) / 2**30
    at = f"step {ev['step']}" if ev["step"] is not None else "start-up"
    print(f"ds3d-worker: rank {rank} out of memory at {at} ({ev['phase']}, peak "
          f"{gib:.2f} GiB {ev.get('peak_kind', '')}): {ev['error']}", file=sys.stderr,
          flush=True)
    return EXIT_OOM


def exit_now(code: int) -> None:
    """Leaves without the interpreter's teardown: the other ranks may be blocked in a
    collective with this one, and a destructor that waits on them would hang the exit."""
    sys.stderr.flush()
    os._exit(code)
