"""One worker's view of checkpoints: save without stalling, restore the newest complete one.

Save (every rank): DeepSpeed's `save_checkpoint` writes this rank's shards through the
`SnapshotCheckpointEngine`, which blocks only for the copy into host memory; the writer thread
then puts the files into the node-local tier, and the `Uploader` hashes and uploads them and
writes this rank's part manifest; rank 0's uploader commits the MANIFEST once all parts are in
the store, then applies retention. The training thread never waits for any of that. Between
durable saves, memory-only snapshots (`save(memory_only=True)`, `checkpoint.memory_interval`)
take the same path into the engine's second arena slot and stop there: held in host and node
memory for rollbacks and crash restarts, never written, uploaded or recorded.

Restore (collective, before the engine is built, because a changed layout needs DeepSpeed's
`load_universal` switch at initialisation): the ranks agree on the newest step local-complete on
every rank (local_complete.py), unhashed: each rank's own files of it are read in parallel into
host memory and checked against the sha256 recorded at save as they stream (read_ahead.py), in
the background while the engine is built; `confirm` then agrees that every rank's files matched
(or plans again without that step) and `load` serves DeepSpeed from those buffers, so the files
are read once. A newer (or the same) step held in node memory on every rank (node_memory.py: a
save's or memory-only snapshot's host copy, which outlived the crashed workers; the newest step
all ranks hold) is restored from there instead, with no disk read. Rank 0 looks for a newer
committed checkpoint whose files verify (local copy first, otherwise downloaded and checked),
every node's first rank makes that step available locally, and when the saved (TP, PP, DP)
differs from the current one the checkpoint is converted to DeepSpeed's universal format and
loaded from there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from . import layout
from .catalog import Catalog, CkptState
from .disk_space import Shortage
from .errors import CheckpointError, Ds3dError, RestoreError
from .identity import claim_prefix, local_job_id
from .local_complete import agree_local_step, read_record
from .manifest import CheckpointMeta, Layout, Manifest, manifest_from_entries
from .node_memory import Fingerprint, NodeArena, no_room
from .read_ahead import ReadAhead, ReadResult
from .recovery_scripts import copy_recovery_scripts_once, recovery_scripts_skipped
from .reshape import (
    UNIVERSAL_SUFFIX,
    ConversionError,
    check_reshapable,
    convert_to_universal,
    needs_reshape,
)
from .settings import CheckpointSettings
from .snapshot import HeldSnapshot, SnapshotCheckpointEngine
from .storage import Storage, job_store_url, open_storage
from .upload import Uploader, UploadEvent, retry_interval_from_env

log = structlog.get_logger("ds3d.checkpoints")

Emit = Callable[..., None]


def tag_for(step: int) -> str:
    return f"global_step{step}"


@dataclass(frozen=True)
class RestorePlan:
    step: int
    tag: str  # the DeepSpeed tag to load (`..._universal` after a layout change)
    manifest: Manifest
    universal: bool
    # where the state is read from: "memory" (the newest save's host copy, an in-process
    # rollback), "node_memory" (that copy kept in /dev/shm by a crashed worker of this job, a
    # restart), "local" (the node-local tier) or "store" (downloaded from the durable tier)
    source: str = "local"
    # "memory", "node_memory": the other ranks' files of the tag, as skeletons
    peers: dict[str, Any] = field(default_factory=dict)
    # "local", unhashed yet: this rank's files being read and hashed (`confirm` waits for it)
    read_ahead: ReadAhead | None = field(default=None, compare=False)
    # after `confirm`: this rank's files' verified bytes by path, which `load` is served from
    buffers: dict[str, memoryview] = field(default_factory=dict, compare=False)
    # ... the paths of those read into the snapshot arena (snapshot.ArenaLoan)
    in_arena: frozenset[str] = frozenset()
    # steps whose local copy failed its hashes in this restore (never planned again)
    excluded: frozenset[int] = frozenset()
    # "memory", "node_memory": the state is a memory-only snapshot (no checkpoint of its step
    # was written; a save of that step is still to be made)
    memory_only: bool = False
    # a new pipeline split the checkpoint could not be converted to: the boundaries it was
    # saved with, which the engine is built with instead (the loop keeps them: partition.json)
    keep_split: list[int] | None = None


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int


def open_job_storage(settings: CheckpointSettings, run_dir: Path) -> Storage:
    """The job's durable tier, opened with its `[checkpoint.s3]` transfer settings (set fields
    win over the daemon's DS3D_S3_* environment); nothing is read from it yet."""
    url = job_store_url(settings.store, settings.job, run_dir)
    options: dict[str, Any] = {}
    if url.startswith("s3://"):
        from .s3_storage import options_from_settings

        options = options_from_settings(settings.s3)
    return open_storage(url, **options)


