"""Where a step's time goes, per rank: forward, backward, optimizer, pipeline send/recv wait,
data-parallel gradient reduction, loading micro-batches.

Measured on sampled steps only (every `train.timing_interval` steps), so that it can stay on:
on a sampled step each part is timed with the device synchronised around it (on a GPU this
serialises the step a little; unsampled steps run untouched). For the pipeline engine the
parts are DeepSpeed's schedule instructions (its `_INSTRUCTION_MAP`, wrapped per engine
instance); for the non-pipelined engine (PP = 1, ZeRO-2/3) forward, backward and optimizer
step, where the gradient reduction overlaps the backward pass and is counted in it.

Beside the parts, `tp_wait`: the seconds spent inside the tensor-parallel all-reduces (part of
forward and backward; trainer/tensor_parallel.py `TP_WAIT`). A slow rank's TP peers wait for it
there, so their compute time grows as much as its own; compute minus `tp_wait` is its own.

From the parts: the stage's busy time (forward + backward), the pipeline phase of the step
(step - optimizer - reduction - data), the measured bubble 1 - busy / phase (time a stage is
idle or waiting on its neighbours), beside the theoretical (p - 1) / (m + p - 1) of the 1F1B
schedule with p stages and m micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .tensor_parallel import TP_WAIT

PARTS = ("forward", "backward", "optimizer", "p2p_wait", "dp_reduce", "data")
_INSTRUCTION_PARTS = {
    "ForwardPass": "forward", "BackwardPass": "backward", "OptimizerStep": "optimizer",
    "SendActivation": "p2p_wait", "RecvActivation": "p2p_wait", "SendGrad": "p2p_wait",
    "RecvGrad": "p2p_wait", "ReduceGrads": "dp_reduce", "ReduceTiedGrads": "dp_reduce",
    "LoadMicroBatch": "data",
}


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


class StepTimer:
    def __init__(self, engine: Any, device: torch.device, interval: int) -> None:
        self.device, self.interval = device, interval
        self.active = False
        self.parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        table = getattr(type(engine), "_INSTRUCTION_MAP", None)
        if table is not None and interval > 0:  # an instance attribute shadows the class's
            engine._INSTRUCTION_MAP = {cls: self._timed(_INSTRUCTION_PARTS.get(cls.__name__,
                                                                               "data"), fn)
                                       for cls, fn in table.items()}

    def sampled(self, step: int) -> bool:
        """Steps 2, then every `interval` (step 1 pays one-off costs: allocation, compiling)."""
        return self.interval > 0 and (step == 2 or (step > 2 and step % self.interval == 0))

    def begin(self, step: int) -> None:
        self.active = self.sampled(step)
        if self.active:
            self._sync()
            self.parts = dict.fromkeys(PARTS, 0.0)
            TP_WAIT.start()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Times a part of a non-pipelined step (the pipeline engine's are wrapped)."""
        if not self.active:
            yield
            return
        t0 = time.perf_counter()
        yield
        self._sync()
        self.parts[name] += time.perf_counter() - t0

    def end(self, step_seconds: float, stages: int, micro_batches: int) -> dict[str, Any] | None:
        """The split of a sampled step (None for others)."""
        if not self.active:
            return None
        self.active = False
        tp_wait = TP_WAIT.stop()
        p = self.parts
        busy = p["forward"] + p["backward"]
        phase = step_seconds - p["optimizer"] - p["dp_reduce"] - p["data"]
        out: dict[str, Any] = {k: round(v, 6) for k, v in p.items()}
        out["step_s"] = round(step_seconds, 6)
        out["compute_s"] = round(busy + p["optimizer"], 6)
        if tp_wait is not None:  # TP all-reduces timed (none at TP = 1 or when compiled)
            out["tp_wait"] = round(tp_wait, 6)
        if stages > 1 and phase > 0:
            out["bubble"] = round(max(0.0, 1.0 - busy / phase), 4)
            out["bubble_theoretical"] = round(theoretical_bubble(stages, micro_batches), 4)
        if p["forward"] > 0 and p["dp_reduce"] > 0:
            out["reduce_to_forward"] = round(p["dp_reduce"] / p["forward"], 4)
        return out

    def _timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(engine: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(engine, **kwargs)
            t0 = time.perf_counter()
            out = fn(engine, **kwargs)
            self._sync()
            self.parts[part] += time.perf_counter() - t0
            return out
        return run

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
