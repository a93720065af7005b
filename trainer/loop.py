"""The step loop of one worker: restore, then step / report / checkpoint / obey commands /
recover from bad steps.

All ranks take every decision together. Once per step one small all-reduce (MAX) carries
[command id, command action, bad-step flag, spike flag, checkpoint due, update applied,
memory-only snapshot due]: rank 0 contributes the daemon's newest command and the "auto"
intervals' word, every rank its own verdict on the step (NaN/Inf loss or gradient norm, loss
spike) and whether its optimizer applied the step's update. So a command or a fault is acted on
by every rank at the same step, and no rank decides alone.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ds3d.checkpoints.engine_io import CheckpointManager, Rank

from .checkpoint_interval import AutoInterval, FailureReading, MemoryInterval
from .config import JobConfig
from .data import batch_index
from .engine import StepResult, TrainStep
from .faults import FaultInjector, RollbackBudget, SpikeDetector
from .kinds import SKIPPED_UPDATE, DoneReason, RecordKind
from .layer_profile import PartitionTuner
from .layout import ParallelLayout, ProcessEnv
from .load_failure import brief, checkpoint_at_fault
from .partition import Partition, current_partition, write_partition_file
from .process_age import process_started_at
from .report import Reporter
from .tensorboard import TensorBoardLog

log = structlog.get_logger()

# while waiting for the store, a heartbeat this often: a wait is progress, not a hang
STORE_WAIT_REPORT_S = 5.0

ACTIONS = {"save": 1, "pause": 2, "stop": 3, "stop_now": 4, "profile": 5, "repartition": 6,
           "restart": 7}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}


class CommandInbox:
    """Reads the daemon's newest command (control/command.json, replaced atomically)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "control" / "command.json"
        self.seen = 0
        self.payload: dict[str, Any] | None = None  # the newest command as read (rank 0)

    def poll(self) -> tuple[int, int]:
        """(command id, action) of a new command, else (0, 0). A file that is no command
        (damaged by hand: not a JSON object, an id that is no integer, an unknown action) reads
        as none: raising here would end rank 0 at every step."""
        try:
            cmd = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return 0, 0
        if not isinstance(cmd, dict) or not isinstance(cmd.get("id", 0), int) or \
                isinstance(cmd.get("id"), bool) or not isinstance(cmd.get("action", ""), str):
            return 0, 0
        cid, action = cmd.get("id", 0), ACTIONS.get(cmd.get("action", ""), 0)
        if cid > self.seen and action:
            self.payload = cmd
            return cid, action
        return 0, 0


