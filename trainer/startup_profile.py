"""Where a worker's start goes, for an operator asking why a restart is slow.

`DS3D_STARTUP_PROFILE=DIR` in the workers' environment (ds3dd passes its own environment on)
profiles each worker's training thread with cProfile from before the engine's build to its
first reported step, in two parts: `build_and_load` (the engine build, the checkpoint read
beside it, the load) and `first_step` (the set-up after the load and the first step). Each part
is written as DIR/startup-rank<R>-restart<N>-<part>.prof (pstats, for snakeviz or
`python -m pstats`) and a .txt summary: the calls by cumulative and by own time, and the
modules first imported during the part (what the forkserver's preload could import once
instead: daemon/agent.py TRAINER_PRELOAD). Before Python 3.12 cProfile sees only the training
thread; from 3.12 (sys.monitoring) it also counts the calls of the threads running beside it
(the checkpoint read, the arena's pinning). Profiling slows Python-heavy code, so the seconds
are for comparing parts, not for the restore's figures.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

ENV = "DS3D_STARTUP_PROFILE"
TOP = 50  # calls listed in each .txt summary


class StartupProfile:
    """One worker's profiler; `part(name)` ends the current part (written out) and starts the
    next, `stop()` ends the last."""

    def __init__(self, folder: Path, rank: int, restart: int) -> None:
        self.folder, self.stem = folder, f"startup-rank{rank}-restart{restart}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._modules = set(sys.modules)
        self._profile: cProfile.Profile | None = cProfile.Profile()
        self._profile.enable()

    @classmethod
    def from_env(cls, rank: int, restart: int) -> StartupProfile | None:
        folder = os.environ.get(ENV, "").strip()
        return cls(Path(folder), rank, restart) if folder else None

    def part(self, name: str, next_part: bool = True) -> None:
        profile, self._profile = self._profile, None
        if profile is None:
            return
        profile.disable()
        path = self.folder / f"{self.stem}-{name}"
        profile.dump_stats(str(path) + ".prof")
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        for order in ("cumulative", "tottime"):
            text.write(f"== by {order} ==\n")
            stats.sort_stats(order).print_stats(TOP)
        imported = sorted(set(sys.modules) - self._modules)
        self._modules = set(sys.modules)
        text.write(f"== modules first imported during this part ({len(imported)}) ==\n")
        text.write("\n".join(imported) + "\n")
        Path(str(path) + ".txt").write_text(text.getvalue())
        if next_part:
            self._profile = cProfile.Profile()
            self._profile.enable()

    def stop(self, name: str) -> None:
        self.part(name, next_part=False)
