"""Fault detection inside the step loop, and fault injection for rehearsals.

Detection is local and cheap (the loss and gradient norm every rank already has); the decision
is collective: the loop folds each rank's verdict into its one per-step all-reduce, so a NaN on
one rank becomes the same recovery on all ranks (a rank-0-only decision once let other ranks'
bad gradients through).

Injection ("chaos drills") is requested by the daemon through `control/inject.json`
{"id", "kind", "rank", "at_step"} and only works when the daemon runs with
--enable-fault-injection (the daemon refuses to write the file otherwise). The kinds are
`FaultKind` (trainer/kinds.py); `FAULT_ACTIONS` below gives each its behaviour, and a unit test
checks that it covers exactly the registry. A fault fires once: before acting, the target rank
records `control/inject-done-<id>`, so a restarted worker does not crash again at the same step.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import FaultsConfig
from .kinds import FaultKind, RecordKind

EXIT_INJECTED_CRASH = 13


class SpikeDetector:
    """A loss above the running median by k median-absolute-deviations, and by at least a
    fraction of the median, for m steps in a row. The fraction is the MAD's floor: late in a
    smooth run the MAD shrinks until k of them are noise (a soak saw a 5% wobble declared a
    spike by 20 MADs of 0.0033)."""

    def __init__(self, cfg: FaultsConfig) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)
        self.run = 0
        self.median = self.threshold = math.nan  # of the last judged loss (for the report)

    def observe(self, loss: float) -> bool:
        spike = above = False
        if len(self.history) >= min(self.cfg.spike_window, 10):
            med = statistics.median(self.history)
            mad = statistics.median(abs(x - med) for x in self.history) or 1e-8
            rise = max(self.cfg.spike_mads * mad, self.cfg.spike_min_rise * abs(med))
            self.median, self.threshold = med, med + rise
            above = loss > self.threshold
            self.run = self.run + 1 if above else 0
            spike = self.run >= self.cfg.spike_patience
        if not above:
            self.history.append(loss)  # a spike (even before it is declared) does not raise
        return spike                   # the baseline it is judged by

    def reset(self) -> None:
        self.history.clear()
        self.run = 0


class RollbackBudget:
    """At most `max_rollbacks` within `rollback_window_steps`: beyond that the job pauses and
    asks for a person instead of looping on the same fault forever."""

    def __init__(self, cfg: FaultsConfig) -> None:
        self.cfg = cfg
        self.at_steps: list[int] = []

    def allow(self, step: int) -> bool:
        self.at_steps = [s for s in self.at_steps if step - s < self.cfg.rollback_window_steps]
        if len(self.at_steps) >= self.cfg.max_rollbacks:
            return False
        self.at_steps.append(step)
        return True


class FaultInjector:
    """Acts on the daemon's injected fault for this rank (rehearsals only)."""

    def __init__(self, run_dir: Path, rank: int, emit=None, spike_steps: int = 3) -> None:
        self.control = run_dir / "control"
        self.rank = rank
        self.emit = emit or (lambda *a, **k: None)
        self.slow = False
        self.spike_steps = spike_steps  # the detector's patience: a spike it must act on
        self._spike: tuple[object, int] | None = None  # (hook handle, spiked steps left)
        self._mtime = 0.0
        self._pending: dict | None = None
        self._unloadable: object | None = None  # the state-dict hook of an UNLOADABLE fault
        self.unconvertible = False  # an UNCONVERTIBLE fault: universal_info spoils what it gives

    def _poll(self) -> dict | None:
        path = self.control / "inject.json"
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                req = json.loads(path.read_text())
            except json.JSONDecodeError:
                return None
            done = self.control / f"inject-done-{req.get('id')}"
            mine = int(req.get("rank", -1)) == self.rank
            self._pending = req if mine and not done.exists() else None
        return self._pending

    def before_step(self, step: int, model: torch.nn.Module) -> str | None:
        """Called before training step `step` (1-based number of the step about to finish);
        returns the kind of fault injected now, if any."""
        self._spike_countdown()
        req = self._poll()
        if req is None or int(req.get("at_step", step)) > step:
            return None
        (self.control / f"inject-done-{req['id']}").write_text(str(step))
        self._pending = None
        try:
            kind = FaultKind(req.get("kind"))
        except ValueError:  # only a daemon newer than this trainer writes a kind it lacks
            print(f"ds3d: rank {self.rank} cannot inject fault {req.get('kind')!r} (request "
                  f"{req.get('id')}): this trainer knows {', '.join(FaultKind)}",
                  file=sys.stderr, flush=True)
            return None
        self.emit(RecordKind.FAULT, cause=f"injected_{kind}", step=step,
                  detail=f"drill: injected {kind} on rank {self.rank} (request {req['id']})")
        FAULT_ACTIONS[kind](self, model)
        return kind

    def _crash(self, model: torch.nn.Module) -> None:
        os._exit(EXIT_INJECTED_CRASH)

    def _hang(self, model: torch.nn.Module) -> None:
        while True:
            time.sleep(3600)

    def _slow(self, model: torch.nn.Module) -> None:
        if not self.slow:
            self.slow = True
            _slow_down_forward(model, SLOW_FORWARD_S)

    def _nan(self, model: torch.nn.Module) -> None:
        _poison_next_forward(model)

    def _spike_up(self, model: torch.nn.Module) -> None:
        if self._spike is None:
            self._spike = (_scale_last_layer(model, SPIKE_FACTOR), self.spike_steps)
            self._spike_countdown()

    def _make_unloadable(self, model: torch.nn.Module) -> None:
        if self._unloadable is None:
            self._unloadable = _add_unknown_key(model)

    def _make_unconvertible(self, model: torch.nn.Module) -> None:
        self.unconvertible = True

    def universal_info(self, info: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's `universal_checkpoint_info` (trainer/checkpoint_info.py), with a
        pattern that matches no parameter after an UNCONVERTIBLE fault: DeepSpeed's converter
        asserts that every pattern matched ("Unused patterns ... while merging tp slices")."""
        if not self.unconvertible:
            return info
        key = "tp_replicated_parameter_patterns"
        return {**info, key: [*info[key], UNMATCHED_PATTERN]}

    def after_save(self, ckpt) -> None:
        """After each save: the save an UNLOADABLE fault spoiled is waited for until it is
        durable (committed, on rank 0), then this rank crashes, so that the restart restores
        it. `ckpt`: the loop's CheckpointManager."""
        if self._unloadable is None:
            return
        ckpt.wait_uploads(timeout=600.0)
        os._exit(EXIT_INJECTED_CRASH)

    def _spike_countdown(self) -> None:
        """Counts the spiked steps in training order (a rollback does not bring them back):
        the spike ends after `spike_steps` steps, as a bad data window would."""
        if self._spike is None:
            return
        handle, left = self._spike
        if left <= 0:
            handle.remove()  # type: ignore[attr-defined]
            self._spike = None
        else:
            self._spike = (handle, left - 1)


# Each injectable fault's behaviour on the target rank, by kind: exactly the registry's kinds
# (tests/unit/test_kinds.py), so a kind added to FaultKind without a behaviour fails a test.
FAULT_ACTIONS: dict[FaultKind, Callable[[FaultInjector, torch.nn.Module], None]] = {
    FaultKind.CRASH: FaultInjector._crash,
    FaultKind.HANG: FaultInjector._hang,
    FaultKind.SLOW: FaultInjector._slow,
    FaultKind.NAN: FaultInjector._nan,
    FaultKind.SPIKE: FaultInjector._spike_up,
    FaultKind.UNLOADABLE: FaultInjector._make_unloadable,
    FaultKind.UNCONVERTIBLE: FaultInjector._make_unconvertible,
}

SLOW_FORWARD_S = 0.1  # per micro-batch: a straggler is slow where it computes, not between steps
SPIKE_FACTOR = 50.0  # logits x 50: an over-confident model whose loss jumps several-fold


def _slow_down_forward(model: torch.nn.Module, seconds: float) -> None:
    """Every forward of this rank's first layer takes `seconds` longer from now on: a device
    that computes slowly (throttled, degraded), which the others then wait for."""
    layers = getattr(model, "forward_funcs", None) or list(model.children()) or [model]
    first = next(layer for layer in layers if isinstance(layer, torch.nn.Module))
    first.register_forward_pre_hook(lambda _module, _inputs: time.sleep(seconds))


def _poison_next_forward(model: torch.nn.Module) -> None:
    """The next forward output of this rank's first layer becomes NaN (once): a NaN that comes
    from one batch, as bad data or an overflow would produce it."""
    layers = getattr(model, "forward_funcs", None) or list(model.children()) or [model]
    first = next(layer for layer in layers if isinstance(layer, torch.nn.Module))
    handle = None

    def hook(_module, _inputs, output):
        handle.remove()
        return output * float("nan") if torch.is_floating_point(output) else output

    handle = first.register_forward_hook(hook)


def _scale_last_layer(model: torch.nn.Module, factor: float):
    """Every forward output of this rank's last layer is multiplied by `factor` until the
    returned hook handle is removed. On a last-stage rank that layer is the head: the logits
    grow, so the computed loss (and its gradients) really jump; the detector sees that loss."""
    layers = getattr(model, "forward_funcs", None) or list(model.children()) or [model]
    last = next(layer for layer in reversed(layers) if isinstance(layer, torch.nn.Module))
    return last.register_forward_hook(
        lambda _module, _inputs, output: output * factor if torch.is_floating_point(output)
        else output)


UNKNOWN_KEY = "ds3d_drill_unknown_key"
UNMATCHED_PATTERN = r".*\.ds3d_drill_no_such_parameter$"


def _add_unknown_key(model: torch.nn.Module) -> object:
    """From now on the state dict of this rank's first layer has a key the layer does not
    have: what it saves passes every size and sha256 check (they are taken of the bytes
    written), and DeepSpeed's strict load of it fails ("Unexpected key(s) in state_dict")."""
    layers = getattr(model, "forward_funcs", None) or list(model.children()) or [model]
    first = next(layer for layer in layers if isinstance(layer, torch.nn.Module))

    def hook(_module, state_dict, prefix, _local_metadata):
        state_dict[prefix + UNKNOWN_KEY] = torch.zeros(1)

    return first._register_state_dict_hook(hook)