class Trainer:
    def __init__(self, cfg: JobConfig, run_dir: Path, env: ProcessEnv, layout: ParallelLayout,
                 device: torch.device, stop_at_step: int | None = None,
                 startup_s: dict[str, float] | None = None) -> None:
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        self.layout, self.device = layout, device
        self.reporter = Reporter(run_dir, env.rank, env.restart_count)
        self.inbox = CommandInbox(run_dir)
        self.stop_at_step = stop_at_step
        self.step, self.tokens_seen, self.saved_step = 0, 0, -1
        self.after_first_step: Callable[[], None] | None = None  # once (startup_profile.py)
        # startup_s: seconds from the process's start to each start-up stage (worker.py)
        self.reporter.emit(RecordKind.HEARTBEAT, step=0, phase="init",
                           **({"startup_s": startup_s} if startup_s else {}))
        self.injector = FaultInjector(run_dir, env.rank, self.reporter.emit,
                                      spike_steps=cfg.faults.spike_patience)
        self.spikes, self.budget = SpikeDetector(cfg.faults), RollbackBudget(cfg.faults)
        self.fp16_skips = 0
        self._memory_waits_told = False  # a memory snapshot was skipped for the arenas
        # interval / memory_interval "auto": rank 0 keeps the clocks (one failure reading for
        # both), every rank saves or holds on their word
        c, rank0 = cfg.checkpoint, env.rank == 0
        self.failures = FailureReading(run_dir / "control", c.auto_mtbf_prior_hours)
        self.auto = AutoInterval(self.failures, c.auto_initial_save_cost_s) \
            if c.interval == "auto" and rank0 else None
        self.memory_auto = MemoryInterval(self.failures) \
            if c.memory_interval == "auto" and rank0 else None
        self.ckpt = CheckpointManager(
            cfg.checkpoint_settings(), run_dir,
            Rank(env.rank, env.world_size, env.local_rank, layout.tp_size, layout.pp_size,
                 layout.dp_size), device, self._emit_checkpoint)
        # stage boundaries: RUN_DIR/partition.json (a measured or rebalanced split) or the method
        self.partition = current_partition(cfg, run_dir)
        self.ckpt.partition = self.partition.boundaries  # a checkpoint of another split: universal
        rollback = self._read_rollback() if env.rank == 0 else None
        plan = self.ckpt.plan_restore(rollback) if cfg.checkpoint.load else None
        self._keep_split(plan)
        self.reporter.emit(RecordKind.HEARTBEAT, step=plan.step if plan else 0, phase="build")
        t0 = time.perf_counter()
        self.step_fn = TrainStep(cfg, layout, device, load_universal=bool(plan and plan.universal),
                                 parts=self.partition.boundaries)
        # the local copy was read and hashed while the engine was built; a copy that failed
        # its hashes gives another plan, which rarely needs the other kind of engine
        t1 = time.perf_counter()
        built = (bool(plan and plan.universal), self.partition.boundaries)
        plan = self.ckpt.confirm(plan)
        self._keep_split(plan)
        # a restore's build phase split: the engine's build, then the wait for the read
        build_s = {"engine": round(t1 - t0, 3), "read_wait": round(time.perf_counter() - t1, 3)}
        if plan is not None and (plan.universal, self.partition.boundaries) != built:
            del self.step_fn
            self.step_fn = TrainStep(cfg, layout, device, load_universal=plan.universal,
                                     parts=self.partition.boundaries)
        self.tuner = PartitionTuner(
            cfg, run_dir, self.step_fn, layout, env.rank, env.local_rank,
            self.partition.boundaries, self.reporter.emit,
            auto=cfg.parallel.partition_method == "measured" and not self.partition.detail)
        if plan is not None:
            self._load(plan, rollback, build_s)
        self.ckpt.prepare(self.step_fn.engine)  # GPU: pin the snapshot memory while training
        self.tb = TensorBoardLog(cfg, run_dir, device, env.world_size,
                                 self.step_fn.plan.global_batch,
                                 env.restart_count) if env.rank == 0 else None
        if self.tb is not None:
            self.tb.scalar("faults/restarts", env.restart_count, self.step)

    def _keep_split(self, plan) -> None:
        """A new pipeline split the restored checkpoint could not be converted to: the job
        trains on in the split it was saved with, kept in partition.json, so that later
        starts neither convert nor measure again (`ds3dctl rebalance` can still move it)."""
        if plan is None or plan.keep_split is None or plan.keep_split == self.partition.boundaries:
            return
        detail = {"decision": "kept", "step": plan.step, "previous": self.partition.boundaries,
                  "reason": "the checkpoint could not be converted to the new split"}
        if self.env.local_rank == 0:
            write_partition_file(self.run_dir, self.cfg, plan.keep_split, "checkpoint", **detail)
        self.partition = Partition(list(plan.keep_split), "checkpoint", detail)
        self.ckpt.partition = self.partition.boundaries

    def _read_rollback(self) -> int | None:
        """`control/restore.json` {"step": N}: the daemon's rollback request for this start."""
        try:
            return int(json.loads((self.run_dir / "control" / "restore.json").read_text())["step"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError):
            return None

    def _load(self, plan, rollback: int | None, build_s: dict[str, float]) -> None:
        """`build_s`: the engine's build and the wait for the read-ahead after it, in the load
        heartbeat (the bench splits a restore's seconds with it)."""
        self.reporter.emit(RecordKind.HEARTBEAT, step=plan.step, phase="load", build_s=build_s)
        t0 = time.perf_counter()
        try:
            self.ckpt.load(self.step_fn.engine, plan)
        except Exception as e:
            if checkpoint_at_fault(e):  # the daemon rolls back past a step that fails twice
                self.reporter.emit(RecordKind.CHECKPOINT, step=plan.step, phase="load_failed",
                                   source=plan.source, detail=brief(e))
            raise
        self.step = plan.step
        self.saved_step = -1 if plan.memory_only else plan.step  # no file of a memory-only one
        self.tokens_seen = plan.manifest.tokens_seen
        # windows skipped by NaN recovery before the checkpoint stay skipped after it
        saved_skips = [tuple(w) for w in plan.manifest.data_position.get("skip_batches", [])]
        merged = sorted(set(self.cfg.data.skip_batches) | set(saved_skips))
        if merged != sorted(self.cfg.data.skip_batches):
            self.cfg.data.skip_batches = merged  # the batch plan reads this same config
        seconds = round(time.perf_counter() - t0, 3)
        self.reporter.emit(RecordKind.CHECKPOINT, step=plan.step, phase="loaded", seconds=seconds,
                           universal=plan.universal)
        if rollback is not None:
            dropped = self.ckpt.drop_newer_than(plan.step)
            (self.run_dir / "control" / "restore.json").unlink(missing_ok=True)
            self.reporter.emit(RecordKind.CHECKPOINT, step=plan.step, phase="rolled_back",
                               detail=f"deleted newer checkpoints {dropped}", deleted=dropped)
        log.info("resumed from checkpoint", step=plan.step, universal=plan.universal,
                 seconds=seconds)

    # -- checkpoints --------------------------------------------------------------------------

    def client_state(self) -> dict[str, Any]:
        from .checkpoint_info import universal_checkpoint_info

        return {"iteration": self.step,
                "ds3d": {"step": self.step, "tokens_seen": self.tokens_seen,
                         "model": self.cfg.model.model_dump(mode="json")},
                "universal_checkpoint_info":
                    self.injector.universal_info(universal_checkpoint_info(self.cfg))}

    def _position(self) -> dict[str, Any]:
        """Where the data stands, for a checkpoint's manifest."""
        return {"step": self.step,
                "skip_batches": [list(w) for w in self.cfg.data.skip_batches],
                "partition": self.partition.boundaries}

    def save(self) -> None:
        if self.step == self.saved_step:
            return
        self.reporter.emit(RecordKind.HEARTBEAT, step=self.step, phase="save")
        blocked = self.ckpt.save(self.step_fn.engine, self.step, self.client_state(),
                                 self.tokens_seen, self._position())
        self.saved_step = self.step
        if self.auto is not None:
            self.auto.saved(self.step, blocked)
        if self.memory_auto is not None:
            self.memory_auto.saved(blocked)
        self.reporter.emit(RecordKind.CHECKPOINT, step=self.step, phase="saved",
                           blocked_s=round(blocked, 4))
        if self.tb is not None:
            self.tb.scalar("checkpoint/blocked_s", blocked, self.step)
        log.info("checkpoint saved", step=self.step, blocked_s=round(blocked, 3))
        self.injector.after_save(self.ckpt)

    def hold(self) -> None:
        """A memory-only snapshot of this step (`checkpoint.memory_interval`): held in host and
        node memory, so that a rollback or a crash restart loses at most that many steps,
        never written (engine_io.CheckpointManager.save). `saved_step` stays: a durable save
        of this step asked for later (a command, the end) is still made. Skipped (collective)
        while any rank's arenas are still being reserved."""
        if not self.ckpt.memory_snapshot_ready():
            if not self._memory_waits_told:
                self._memory_waits_told = True
                log.info("memory snapshot skipped", step=self.step, reason="the snapshot "
                         "arenas are still being reserved (and pinned); skipped until they are")
            return
        self.reporter.emit(RecordKind.HEARTBEAT, step=self.step, phase="save")
        blocked = self.ckpt.save(self.step_fn.engine, self.step, self.client_state(),
                                 self.tokens_seen, self._position(), memory_only=True)
        if self.env.rank == 0:
            self.reporter.emit(RecordKind.CHECKPOINT, step=self.step, phase="held_in_memory",
                               blocked_s=round(blocked, 4))
        if self.memory_auto is not None:
            self.memory_auto.held(blocked)
        if self.tb is not None:
            self.tb.scalar("checkpoint/held_blocked_s", blocked, self.step)

    def _emit_checkpoint(self, kind: str, **fields: Any) -> None:
        """The checkpoint manager's reports; a commit also times the save for "auto"."""
        if self.auto is not None and fields.get("phase") == "committed":
            self.auto.committed(int(fields["step"]))
        self.reporter.emit(kind, **fields)

    def _intervals_due(self) -> tuple[bool, bool]:
        """Rank 0, interval / memory_interval "auto": (is the newest save older than the
        Young-Daly interval, is the newest snapshot older than the memory-only one). Every
        change of either is reported with its inputs, in one `checkpoint_interval` record that
        carries both (ds3dctl status shows the newest)."""
        memory = self.memory_auto if self.ckpt.memory_snapshots else None
        if self.auto is None and memory is None:
            return False, False
        if self._update_intervals():
            self._report_intervals()
        return (self.auto is not None and self.auto.due(),
                memory is not None and memory.due())

    def _update_intervals(self) -> bool:
        """Re-reads the failure history (shared by both clocks) and recomputes each "auto"
        interval; True when either changed enough to report."""
        self.failures.read()
        changed = self.auto is not None and self.auto.update() is not None
        if self.memory_auto is not None and self.ckpt.memory_snapshots:
            # a new durable decision renews the memory one: the record carries both, and the
            # memory one's cap is the durable one it sits beside
            memory = self.memory_auto.update(self._durable_interval_s(), force=changed)
            changed = changed or memory is not None
        return changed

    def _durable_interval_s(self) -> float:
        """The durable interval in seconds, the memory-only one's cap: the "auto" clock's, or
        an integer interval's steps at the measured step time (0 while unknown)."""
        if self.auto is not None:
            return self.auto.decision.interval_s
        every = self.cfg.checkpoint.interval
        step_s = self.memory_auto.step_s if self.memory_auto is not None else None
        return every * step_s if isinstance(every, int) and step_s is not None else 0.0

    def _report_intervals(self) -> None:
        fields: dict[str, Any] = {}
        if self.auto is not None:
            fields.update(self.auto.decision.record())
        if self.memory_auto is not None and self.ckpt.memory_snapshots:
            fields.update(self.memory_auto.decision.record())
        if fields:
            self.reporter.emit(RecordKind.CHECKPOINT_INTERVAL, step=self.step, **fields)

    # -- the loop -----------------------------------------------------------------------------

    def _verdict(self, r: StepResult) -> tuple[bool, bool]:
        """This rank's view of the step: (bad, spike). fp16 overflow steps that the loss scaler
        skipped are bad only past the configured run of them."""
        f = self.cfg.faults
        finite = math.isfinite(r.loss) and (r.grad_norm is None or math.isfinite(r.grad_norm))
        if self.cfg.train.precision == "fp16" and r.skipped:
            self.fp16_skips += 1
            return self.fp16_skips > f.fp16_max_skipped_steps, False
        self.fp16_skips = 0
        spike = finite and f.spike_policy != "off" and self.spikes.observe(r.loss)
        return not finite, spike

    def _agree(self, bad: bool = False, spike: bool = False,
               applied: bool = False) -> tuple[int, int, bool, bool, bool, bool, bool]:
        """The one per-step collective: [command id, action, bad step, spike, checkpoint due,
        update applied, memory-only snapshot due], MAX over ranks (rank 0 alone contributes
        the command and the "auto" intervals' word). "Applied" is true when any rank's
        optimizer applied the step's update: false means every rank skipped it, which a bad
        step can recover from in place."""
        cid, action = self.inbox.poll() if self.env.rank == 0 else (0, 0)
        due, hold = self._intervals_due()
        if self.env.world_size == 1:  # nothing to agree with: no copy to and from the device
            return (cid, action, bad, spike, due, applied, hold)
        flags = torch.tensor([cid, action, int(bad), int(spike), int(due), int(applied),
                              int(hold)], dtype=torch.long, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        # one device-to-host copy: indexing a GPU tensor seven times is seven synchronous copies
        cid, action, bad_, spike_, due_, applied_, hold_ = flags.tolist()
        return (cid, action, bool(bad_), bool(spike_), bool(due_), bool(applied_), bool(hold_))

    def _recover(self, cause: str, r: StepResult, applied: bool) -> str | None:
        """Policy for a bad step (collective): undo it in place when no rank's optimizer applied
        its update (`_undo_skipped_update`), else reload a checkpoint in this process (the
        newest save from its host copy when no suspect step trained it, else the newest
        committed one from the local tier); either way skip the data window that ended with the
        failed batch. `applied`: some rank applied the step's update (agreed). Returns a reason
        to stop (pause) when the policy or the rollback budget says so. Both recoveries count
        against the rollback budget: NaNs that keep coming want a person (data, LR, hardware),
        however cheap each one is to recover from."""
        f, failed = self.cfg.faults, self.step
        policy = f.nan_policy if cause == "nan" else f.spike_policy
        detail = f"loss={r.loss} grad_norm={r.grad_norm} loss_scale={r.loss_scale}"
        # a spike is judged over its last `spike_patience` steps: all of them are suspect
        suspect = f.spike_patience if cause == "spike" else 1
        extra = {}
        if cause == "spike":
            sd = self.spikes
            detail = (f"loss {r.loss:.4g} above the running median {sd.median:.4g} + the "
                      f"larger of {f.spike_mads:g} MADs and {f.spike_min_rise:.0%} of it = "
                      f"{sd.threshold:.4g} for {suspect} steps in a row "
                      f"(steps {failed - suspect + 1}-{failed}); {detail}")
            extra = {"loss": r.loss, "median": sd.median, "threshold": sd.threshold,
                     "first_step": failed - suspect + 1}
        self.reporter.emit(RecordKind.FAULT, cause=cause, step=failed, detail=detail, policy=policy,
                           **extra)
        if policy == "alert":
            return None
        if policy == "pause" or not self.budget.allow(failed):
            why = "policy" if policy == "pause" else (
                f"{f.max_rollbacks} rollbacks within {f.rollback_window_steps} steps")
            self.reporter.emit(RecordKind.FAULT,
                               cause="rollback_budget" if policy != "pause" else cause,
                               step=failed, detail=f"pausing the job ({why}); last good "
                               f"checkpoint is kept, bad weights are not saved")
            if suspect > 1:
                self._drop_suspect_checkpoints(failed - suspect)
            self.saved_step = self.step  # never checkpoint the bad weights
            return DoneReason.PAUSED
        if self._update_skipped_everywhere(cause, applied):
            self._undo_skipped_update(cause, failed)
            return None
        t0 = time.perf_counter()
        # the newest save, unless a suspect step trained it: read from its host copy, with no
        # wait for its files or upload (engine_io.plan_memory_rollback)
        plan = self.ckpt.plan_memory_rollback(newest=failed - suspect)
        dropped: list[int] = []
        if plan is not None and suspect > 1 and self.ckpt.newest_durable > failed - suspect:
            # a durable save of suspect steps is newer than the held snapshot rolled back to
            dropped = self._drop_suspect_checkpoints(failed - suspect)
        if plan is None:  # the local tier
            # the newest checkpoint may still be uploading (a GPU step can be shorter than an
            # upload): let it commit, so the rollback loses the fewest steps and every rank
            # sees it
            self.ckpt.wait_uploads(timeout=600.0)
            dropped = self._drop_suspect_checkpoints(failed - suspect) if suspect > 1 else []
            plan = self.ckpt.confirm(self.ckpt.plan_restore())
        if plan is None:
            self.reporter.emit(RecordKind.FAULT, cause="no_checkpoint", step=failed,
                               detail="no committed checkpoint to roll back to; pausing")
            self.saved_step = self.step
            return DoneReason.PAUSED
        bad_batch = batch_index(failed - 1, self.cfg.data.skip_batches)
        first_batch = batch_index(plan.step, self.cfg.data.skip_batches)
        window = (max(first_batch, bad_batch - max(f.skip_batches, suspect) + 1), bad_batch + 1)
        if f.skip_batches:
            self.cfg.data.skip_batches = sorted(set(self.cfg.data.skip_batches) | {window})
        self.ckpt.load(self.step_fn.engine, plan)
        self._lower_lr()
        self.step = plan.step
        self.saved_step = -1 if plan.memory_only else plan.step
        self.tokens_seen = plan.manifest.tokens_seen
        self.spikes.reset()
        if self.auto is not None:  # back at a checkpoint: no work at risk
            self.auto.last_save = time.monotonic()
        if self.memory_auto is not None:
            self.memory_auto.last_snapshot = time.monotonic()
        if self.tb is not None:
            self.tb.scalar(f"faults/rollback_{cause}", 1, failed)
        self.reporter.emit(RecordKind.RECOVERY, cause=cause, step=failed, recovered_to=plan.step,
                           steps_lost=failed - plan.step, skipped_batches=list(window),
                           **({"dropped_checkpoints": dropped} if dropped else {}),
                           seconds=round(time.perf_counter() - t0, 3), source=plan.source)
        log.warning("rolled back", cause=cause, failed_step=failed, to_step=plan.step,
                    skipped_batches=window, source=plan.source)
        return None

    def _update_skipped_everywhere(self, cause: str, applied: bool) -> bool:
        """A NaN/Inf step can be undone in place when every rank's optimizer skipped its update
        (BF16_Optimizer, ZeRO 1/2: a non-finite gradient norm discards the gradients), so the
        weights and the optimizer state are still the previous step's. Not for a spike (its
        updates were applied), fp16 (a bad step there ends a run of overflow-skipped steps:
        the rollback, as before), nor when `faults.skip_batches` > 1 asks to skip batches that
        were already trained on: only a rollback takes those back."""
        return (cause == "nan" and not applied and self.cfg.train.precision != "fp16"
                and self.cfg.faults.skip_batches <= 1)

    def _undo_skipped_update(self, cause: str, failed: int) -> None:
        """The bad step `failed` costs one batch: back to step `failed - 1` in place, with the
        weights, optimizer state, LR schedule and engine counters a rollback to a checkpoint of
        that step would give (so the run goes on bit for bit as a rollback, or a fault-free run
        with the same skipped window, would), and nothing read from any checkpoint. Its batch
        is skipped as a rollback skips it (`faults.skip_batches` = 0: trained again). The spike
        detector keeps its history: the bad loss never entered it, and every loss in it is of a
        step that stays in the run (a rollback clears it because the steps after the checkpoint
        are trained again). The work since the last save is unchanged: the "auto" interval's
        clock goes on."""
        t0 = time.perf_counter()
        self.step_fn.forget_skipped_step()
        self.step -= 1
        self.tokens_seen -= self.step_fn.tokens_per_step
        window: list[int] = []
        if self.cfg.faults.skip_batches:
            bad_batch = batch_index(failed - 1, self.cfg.data.skip_batches)
            window = [bad_batch, bad_batch + 1]
            self.cfg.data.skip_batches = sorted(set(self.cfg.data.skip_batches) |
                                                {(bad_batch, bad_batch + 1)})
        self._lower_lr()
        if self.tb is not None:
            self.tb.scalar(f"faults/skipped_update_{cause}", 1, failed)
        self.reporter.emit(RecordKind.RECOVERY, cause=cause, step=failed, recovered_to=self.step,
                           steps_lost=1, skipped_batches=window,
                           seconds=round(time.perf_counter() - t0, 3),
                           source=SKIPPED_UPDATE)
        log.warning("bad step undone in place: its update was skipped", cause=cause,
                    failed_step=failed, to_step=self.step, skipped_batches=window)

    def _lower_lr(self) -> None:
        """`faults.lr_factor` on the LR schedule, after every recovery from a bad step."""
        sched, factor = self.step_fn.engine.lr_scheduler, self.cfg.faults.lr_factor
        if factor != 1.0 and sched is not None:
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]

    def _drop_suspect_checkpoints(self, last_good: int) -> list[int]:
        """Collective: checkpoints saved after `last_good` hold weights trained on the suspect
        steps (a spike is only declared `spike_patience` steps after it began); they are deleted
        so that neither this rollback nor a later restart restores them. Every rank's uploads
        are finished first, so no shard of them lands after the delete."""
        self.ckpt.wait_uploads(timeout=600.0)
        dist.barrier()
        dropped = self.ckpt.drop_newer_than(last_good)
        dist.barrier()
        return dropped

    def _report_step(self, r: StepResult) -> None:
        tps = self.step_fn.tokens_per_step / r.seconds if r.seconds > 0 else 0.0
        split = self.step_fn.last_split if self.step_fn.timer.sampled(self.step) else None
        mfu = None
        if self.tb is not None:
            mfu = self.tb.step(self.step, r.loss, r.lr, r.grad_norm, r.loss_scale, tps, r.seconds)
            if split is not None:
                self.tb.split(self.step, split)
        if self.env.rank == 0:
            self.reporter.emit(RecordKind.STEP, step=self.step, loss=r.loss,
                               grad_norm=r.grad_norm, lr=r.lr,
                               loss_scale=r.loss_scale, tokens_per_s=round(tps, 1),
                               step_time_s=round(r.seconds, 5), skipped=r.skipped,
                               tokens_seen=self.tokens_seen,
                               **({"mfu": round(mfu, 4)} if mfu is not None else {}))
            log.info("step", step=self.step, loss=round(r.loss, 6), lr=r.lr,
                     grad_norm=None if r.grad_norm is None else round(r.grad_norm, 4),
                     tokens_per_s=round(tps, 1))
        extra = {"split": split, "stage": self.layout.stage} if split is not None else {}
        self.reporter.emit(RecordKind.HEARTBEAT, step=self.step, phase="train",
                           step_time_s=round(r.seconds, 5), **extra)

    def _obey(self, cid: int, action: int) -> str | None:
        """Acts on a command; returns the reason to stop, if any."""
        name = ACTION_NAMES[action]
        self.inbox.seen = cid
        status, detail, parts = "done", "", None
        if name == "profile":
            if not self.tuner.request():
                status, detail = "refused", "one pipeline stage: nothing to profile"
        elif name == "repartition":  # ds3dctl rebalance: checkpoint, then restart with new bounds
            parts, detail = self.tuner.from_command(self.inbox.payload)
            if parts is None:
                status = "refused"
            else:
                self.tuner.commit(parts, "rebalance", self.step, "applied")
        if name in ("save", "pause", "stop", "restart") or parts is not None:
            self.save()
        self.reporter.emit(RecordKind.COMMAND, id=cid, action=name, status=status, step=self.step,
                           **({"detail": detail} if detail else {}))
        if parts is not None:
            return DoneReason.REPARTITION
        # restart: checkpoint and exit, the daemon relaunches on all nodes (a lost node is back)
        return {"pause": DoneReason.PAUSED, "stop": DoneReason.STOPPED,
                "stop_now": DoneReason.STOPPED, "restart": DoneReason.RESTART}.get(name)

    def run(self) -> str:
        """Trains to the configured step count; returns why it ended."""
        steps, interval = self.cfg.train.steps, self.cfg.checkpoint.interval
        # memory-only snapshots between durable saves (off where the manager turned them off):
        # every N steps, or "auto" (rank 0's clock, agreed in `_agree`)
        memory = self.cfg.checkpoint.memory_interval if self.ckpt.memory_snapshots else 0
        every_held = memory if isinstance(memory, int) else 0
        first = self.step
        self.reporter.emit(RecordKind.START, step=first, device=str(self.device),
                           **self.layout.describe(),
                           partition=self.partition.boundaries,
                           partition_source=self.partition.source,
                           process_started=round(process_started_at() or 0.0, 3))
        reason: str = DoneReason.COMPLETED
        if self.auto is not None:  # the work at risk starts with the first step
            self.auto.last_save = time.monotonic()
        if self.memory_auto is not None:
            self.memory_auto.last_snapshot = time.monotonic()
        if self.auto is not None or self.memory_auto is not None:
            self._update_intervals()  # the daemon's failure history as of this start
            self._report_intervals()
        cid, action, *_ = self._agree()
        while True:
            if action:
                stop = self._obey(cid, action)
                if stop:
                    reason = stop
                    break
            if self.step >= steps:
                break
            if self.stop_at_step is not None and self.step >= self.stop_at_step:
                self.save()
                reason = DoneReason.PAUSED
                break
            self.injector.before_step(self.step + 1, self.step_fn.engine.module)
            self.tuner.before_step()
            result = self.step_fn.run(self.step)
            self.step += 1
            self.tokens_seen += self.step_fn.tokens_per_step
            self._report_step(result)
            if self.after_first_step is not None:
                self.after_first_step()
                self.after_first_step = None
            if self.memory_auto is not None:
                self.memory_auto.stepped(result.seconds)
            profiled = self.tuner.after_step(self.step)  # collective when a profile window ends
            cid, action, bad, spike, due, applied, hold = self._agree(
                *self._verdict(result), applied=not result.skipped)
            if bad or spike:
                stop = self._recover("nan" if bad else "spike", result, applied)
                if stop:
                    reason = stop
                    break
                continue
            if profiled is not None and self.tuner.decide(*profiled, self.step) is not None:
                self.save()  # measured split is faster: restart on it from this checkpoint
                reason = DoneReason.REPARTITION
                break
            every = interval if isinstance(interval, int) else 0
            if (due or (every and self.step % every == 0)) and self.step < steps:
                self.save()
            elif memory and (hold or (every_held and self.step % every_held == 0)) \
                    and self.step < steps:
                self.hold()
        if reason == DoneReason.COMPLETED and self.step > first:
            self.save()
        self.reporter.emit(RecordKind.DONE, step=self.step, reason=reason)
        return reason

    def wait_for_store(self, why: str) -> None:
        """Collective: blocks until every rank's newest checkpoint is durable (its files
        uploaded; on rank 0 the manifest committed) or given up as abandoned, so a job ends
        (COMPLETED, paused, stopped) only with its last checkpoint in the store.

        A store that is slow or down for minutes is waited out: the uploader retries on its
        own; the ranks agree every few seconds (one small all-reduce, so no rank sits in a
        collective long enough to time out), and each waiting rank sends a `store_wait`
        heartbeat saying what is pending, so the daemon shows "waiting for the store" instead
        of declaring a hang and restarting a group whose work is all on local disk.

        Bounded by `checkpoint.store_wait_s`: past it the ranks exit (the devices are freed)
        and ds3dd uploads and commits what is left from the local tier before the job ends
        (daemon/backlog_upload.py); the local markers say what that is."""
        newest, t0 = self.saved_step, time.monotonic()
        uploader = self.ckpt.uploader
        limit = self.cfg.checkpoint.store_wait_s
        while True:
            left = limit - (time.monotonic() - t0)
            idle = self.ckpt.wait_uploads(timeout=max(0.0, min(STORE_WAIT_REPORT_S, left)))
            pending = uploader.pending()
            mine = idle and newest not in pending
            over = time.monotonic() - t0 >= limit  # the daemon takes over what is left
            if not mine:
                self.reporter.emit(RecordKind.HEARTBEAT, step=self.step, phase="store_wait",
                                   why=why, newest=newest, pending=pending,
                                   failed=uploader.failed(),
                                   waited_s=round(time.monotonic() - t0, 1))
                if idle and not over:  # only failed uploads left: the uploader retries them
                    time.sleep(max(0.0, min(STORE_WAIT_REPORT_S, left)))
            done = torch.tensor([int(mine or over)], dtype=torch.long, device=self.device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                return

    def close(self) -> None:
        """Waits (bounded) for the last checkpoint's upload before the process may exit; after
        a normal end, `wait_for_store` has already waited for it to be durable."""
        self.ckpt.close()
        if self.tb is not None:
            self.tb.close()
        self.reporter.close()
