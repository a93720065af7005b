"""Worker commands: what ds3dd asks a job's workers to do at their next step boundary.

A request (ds3dctl pause/stop/save/rebalance, the layer profile rebalance asks for, a lost node
that is back) is stored first as the job's pending command (`Job.command_action`, one string,
with `command_id`), then the supervisor writes it to control/command.json, which rank 0 reads
(trainer/loop.py `CommandInbox`). This module is the one place that spells both forms:

    stored (Job.command_action)   control/command.json (besides "id" and "time")
    "save"                        {"action": "save"}
    "pause" | "pause_fast"        {"action": "pause"} | {"action": "pause", "fast": true}
    "stop" | "stop_now"           {"action": "stop"} | {"action": "stop_now"}
    "profile"                     {"action": "profile"}
    "repartition:0,6,10"          {"action": "repartition", "boundaries": [0, 6, 10]}
    "restart"                     {"action": "restart"}
    ""                            nothing pending (a rollback clears the command)

The stored form is the one in existing state directories and in the `command` events' detail,
so it is kept as it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Action(enum.StrEnum):
    """The `action` of control/command.json; the trainer knows the same names
    (trainer/loop.py ACTIONS, checked by tests/unit/test_commands.py)."""

    SAVE = "save"                # checkpoint now, train on
    PAUSE = "pause"              # checkpoint, then exit: the job is PAUSED
    STOP = "stop"                # checkpoint, then exit: the job is STOPPED
    STOP_NOW = "stop_now"        # exit without a checkpoint (the agent is killed after a grace)
    PROFILE = "profile"          # time every layer for `ds3dctl rebalance`
    REPARTITION = "repartition"  # checkpoint, then exit to restart on new stage boundaries
    RESTART = "restart"          # checkpoint, then exit to relaunch on all nodes (a node is back)


_FAST = "_fast"
_BOUNDS = ":"


@dataclass(frozen=True)
class Command:
    """One pending worker command. `fast` only with PAUSE (ds3dctl pause --fast); `boundaries`
    (the new pipeline stage boundaries, ds3dctl rebalance) with REPARTITION and only there."""

    action: Action
    fast: bool = False
    boundaries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.fast and self.action is not Action.PAUSE:
            raise ValueError(f"only a pause can be fast, not {self.action}")
        if bool(self.boundaries) != (self.action is Action.REPARTITION):
            raise ValueError("a repartition command, and only it, carries stage boundaries")

    @classmethod
    def repartition(cls, boundaries: list[int] | tuple[int, ...]) -> Command:
        return cls(Action.REPARTITION, boundaries=tuple(int(b) for b in boundaries))

    def encode(self) -> str:
        """The stored form (Job.command_action, the `command` event's detail)."""
        if self.fast:
            return self.action + _FAST
        if self.boundaries:
            return self.action + _BOUNDS + ",".join(map(str, self.boundaries))
        return str(self.action)

    @classmethod
    def decode(cls, stored: str) -> Command | None:
        """The command of a stored form; None for "" (nothing pending). A form this module
        never wrote raises ValueError."""
        if not stored:
            return None
        if stored == Action.PAUSE + _FAST:
            return cls(Action.PAUSE, fast=True)
        action, sep, bounds = stored.partition(_BOUNDS)
        if sep:
            if action != Action.REPARTITION:
                raise ValueError(f"stored worker command {stored!r} is not one ds3d writes")
            return cls.repartition([int(b) for b in bounds.split(",")])
        try:
            return cls(Action(stored))
        except ValueError:
            raise ValueError(f"stored worker command {stored!r} is not one ds3d writes") from None

    def file_fields(self) -> dict[str, Any]:
        """The fields of control/command.json besides "id" and "time"."""
        fields: dict[str, Any] = {"action": str(self.action)}
        if self.fast:
            fields["fast"] = True
        if self.boundaries:
            fields["boundaries"] = list(self.boundaries)
        return fields