class CheckpointManager:
    def __init__(self, settings: CheckpointSettings, run_dir: Path, me: Rank,
                 device: torch.device, emit: Emit) -> None:
        self.settings, self.me, self.device, self.emit = settings, me, device, emit
        self.local_dir = Path(settings.local_dir or Path(run_dir) / "ckpt")
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.storage: Storage = open_job_storage(settings, Path(run_dir))
        # before anything is read or written: whose prefix is this (identity.py)
        self.job_id = self._agree_job_id(Path(run_dir))
        if me.rank == 0:
            claim_prefix(self.storage, self.job_id, settings.job)
        self.catalog = Catalog(self.storage, self.local_dir, job_id=self.job_id,
                               on_skip=self._on_skip)
        self.uploader = Uploader(self.storage, self.local_dir, me.rank, me.world_size,
                                 retry_interval=retry_interval_from_env(),
                                 on_event=self._on_upload_event)
        self.node = self._node_arena()
        # memory-only snapshots between durable saves (`save(memory_only=True)`): two arena
        # slots; turned off where they could never be restored (data-parallel size > 1) or
        # where node memory has room for one arena only (`prepare`)
        self.memory_snapshots = settings.memory_interval != 0  # N or "auto"
        if self.memory_snapshots and me.dp > 1:
            self._memory_snapshots_off("data_parallel", "data-parallel size > 1: nothing is "
                                       "ever restored from memory (DeepSpeed's data-parallel "
                                       "ranks above 0 read model files rank 0 wrote)")
        if self.node is not None and not self.memory_snapshots:
            self.node.remove_slots_from(1)  # a second slot of an earlier start: never used
        self.snapshot = SnapshotCheckpointEngine(on_durable=self._on_durable,
                                                 on_failed=self._on_write_failed, node=self.node,
                                                 slots=2 if self.memory_snapshots else 1)
        self._meta: dict[str, tuple[int, CheckpointMeta]] = {}
        self.newest_durable = -1  # the newest durable save of this process's timeline
        self._room_agreed = False  # the ranks agreed on room for two arenas (`_reserve`)
        # the snapshots a crashed worker held in node memory, mapped back by the first restore
        # plan: restorable until a state is loaded
        self._node_held = False
        self._node_adopted = False
        # pipeline stage boundaries this run builds; a checkpoint saved with others (its
        # data_position "partition") has per-stage optimizer shards that do not fit: universal
        self.partition: list[int] | None = None
        self.uploader.resume_pending()
        self._tell_parts_gone()

    def _tell_parts_gone(self) -> None:
        """Collective, at start: every rank says which steps it has a part of; rank 0's
        resumed commits that a rank of the same world has none of (it died before writing
        them) list the store once more instead of waiting for a part that never comes."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        marked: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(marked, self.uploader.marked_steps())
        if self.me.rank == 0:
            gone = self.uploader.parts_gone([m or [] for m in marked], self.me.world_size)
            if gone:
                log.info("resumed_commits_without_parts", steps=gone,
                         detail="those ranks ended before writing their files of the step; "
                                "its commit is not waited for")

    def _agree_job_id(self, run_dir: Path) -> str:
        """Every rank uses the same job id: the one ds3dd wrote into the job directory (any
        node that has it tells the others), else one made in the run directory (torchrun)."""
        mine = local_job_id(run_dir)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine or str(local_job_id(run_dir, create=True))
        ids: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(ids, mine)
        known = sorted({i for i in ids if i})
        if len(known) > 1:
            raise CheckpointError(f"the job directories of this job's nodes name different job "
                                  f"ids {known}; each node's job directory must come from the "
                                  "same ds3dd job")
        if known:
            return known[0]
        made = [local_job_id(run_dir, create=True) if self.me.rank == 0 else None]
        dist.broadcast_object_list(made, src=0)
        return str(made[0])

    def _node_arena(self) -> NodeArena | None:
        """This rank's node memory arena (`checkpoint.keep_in_node_memory`), or None when it
        is off or could never be restored (data-parallel size > 1). `true` fails here when
        the node memory folder is not a tmpfs; its size is checked once the state's size is
        known (`prepare`). Files of another layout go: ranks beyond this world, or all of
        them when none is kept."""
        keep, me = self.settings.keep_in_node_memory, self.me
        node = NodeArena(Fingerprint(job_id=self.job_id, rank=me.rank, world_size=me.world_size,
                                     tp=me.tp, pp=me.pp, dp=me.dp,
                                     model_hash=self.settings.model_hash))
        kept = keep is not False and me.dp == 1  # dp > 1: never restorable (_agree_node_held)
        if me.local_rank == 0:
            node.remove_ranks_from(me.world_size if kept else 0)
        if not kept:
            if keep is not False and me.rank == 0:
                log.info("node_memory_unused", reason="data-parallel size > 1: DeepSpeed's "
                         "data-parallel ranks above 0 read model files rank 0 wrote")
            return None
        if keep is True:
            why = no_room(0, node.folder.parent)
            if why is not None:
                raise CheckpointError(f"checkpoint.keep_in_node_memory = true, but {why}; "
                                      "set it to \"auto\" (fall back to process memory) or "
                                      "false, or give the node a tmpfs /dev/shm")
        return node

    def _memory_snapshots_off(self, cause: str, why: str) -> None:
        """Memory-only snapshots are off for this run: one log line and one `checkpoint`
        record (rank 0) say why."""
        self.memory_snapshots = False
        if self.me.rank == 0:
            log.warning("memory_snapshots_off", cause=cause, reason=why,
                        memory_interval=self.settings.memory_interval)
            self.emit("checkpoint", step=-1, phase="memory_snapshots_off", cause=cause,
                      detail=f"checkpoint.memory_interval = {self.settings.memory_interval} "
                             f"is off for this run: {why}")

    def release_node_memory(self) -> None:
        """A clean exit of the worker: this rank's node memory files go (nothing restarts
        from them; node_memory.py)."""
        self.snapshot.release_node_memory()

    def _on_skip(self, step: int, cause: str, detail: str) -> None:
        """A checkpoint a restore passed over: reported, so the daemon shows it as what it is."""
        self.emit("checkpoint", step=step, phase="skipped", cause=cause, detail=detail)

    # -- restore ------------------------------------------------------------------------------

    def plan_restore(self, rollback_to: int | None = None,
                     exclude: frozenset[int] = frozenset()) -> RestorePlan | None:
        """Collective: every rank returns the same plan (or None for a fresh start).
        `rollback_to` asks for that exact step instead of the newest (CheckpointError if it is
        not restorable). Otherwise the newest step local-complete on every rank
        (local_complete.py), unless the store holds a newer durable one; checkpoints of this
        rank newer than the choice are dropped (a timeline trained again). Rank 0's
        `rollback_to` counts (only rank 0 reads the daemon's request): it is broadcast first,
        so every rank takes the same collective path. A step local-complete on every rank is
        planned before its hashes are checked: the plan's `read_ahead` reads and hashes this
        rank's files in the background, and `confirm` (collective, before `load`) accepts it
        or plans again with the step in `exclude`."""
        asked = self._broadcast(-1 if rollback_to is None else rollback_to)
        rollback_to = None if asked < 0 else asked
        found = None
        held = self._agree_node_held() if rollback_to is None else self._abandon_node_held()
        local_step, local_manifest = (-1, None) if rollback_to is not None else \
            agree_local_step(self.local_dir, self.me.rank, self.me.world_size, self.job_id,
                             self.device, verify=False, exclude=exclude)
        if self.me.rank == 0:
            found = self.catalog.newest_restorable(checksums=True, download=True,
                                                   only_step=rollback_to,
                                                   newer_than=max(local_step, held),
                                                   uncommit_corrupt=True)
        step = self._broadcast(found.step if found else local_step)
        if held >= 0 and held >= step:
            return self._node_memory_plan(held)
        self._node_held = False  # `load` forgets them unless the step loaded is the same
        if step >= 0 or rollback_to is None:
            self.uploader.drop_newer_than(step)
        if self.me.rank == 0 and step >= 0:
            self.emit("checkpoint", step=step, phase="restoring",
                      durable=step != local_step or layout.local_manifest_path(self.local_dir,
                                                                         step).exists(),
                      detail="local-complete on every rank" if step == local_step else
                      "the newest durable checkpoint",
                      source="store" if found is not None and found.source == "downloaded"
                      else "local")
        if step < 0:
            if rollback_to is not None:
                raise CheckpointError(f"cannot roll back to step {rollback_to}: no complete, "
                                      "verified checkpoint of that step (see `ds3dctl "
                                      "checkpoints`)")
            return None
        if step == local_step:
            pass  # every node holds it whole and verified (agree_local_step)
        elif self.me.local_rank == 0 and self.me.rank != 0:
            found = self.catalog.newest_restorable(checksums=True, download=True, only_step=step,
                                                   uncommit_corrupt=True)
            if found is None or found.step != step:
                raise RestoreError(f"rank {self.me.rank}'s node cannot get checkpoint step "
                                      f"{step} that rank 0 chose (it found "
                                      f"{found.step if found else 'none'})")
        manifest = local_manifest if step == local_step and local_manifest is not None else \
            self.catalog.load_manifest(step, local_only=True) if found is None else found.manifest
        if manifest.model_hash and manifest.model_hash != self.settings.model_hash:
            raise CheckpointError(
                f"checkpoint step {step} was saved by a different model architecture (hash "
                f"{manifest.model_hash}, this job {self.settings.model_hash}); restore it with the "
                "same [model] settings, or start a new job name / store")
        saved = manifest.layout
        me = self.me
        saved_parts = manifest.data_position.get("partition")
        moved = self.partition is not None and saved_parts is not None and \
            list(saved_parts) != list(self.partition)
        universal = needs_reshape(saved, me.tp, me.pp, me.dp) or moved
        read_ahead = None
        if step == local_step:  # unhashed yet: read and hash this rank's files in the background
            own = read_record(self.local_dir, step, me.rank)
            files = own.part.files if own is not None else []
            state_bytes = sum(f.size for f in files)
            # on a GPU, straight into the snapshot arena (ArenaLoan): one fault of its pages,
            # and a load from page-locked memory
            loan = self.snapshot.lend_arena(self._arena_bytes(state_bytes)) \
                if self.device.type == "cuda" and state_bytes > 0 else None
            read_ahead = ReadAhead(self.local_dir, files, into=loan).start()
            self._pin_early(state_bytes)
            if universal:  # the conversion reads the files: they must verify first
                if not self._all_verified(step, read_ahead.wait()):
                    return self.confirm(self.plan_restore(exclude=exclude | {step}))
                read_ahead = None  # the converted files are what is loaded
        tag = manifest.tag
        keep_split = None
        if universal:
            check_reshapable(saved, me.tp, me.pp, me.dp, self.settings.zero_stage)
            change = f"(tp,pp,dp) {saved.tp},{saved.pp},{saved.dp} -> {me.tp},{me.pp},{me.dp}" + (
                f", stages {list(saved_parts or [])} -> {self.partition}" if moved else "")
            # only the pipeline split moved (a measured re-split, `ds3dctl rebalance`): if the
            # conversion fails, the checkpoint loads as it is into the split it was saved with
            only_split = moved and not needs_reshape(saved, me.tp, me.pp, me.dp)
            if self._convert(step, manifest.tag, change, only_split):
                tag = manifest.tag + UNIVERSAL_SUFFIX
            else:
                keep_split, universal = [int(b) for b in saved_parts or []], False
        source = "store" if found is not None and found.source == "downloaded" else "local"
        return RestorePlan(step=step, tag=tag, manifest=manifest, universal=universal,
                           source=source, read_ahead=read_ahead, excluded=exclude,
                           keep_split=keep_split)

    def _convert(self, step: int, tag: str, change: str, only_split: bool) -> bool:
        """Collective: each node's first local rank converts its copy of `tag` into a universal
        checkpoint (reshape.py); True when every node's conversion succeeded. When only the
        pipeline split moved (`only_split`), a failure returns False: the restore keeps the
        split the checkpoint was saved with (phase `reshape_failed`). Otherwise it raises; the
        rank that met the converter's refusal of the checkpoint itself (every later try would
        meet it too) reports it first (phase `load_failed`, cause `reshape`: the daemon pauses
        the job, daemon/load_failures.py); a failure of the moment (memory, disk, a signal) is
        only raised, for the restart to try again."""
        failed: ConversionError | None = None
        if self.me.local_rank == 0:
            t0 = time.perf_counter()
            try:
                convert_to_universal(self.local_dir, tag)
                self.emit("checkpoint", step=step, phase="reshaped", detail=change,
                          seconds=round(time.perf_counter() - t0, 3))
            except ConversionError as e:
                failed = e
        if self._everyone(failed is None):
            return True
        if only_split:
            if failed is not None:
                self.emit("checkpoint", step=step, phase="reshape_failed",
                          detail=f"{change}: {failed.reason}")
            return False
        if failed is None:
            raise RestoreError(f"another node could not convert checkpoint step {step} to this "
                               f"layout ({change}); its ranks' records say why")
        if failed.checkpoint_at_fault:
            self.emit("checkpoint", step=step, phase="load_failed", cause="reshape",
                      reshape=change, detail=failed.reason)
        raise failed

    def _agree_node_held(self) -> int:
        """Collective: the newest step every rank holds in node memory (adopted at start: one
        snapshot per arena slot), or -1 when no step is held by all, or the held copy cannot
        be loaded as it is: with data-parallel size > 1 (DeepSpeed's data-parallel ranks above
        0 read model files that rank 0 wrote, which are not in their memory) or when it was
        saved with other pipeline stage boundaries (that needs the universal conversion of
        files)."""
        if not self._node_adopted and self.node is not None:
            self._node_adopted = True  # once, before this process's first save
            self._node_held = self.snapshot.adopt_node_memory(str(self.local_dir)) is not None
        mine = []
        if self._node_held and self.me.dp == 1:
            for held in self.snapshot.held_snapshots():
                saved_parts = _meta_of(held).data_position.get("partition") \
                    if held.meta else None
                if held.step >= 0 and held.meta and (
                        self.partition is None or saved_parts is None
                        or list(saved_parts) == list(self.partition)):
                    mine.append(held.step)
        return self._newest_held_everywhere(mine)

    def _newest_held_everywhere(self, mine: list[int]) -> int:
        """Collective: the newest of `mine` (this rank's held steps) that every rank lists,
        or -1."""
        lists: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(lists, sorted(mine))
        common = set(mine)
        for steps in lists:
            common &= set(steps or [])
        return max(common, default=-1)

    def _abandon_node_held(self) -> int:
        """A rollback request: the state held in node memory (newer than the target, or of a
        timeline given up) must never be restored by a later restart; returns -1."""
        self._node_adopted, self._node_held = True, False
        self.snapshot.forget_held()
        return -1

    def _node_memory_plan(self, step: int) -> RestorePlan:
        """Collective: the plan that restores the snapshot every rank holds in node memory
        (`_agree_node_held` chose `step`), served like a memory rollback: no disk read."""
        held = self._held_of(step)
        assert held is not None and self._node_held
        self.uploader.drop_newer_than(step)
        if self.me.rank == 0:
            self.emit("checkpoint", step=step, phase="restoring",
                      durable=layout.local_manifest_path(self.local_dir, step).exists(),
                      detail="held in node memory on every rank" + (
                          "" if held.durable else " (a memory-only snapshot)"),
                      source="node_memory")
        return self._held_plan(held, "node_memory")

    def _held_of(self, step: int) -> HeldSnapshot | None:
        """The newest held snapshot of `step`."""
        return next((h for h in self.snapshot.held_snapshots() if h.step == step), None)

    def _held_plan(self, held: HeldSnapshot, source: str) -> RestorePlan:
        """Collective: a plan served from the held snapshot `held` (every rank holds its
        step), with the other ranks' files as skeletons (DeepSpeed lists them)."""
        skeletons: list[dict[str, Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(skeletons, self.snapshot.held_skeleton(held.tag))
        own = {os.path.basename(p) for p in held.files}
        peers = {name: sk for part in skeletons for name, sk in (part or {}).items()
                 if name not in own}
        # the save's meta, no file list
        manifest = manifest_from_entries(held.step, _meta_of(held), [])
        return RestorePlan(step=held.step, tag=held.tag, manifest=manifest, universal=False,
                           source=source, peers=peers, memory_only=not held.durable)

    def confirm(self, plan: RestorePlan | None) -> RestorePlan | None:
        """Collective: waits for the plan's read-ahead and accepts the plan when every rank's
        files matched the sha256 recorded at save, with their bytes in `buffers`; otherwise
        plans again without that step (an older local-complete one, or the store's: the same
        fall-back a corrupt local copy always had). A plan without a read-ahead (memory, store,
        rollback) is returned as it is."""
        if plan is None or plan.read_ahead is None:
            return plan
        result = plan.read_ahead.wait()
        if self._all_verified(plan.step, result):
            return dataclasses.replace(plan, read_ahead=None, buffers=result.buffers,
                                       in_arena=result.placed)
        return self.confirm(self.plan_restore(exclude=plan.excluded | {plan.step}))

    def _all_verified(self, step: int, result: ReadResult) -> bool:
        """Collective: every rank's read-ahead of `step` matched its recorded hashes."""
        if self._everyone(result.ok):
            log.info("local_copy_verified", step=step, bytes=result.nbytes,
                     seconds=round(result.seconds, 3),
                     GBps=round(result.nbytes / max(result.seconds, 1e-9) / 1e9, 2))
            return True
        log.warning("local_complete_rejected", step=step, rank=self.me.rank,
                    files=result.bad or None,
                    detail="a rank's files fail their recorded sha256; planning again")
        return False

    def plan_memory_rollback(self, newest: int) -> RestorePlan | None:
        """Collective: a plan that rolls back to the newest held snapshot (snapshot.py: a
        durable save's or a memory-only snapshot's host copy; two are held with memory-only
        snapshots on) whose step is at most `newest` and that every rank holds; every rank
        returns the same. None (roll back from the local tier) when there is none: no save yet
        in this process, later saves have begun reusing its slot, or data-parallel size > 1
        (DeepSpeed's data-parallel ranks above 0 read model files that rank 0 wrote, which are
        not in their memory). Nothing waits for the files or the upload of any save: they go
        on in the background."""
        mine = [h.step for h in self.snapshot.held_snapshots()
                if 0 <= h.step <= newest and h.meta] if self.me.dp == 1 else []
        step = self._newest_held_everywhere(mine)
        held = self._held_of(step) if step >= 0 else None
        return None if held is None else self._held_plan(held, "memory")

    def drop_newer_than(self, step: int) -> list[int]:
        """After a rollback: checkpoints newer than `step` belong to an abandoned timeline and
        would be restored by the next automatic restart; rank 0 deletes them."""
        if self.me.rank != 0:
            return []
        newer = [c.step for c in self.catalog.list()
                 if c.step > step and c.state is not CkptState.FOREIGN]
        for s in newer:
            self.catalog.delete(s, force=True)
        return newer

    def load(self, engine: Any, plan: RestorePlan) -> None:
        """DeepSpeed's `load_checkpoint` of `plan.tag`; for a "memory" or "node_memory" plan
        the same call reads each file's state from the host copy (`serving_held`) instead of
        the disk."""
        engine.checkpoint_engine = self.snapshot
        if plan.read_ahead is not None:
            raise CheckpointError(f"internal: the plan of step {plan.step} was not confirmed "
                                  "(CheckpointManager.confirm) before its load")
        if plan.buffers:
            if plan.in_arena:
                self.snapshot.await_loan()
            with self.snapshot.serving_buffers(plan.buffers):
                path, _ = engine.load_checkpoint(str(self.local_dir), tag=plan.tag,
                                                 load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
            # the arena's bytes become snapshot space
            self.snapshot.end_loan({p: v for p, v in plan.buffers.items() if p in plan.in_arena})
        elif plan.source in ("memory", "node_memory"):
            with self.snapshot.serving_held(plan.peers, self.device,
                                             tag=plan.tag) as stand_ins:
                path, _ = engine.load_checkpoint(stand_ins, tag=plan.tag,
                                                 load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
        else:
            path, _ = engine.load_checkpoint(str(self.local_dir), tag=plan.tag,
                                             load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
        if path is None:
            raise RestoreError(f"DeepSpeed could not load {plan.tag} from {self.local_dir}")
        self._node_held = False
        self.newest_durable = min(self.newest_durable, plan.step)
        # a rollback to another state abandons the newer held copies (saves of the abandoned
        # timeline): a crash must not restart from them, nor a rollback go back to them. An
        # older one stays only beside a held state restored (after a load from disk it would
        # be a worse rollback target than that checkpoint)
        held_plan = plan.source in ("memory", "node_memory")
        self.snapshot.forget_held(unless_tag=plan.tag,
                                  older_kept=plan.step if held_plan else None)

    # -- save ---------------------------------------------------------------------------------

    def prepare(self, engine: Any) -> int:
        """On a GPU, starts pinning host memory for this rank's snapshots in the background, so
        that even the first save blocks only for the copy. The size is an estimate: the module's
        parameters, plus fp32 master weights and Adam's two moments of this rank's share of
        them, +10%. Returns the bytes reserved (0 on CPU). On CPU with node memory the arena
        is reserved too (not pinned, at once), so a crash keeps the newest save there."""
        cuda = self.device.type == "cuda"
        if not cuda and self.node is None:
            return 0
        params = list(engine.module.parameters())
        numel = sum(p.numel() for p in params)
        shard = numel // self.me.dp if self.settings.zero_stage >= 1 else numel
        nbytes = int((sum(p.numel() * p.element_size() for p in params) + 12 * shard) * 1.1) \
            + ((64 << 20) if cuda else (4 << 20))
        node = self.node
        if self.settings.keep_in_node_memory is True and node is not None \
                and not self.snapshot.arena_adopted:
            old = node.arena_path.stat().st_size if node.arena_path.exists() else 0
            why = no_room(nbytes, node.folder.parent, reusable=old)
            if why is not None:
                raise CheckpointError(f"checkpoint.keep_in_node_memory = true, but {why}; "
                                      "set it to \"auto\" or false, or make room there")
        self._reserve(nbytes, pin=cuda)
        if not cuda:
            self.snapshot.wait_arena()
        return nbytes

    def _reserve(self, nbytes: int, pin: bool) -> None:
        """Collective: starts reserving the snapshot arenas (the first call counts:
        `reserve_pinned`), once the ranks agreed whether there is room for two."""
        if self.memory_snapshots and not self._room_agreed:
            self._room_agreed = True
            self._agree_room_for_two(nbytes)
        self.snapshot.reserve_pinned(nbytes, pin=pin)

    def _agree_room_for_two(self, nbytes: int) -> None:
        """Collective, before the arenas are reserved: memory-only snapshots need two arenas
        of `nbytes`; where node memory has room for one only, they are off on every rank (the
        one arena stays in node memory, so a crash still restarts from the newest durable
        save's copy). A node memory without room for one arena needs no agreement: both
        arenas are process memory, serving in-process rollbacks."""
        why = None
        node = self.node
        if node is not None:
            sizes = [s.arena_path.stat().st_size if s.arena_path.exists() else 0
                     for s in (node.for_slot(0), node.for_slot(1))]
            root = node.folder.parent
            if no_room(nbytes, root, reusable=sizes[0]) is None:
                why = no_room(2 * nbytes, root, reusable=sum(sizes))
        whys: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(whys, why)
        lacking = [(rank, w) for rank, w in enumerate(whys) if w]
        if lacking:
            self.snapshot.limit_slots(1)
            rank, first = lacking[0]
            self._memory_snapshots_off(
                "node_memory_room", f"node memory has room for one snapshot arena, not the two "
                f"they need (rank {rank}: {first}); make room in /dev/shm (2x this rank's "
                "state), or set checkpoint.keep_in_node_memory = false to keep both arenas in "
                "process memory (no crash restart from memory)")

    def _pin_early(self, state_bytes: int) -> None:
        """A restore knows this rank's state size from its files: the snapshot arena is pinned
        from now, alongside the read and the engine build, rather than after the load, where
        page-locking ~20 GB (about 10 s on an H200) held up the first step (`prepare` then
        finds it under way). Collective (the room for two arenas is agreed first): every rank
        calls it, one without files of the step with 0."""
        if self.device.type == "cuda":
            self._reserve(self._arena_bytes(state_bytes), pin=True)

    @staticmethod
    def _arena_bytes(state_bytes: int) -> int:
        """The snapshot arena for a restored state of `state_bytes` (its files' sizes): 10% and
        64 MiB over it, for the pickles and the alignment of the carved buffers."""
        return int(state_bytes * 1.1) + (64 << 20) if state_bytes > 0 else 0

    def save(self, engine: Any, step: int, client_state: dict[str, Any], tokens_seen: int,
             data_position: dict[str, Any], memory_only: bool = False) -> float:
        """Blocks only for the snapshot; returns the seconds training was blocked.
        `memory_only` (with `memory_snapshots`): a memory-only snapshot, held in host and node
        memory for rollbacks and crash restarts, never written, queued, uploaded or recorded
        (snapshot.py); it never waits for the writer."""
        engine.checkpoint_engine = self.snapshot
        tag = tag_for(step)
        me = self.me
        meta = CheckpointMeta(
            job=self.settings.job, job_id=self.job_id, tokens_seen=tokens_seen, tag=tag,
            layout=Layout(tp=me.tp, pp=me.pp, dp=me.dp, world_size=me.world_size),
            model_hash=self.settings.model_hash, data_position=data_position)
        if memory_only:
            t0 = time.perf_counter()
            self.snapshot.describe_next_save(step, meta.model_dump_json())
            with self.snapshot.memory_only(), recovery_scripts_skipped(engine):
                engine.save_checkpoint(str(self.local_dir), tag=tag, client_state=client_state,
                                       save_latest=False)
            return time.perf_counter() - t0
        copy_recovery_scripts_once(engine)  # a full disk must not fail the save through them
        self._meta[tag] = (step, meta)
        t0 = time.perf_counter()
        self.snapshot.describe_next_save(step, meta.model_dump_json())
        engine.save_checkpoint(str(self.local_dir), tag=tag, client_state=client_state,
                               save_latest=False)
        self.newest_durable = step
        return time.perf_counter() - t0

    def memory_snapshot_ready(self) -> bool:
        """Collective: every rank's next memory-only snapshot would copy into its reserved
        arena (snapshot.py `memory_slot_ready`); until then they are skipped, since a copy into
        fresh pageable memory would block longer and take a second state's worth of memory."""
        return self._everyone(self.snapshot.memory_slot_ready())

    def _on_durable(self, tag: str, paths: list[str]) -> None:
        """Writer thread: this rank's files of `tag` are on local disk; queue the upload. A
        full disk refusing the upload's marker fails the save (`_on_write_failed` next)."""
        step, meta = self._meta[tag]
        files = sorted(os.path.relpath(p, self.local_dir) for p in paths)
        self.uploader.submit(step, files, meta, written=self.snapshot.written(tag))
        del self._meta[tag]

    def _on_write_failed(self, tag: str, paths: list[str], short: Shortage, error: str) -> None:
        """Writer thread: the local disk was full. The save is dropped (its partial files are
        gone, nothing older is touched) and reported; training goes on and the next save
        tries again."""
        step, _meta = self._meta.pop(tag)
        log.warning("checkpoint_disk_full", step=step, error=error, **short.fields())
        self.emit("checkpoint", step=step, phase="failed", cause="disk_full",
                  detail=short.message(f"checkpoint step {step} (rank {self.me.rank})"),
                  **short.fields())

    def _on_upload_event(self, ev: UploadEvent) -> None:
        extra: dict[str, Any] = dict(ev.timings)  # local_complete: write_s, hash_s, ...
        if ev.kind == "committed":  # the whole checkpoint's size, for the upload-bytes metric
            try:
                extra["bytes"] = self.catalog.load_manifest(ev.step, local_only=True).total_size
            except Ds3dError:
                pass  # the size is for a metric; the commit itself is done
        self.emit("checkpoint", step=ev.step, phase=ev.kind, seconds=round(ev.seconds, 3),
                  detail=ev.detail, **extra)
        if ev.kind == "committed":
            self._clean_up(ev.step)

    def _clean_up(self, step: int) -> None:
        """After a commit: retention, then leftovers older than the grace period. A failed
        cleanup is its own `cleanup_failed` record, for the step it failed on; it changes the
        state of no checkpoint (not of the one just committed, not of any other)."""
        c = self.settings
        try:
            kept = self.catalog.apply_retention(c.keep_last, c.keep_every)
            swept = self.catalog.sweep(c.cleanup_grace_s)
        except Ds3dError as e:  # listing the store failed: nothing was deleted
            self.emit("checkpoint", step=step, phase="cleanup_failed", cause="retention",
                      detail=str(e))
            return
        if kept.deleted:
            self.emit("checkpoint", step=step, phase="retention", detail=f"deleted {kept.deleted}",
                      deleted=kept.deleted)
        for failed_step, error in kept.failed.items():
            self.emit("checkpoint", step=failed_step, phase="cleanup_failed", cause="retention",
                      detail=error)
        if swept.steps or swept.temporaries or swept.uploads:
            self.emit("checkpoint", step=step, phase="swept", steps=swept.steps,
                      temporaries=len(swept.temporaries), uploads=len(swept.uploads),
                      detail=f"removed leftovers older than {c.cleanup_grace_s:.0f} s: "
                             f"uncommitted steps {swept.steps}, {len(swept.temporaries)} "
                             f"temporary files, {len(swept.uploads)} multipart uploads")
        for what, error in swept.failed.items():
            self.emit("checkpoint", step=step, phase="cleanup_failed", cause="leftovers",
                      detail=f"{what}: {error}")

    def busy(self) -> bool:
        """A checkpoint of this rank is still being written, uploaded or committed."""
        return self.snapshot.busy() or bool(self.uploader.pending())

    def wait_uploads(self, timeout: float) -> bool:
        """Waits for this rank's writes and uploads (the commit too, on rank 0)."""
        self.snapshot.wait()
        return self.uploader.wait(timeout)

    def close(self, timeout: float = 600.0) -> None:
        self.snapshot.wait()
        self.uploader.wait(timeout)
        self.uploader.close(timeout=10)
        self.snapshot.close()

    # -- helpers --------------------------------------------------------------------------------

    def _everyone(self, ok: bool) -> bool:
        """Collective: `ok` on every rank (one all-reduce, MIN)."""
        t = torch.tensor([int(ok)], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _broadcast(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())


def _meta_of(held: HeldSnapshot) -> CheckpointMeta:
    """The manifest metadata a held snapshot's save described."""
    return CheckpointMeta.model_validate_json(held.meta)
