"""The kinds that cross a process boundary between the workers and ds3dd, in one registry.

A record, an event or an injected fault is a dict on the way (a JSON line, a control file, an
events-table row, a proto string), so a kind spelled on one side only would fail silently: a
record the daemon never matches, a fault the daemon accepts and no rank acts on. Both sides
therefore name every kind through these enums, and tests/unit/test_kinds.py checks that each
side covers exactly the registry and that the proto comments and the docs list exactly it.

It lives with the trainer because the trainer may not import the daemon or the protos
(tests/unit/test_import_rules.py); the daemon imports it from here. Values are the strings
written in files and stored rows, so they never change once released.
"""

from __future__ import annotations

import enum


class RecordKind(enum.StrEnum):
    """`kind` of a worker's report record (reports/rank-XXXXX.jsonl, trainer/report.py, whose
    docstring lists each kind's fields); the daemon tails them (daemon/reports.py)."""

    START = "start"                # a worker process began (layout, resumed-from step)
    STEP = "step"                  # a training step finished (rank 0)
    HEARTBEAT = "heartbeat"        # liveness and phase (every rank, every step); never stored
    CHECKPOINT = "checkpoint"      # a checkpoint's progress or problem (`phase`)
    FAULT = "fault"                # a fault seen inside the step loop (`cause`)
    RECOVERY = "recovery"          # an in-process recovery (`source`: see SKIPPED_UPDATE)
    DONE = "done"                  # the step loop ended (`reason`: a DoneReason)
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # the "auto" interval decided
    COMMAND = "command"            # a daemon command acted on (or refused)
    PROFILE = "profile"            # measured per-layer costs of one stage (ds3dctl rebalance)
    REPARTITION = "repartition"    # pipeline stage boundaries decided


# `source` of a `recovery` record when nothing was read: every rank's optimizer skipped the bad
# step's update and the step was undone in place (trainer/loop.py); else the source is where a
# rollback read its state: "memory", "local" or "store" (checkpoints/engine_io.py RestorePlan)
SKIPPED_UPDATE = "skipped_update"


class EventKind(enum.StrEnum):
    """`kind` of a stored job event (daemon/store.py, proto Event.kind, `ds3dctl events
    --kind`). Every report record but `heartbeat` becomes an event of its own kind (a restarted
    group's rank-0 `start` becomes `recovery`); the others are the daemon's own."""

    STATE = "state"                # a job state transition
    REQUEST = "request"            # a resume or rollback asked for
    COMMAND = "command"            # a worker command sent (daemon) or acted on (workers)
    INJECT = "inject"              # a fault injection written (drills)
    LAUNCH = "launch"              # an elastic agent started
    SHARE = "share"                # another node started its share of a multi-node job
    FAULT = "fault"                # a fault: the daemon's detectors or the workers' records
    DIAGNOSIS = "diagnosis"        # advice that changes nothing (straggler, disk full, ...)
    OOM = "oom"                    # a worker ran out of memory
    RECOVERY = "recovery"          # the workers restarted or rolled back
    RECOVERED = "recovered"        # one per fault the job came back from, with its timings
    DRAIN = "drain"                # paused for a daemon shutdown
    CHECKPOINT = "checkpoint"      # worker checkpoint records and index reconciliation
    START = "start"                # worker records, stored under their record kind
    STEP = "step"
    DONE = "done"
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    PROFILE = "profile"
    REPARTITION = "repartition"


class FaultKind(enum.StrEnum):
    """`kind` of an injected fault (drills: ds3dctl inject, control/inject.json); each has its
    behaviour in trainer/faults.py and nowhere else."""

    NAN = "nan"      # the rank's next forward output becomes NaN (once)
    HANG = "hang"    # the rank sleeps forever before its step
    CRASH = "crash"  # the rank exits with code 13
    SLOW = "slow"    # every forward of the rank's first layer takes 0.1 s longer from then on
    SPIKE = "spike"  # the rank's last layer's output x 50 for the detector's patience in steps
    # the rank's next checkpoint holds a key its model lacks (every hash verifies it, DeepSpeed's
    # strict load refuses it: a writer's bug); the rank crashes once that checkpoint is committed
    UNLOADABLE = "unloadable"
    # the rank's checkpoints from now on carry a universal-checkpoint pattern that matches no
    # parameter: they load as they are, and DeepSpeed's converter refuses them (a restore into
    # another layout: a lost node, a new pipeline split). Rank 0 writes the pattern's file
    UNCONVERTIBLE = "unconvertible"


class DoneReason(enum.StrEnum):
    """`reason` of a `done` record: why the workers' step loop ended (trainer/loop.py); the
    daemon decides the job's next state from it."""

    COMPLETED = "completed"      # all configured steps trained
    PAUSED = "paused"            # a pause command, or the stop-at-step of a rollback plan
    STOPPED = "stopped"          # a stop command (with or without a checkpoint)
    REPARTITION = "repartition"  # checkpointed to restart on new pipeline stage boundaries
    RESTART = "restart"          # checkpointed to relaunch on all nodes (a lost node is back)
    # a fault the rollback budget or the NaN policy could not handle pauses the job: PAUSED
