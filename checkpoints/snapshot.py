"""A DeepSpeed checkpoint engine that blocks training only for a copy to host memory.

DeepSpeed's default engine calls `torch.save` on the training thread: serialisation and disk
writes (25-34 s for a 20 GB state on an H200, see FIELD-NOTES) stall every rank. Here `save()`
copies each tensor into host memory (pinned on GPU, so the device-to-host copy runs at full
bandwidth; the buffers are kept and reused by the next save, so memory stays bounded at one host
copy of this rank's state per arena slot) and hands the copy to a writer thread that serialises
it to the node-local tier (temp file, fsync, rename). The copy must finish before the call
returns: the next optimizer step mutates the tensors in place (DCP's async_save once captured
post-step values, pytorch#144657).

Pinning host memory is slow (page locking: ~15 s for a 20 GB state on an H200, measured), so
`reserve_pinned(nbytes)` registers each slot's host arena with CUDA on a background thread while
training runs, and saves carve their buffers out of it. A save that comes before its arena is
ready copies into pageable memory that once (about 3x slower than pinned, far faster than
pinning inline).

A durable save that arrives while the previous one is still being written waits for that write
first (the host buffers are in use): durable saves are serialised, never overlapped, never
coalesced away. Memory-only snapshots (`memory_only()`, `checkpoint.memory_interval`) are the
exception: with them the engine has two arena slots, each an arena of the state's size (so 2x
this rank's state in host memory). A save copies into a slot the writer is not reading from: a
durable one (after the wait) into the slot of the older held snapshot, a memory-only one at once
into the slot not being written, overwriting the older memory-only snapshot there if need be,
so it never waits for the writer, and the other slot's snapshot stays valid while it copies. A
memory-only snapshot makes no folder and queues nothing: it is held (below), never written.
`on_durable(tag, paths)` is called on the writer thread when all files of a tag are on disk; it
must not use collectives (no process group is shared with the training thread).

Each file is hashed while it is written (hashing_writer.py): the bytes `torch.save` hands over
feed the file's sha256 and its 64 MiB pieces' hashes, the snapshot's host buffers are hashed in
the background while the writes and the fsync go on, and the fsync is followed only by the
wait for hashes still running. During `on_durable`, `written(tag)` gives those hashes and
timings, so the uploader records the save local-complete without reading the files back. A
digest is of exactly the bytes this process wrote, flushed and fsynced into the file, whose size
on disk is checked against it after the rename; a file whose writer did anything but append
has no digest and is hashed by reading it back.

A full disk fails the save, never training: when a write of a tag runs out of space (ENOSPC or
EDQUOT, `disk_space.is_disk_full`), the tag's remaining writes are skipped, every file of it
written so far (and the partial temp file) is removed, and `on_failed(tag, paths, shortage,
error)` reports the bytes this rank's files needed against the bytes free on that file system.
A save whose files fitted but whose `on_durable` bookkeeping (the uploader's marker) a full
disk refused fails the same way.
Nothing older is touched: earlier tags live in their own folders and nothing here deletes
them, so the last good checkpoint survives. Any other write error is kept and raised by the
next save, as before.

The newest save of each slot stays readable from host memory (`held()`, `held_snapshots()`,
`serving_held()`): an in-process rollback to it reads the host copy instead of waiting for the
files and reading them back (DeepSpeed's own `load_checkpoint` runs unchanged, over a folder of
empty stand-ins for the tag's files; only where each file's dict comes from differs).
Invariant, per slot: a held snapshot is exactly the state its save copied, because the only
writes into a slot's host buffers are a later save's copies into that slot, and `create()` (the
first call of every save, before any copy) forgets the snapshot of the slot it chose. A
rollback that finds nothing held, because later saves have begun reusing the slots, reads the
local tier.

With a `NodeArena` (node_memory.py) each slot's arena is a file in /dev/shm, so the held copies
outlive the process: `commit()` writes a slot's validity marker once every copy of the save is
complete, and `create()` of the next save into that slot removes it before the first byte is
copied (the marker-file form of the invariant above); a restarted worker maps the arenas back
(`adopt_node_memory`), which then serve the restore (`serving_held`) and become this process's
arenas for its saves. Where /dev/shm has no room, the arenas are anonymous as before (one log
line says why).
"""

from __future__ import annotations

import copy
import ctypes
import gc
import mmap
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from .disk_space import Shortage, is_disk_full, shortage
from .errors import CheckpointError
from .hashing_writer import HashingWriter, WrittenFile, WrittenSave
from .host_memory import (
    PIN_PIECE_BYTES,
    anonymous_buffer,
    piece_ranges,
    populate,
    register_in_pieces,
    unregister_pieces,
)
from .node_memory import NodeArena
from .read_ahead import load_buffer

log = structlog.get_logger("ds3d.checkpoints.snapshot")

DurableCallback = Callable[[str, list[str]], None]
# (tag, its file paths, what did not fit, the error's text): a save abandoned for a full disk
FailedCallback = Callable[[str, list[str], Shortage, str], None]


@dataclass(frozen=True)
class HeldSnapshot:
    """A save's host copy: each file's path (as DeepSpeed named it) -> its state."""

    tag: str  # DeepSpeed's tag, the folder name its files live in
    files: dict[str, Any]
    step: int = -1  # as `describe_next_save` named it (-1: not described)
    meta: str = ""  # the save's manifest metadata (JSON), as described
    durable: bool = True  # its files were queued for the local tier (False: memory-only)


@dataclass(eq=False)
class _Slot:
    """One host arena and the snapshot held in it. The writer thread reads a slot's buffers
    from a durable save's commit until its files are written (`writing`); nothing else does."""

    node: NodeArena | None  # its arena file in node memory, where kept
    arena: mmap.mmap | None = None  # host memory its snapshots are carved from
    pieces: list[int] = field(default_factory=list)  # registered (pinned) pieces' addresses
    used: int = 0
    buffers: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    held: HeldSnapshot | None = None  # its snapshot, while intact
    order: int = -1  # when that snapshot was made (larger: newer; -1: none)
    writing: bool = False  # a durable save's files are being written from it
    adopted: bool = False  # the arena was mapped back from node memory
    refused: bool = False  # its reservation failed: per-tensor buffers
    piece: int = PIN_PIECE_BYTES  # bytes per registration (the whole arena after a loan)


@dataclass(frozen=True)
class _Serving:
    """A memory rollback in progress: DeepSpeed reads `folder`'s stand-in files."""

    folder: str
    mine: dict[str, Any]  # this rank's files by name: their held state
    others: dict[str, Any]  # the other ranks' files by name: their skeletons
    device: torch.device | None


class ArenaLoan:
    """The first arena lent to a restore's read (read_ahead.py `into`): the checkpoint's files
    are read straight into the memory the snapshots will be carved from, instead of into 20 GB
    of buffers of their own that the arena's pages then repeat. The read faults the pages in
    (so the arena needs no `populate`), the reservation thread registers the whole arena with
    CUDA once the read is done (one registration: a tensor of the load may span any 1 GiB
    piece), and the load's host-to-device copies then run from page-locked memory. The arena
    is carved for snapshots only after `SnapshotCheckpointEngine.end_loan` found none of the
    read's bytes still referenced."""

    def __init__(self, make: Callable[[], mmap.mmap], nbytes: int) -> None:
        self._make, self.nbytes = make, nbytes
        self.arena: mmap.mmap | None = None
        self.finished = threading.Event()  # the read is over: the arena may be registered
        self.registered = threading.Event()  # ... and its registration was tried

    def take(self, needed: int) -> memoryview | None:
        """The reader's thread: the arena (made now: a node memory file is allocated here,
        beside the engine build) as one buffer of at least `needed` bytes, or None (read into
        buffers of its own) when the arena is smaller."""
        if needed > self.nbytes:
            return None
        self.arena = self._make()
        return memoryview(self.arena)

    def done(self) -> None:
        self.finished.set()


class SnapshotCheckpointEngine(CheckpointEngine):
    def __init__(self, on_durable: DurableCallback | None = None,
                 on_failed: FailedCallback | None = None,
                 hash_while_writing: bool = True, node: NodeArena | None = None,
                 slots: int = 1) -> None:
        """`hash_while_writing=False`: files are written plain and the uploader hashes them
        by reading them back (the path before hashing_writer.py; the benchmark's baseline).
        `node`: keep the arena in node memory (/dev/shm) where there is room, so the newest
        save's host copy survives a crash of this process. `slots`: 2 for memory-only
        snapshots (`memory_only`), which then never wait for the writer."""
        if slots not in (1, 2):
            raise ValueError(f"an engine has 1 or 2 arena slots, not {slots}")
        super().__init__()
        self.name = "ds3d-snapshot"
        self.on_durable = on_durable
        self.on_failed = on_failed
        self.hash_while_writing = hash_while_writing
        self._written: dict[str, WrittenFile] = {}  # writer thread: files written, by path
        self._durable: tuple[str, WrittenSave] | None = None  # the tag on_durable is called for
        self._jobs: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self._slots = [_Slot(node.for_slot(i) if node is not None else None)
                       for i in range(slots)]
        self._slot = 0  # the slot the current (or last) save copies into
        self._made = 0  # saves committed so far: each held snapshot's `order`
        self._memory_only = False  # the save under way is memory-only (`memory_only`)
        self._staged: list[tuple[Any, str, int]] = []  # (host copy, path, its tensor bytes)
        self._full: dict[str, BaseException] = {}  # writer thread: tags whose disk was full
        self._error: BaseException | None = None
        self._pin_piece = PIN_PIECE_BYTES
        self._arena_thread: threading.Thread | None = None
        self._loan: ArenaLoan | None = None  # slot 0's arena, lent to a restore's read
        self._device_copies = False  # the last save copied from the GPU (asynchronously)
        self._next_save: tuple[int, str] | None = None  # (step, meta) the marker will name
        self._serving: _Serving | None = None  # loads read the held copy (a memory rollback)
        self._served_files: dict[str, memoryview] = {}  # loads read these verified bytes
        # ... and the tensors they gave, by path: weak references to their storages
        self._served_users: dict[str, list[Any]] = {}
        self.copy_seconds = 0.0  # time of the last save's host copies (the blocked part)
        self._thread = threading.Thread(target=self._write_loop, name="ckpt-writer", daemon=True)
        self._thread.start()

    # -- DeepSpeed's interface (training thread) -----------------------------------------------

    # the current slot's arena, for callers that know one (benchmarks, tests)
    @property
    def _arena(self) -> mmap.mmap | None:
        return self._slots[self._slot].arena

    @property
    def _arena_pieces(self) -> list[int]:
        return self._slots[self._slot].pieces

    @_arena_pieces.setter
    def _arena_pieces(self, pieces: list[int]) -> None:
        self._slots[self._slot].pieces = pieces

    @property
    def _arena_used(self) -> int:
        return self._slots[self._slot].used

    @property
    def _buffers(self) -> dict[tuple[str, int], torch.Tensor]:
        return self._slots[self._slot].buffers

    @_buffers.setter
    def _buffers(self, buffers: dict[tuple[str, int], torch.Tensor]) -> None:
        self._slots[self._slot].buffers = buffers

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._memory_only and len(self._slots) > 1:
            free = [s for s in self._slots if not s.writing]  # never waits for the writer
        else:
            self.wait()  # durable saves are serialised: the previous one's buffers are free
            free = self._slots
        slot = min(free, key=lambda s: s.order)  # the older snapshot goes, the newer stays
        self._slot = self._slots.index(slot)
        # this save reuses the slot's buffers: its copy is going away, and its marker goes
        # before the first byte of this save lands in the arena
        self._forget(slot)
        self._raise_pending_error()
        self._staged = []
        self.copy_seconds = 0.0

    def save(self, state_dict: Any, path: str) -> None:
        t0 = time.perf_counter()
        counter = [0, 0]  # tensors copied, their bytes
        self._device_copies = False
        snapshot = self._to_host(state_dict, os.path.basename(path), counter)
        if self._device_copies:
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        self.copy_seconds += time.perf_counter() - t0
        # written only after commit(): a writer pickling on another thread meanwhile would
        # compete with these copies for the GIL and the memory bus
        self._staged.append((snapshot, path, counter[1]))

    def load(self, path: str, map_location: Any = None) -> Any:
        if self._serving is not None:
            return self._serve(self._serving, path, self._device_host_copy)
        key = os.path.normpath(os.path.abspath(path))
        served = self._served_files.get(key)
        if served is not None:
            return load_buffer(served, map_location, self._served_users.setdefault(key, []))
        self.wait()
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        slot, staged, self._staged = self._slots[self._slot], self._staged, []
        described, self._next_save = self._next_save, None
        step, meta = described if described is not None else (-1, "")
        durable = not self._memory_only
        if staged:
            self._made += 1
            slot.order = self._made
            slot.held = HeldSnapshot(info.tag, {os.path.normpath(path): snapshot
                                                for snapshot, path, _ in staged},
                                     step, meta, durable)
            if described is not None:
                self._mark_node_memory(slot, info.tag, step, meta, durable)
        if not durable:
            return True  # held only: nothing for the writer
        paths = [path for _, path, _ in staged]
        needed = sum(nbytes for _, _, nbytes in staged)
        slot.writing = True
        for snapshot, path, _ in staged:
            self._jobs.put(("write", snapshot, path))
        self._jobs.put(("commit", info.tag, (paths, needed, time.monotonic(), slot)))
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # each tensor is copied alone, as DeepSpeed's clone-before-save does

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if not self._memory_only:  # a memory-only snapshot has no folder
            os.makedirs(path, exist_ok=exist_ok)

    # -- ours -----------------------------------------------------------------------------------

    def reserve_pinned(self, nbytes: int, pin: bool = True) -> None:
        """Starts reserving a host arena of `nbytes` for the snapshots on a background thread,
        registered with CUDA (page-locked) when `pin`: an anonymous mapping registered a GiB
        at a time (one registration of 20 GB would hold CUDA's driver lock, and so the training
        thread or a restore's engine build, for ~10 s); not torch's pinned allocator, which
        would round 20 GB up to the next power of two."""
        if self._arena_thread is not None or nbytes <= 0 or (pin and not torch.cuda.is_available()):
            return

        def reserve() -> None:
            t0 = time.perf_counter()
            # one arena of `nbytes` per slot; seconds populating, seconds registering
            try:
                spent = [self._reserve(slot, nbytes, pin) for slot in self._slots]
            finally:
                if self._loan is not None:  # a load waiting on it goes on, pinned or not
                    self._loan.registered.set()
            # when it ended tells what it overlapped (a restore's build, the first steps)
            log.info("snapshot_arenas_reserved", bytes=nbytes, slots=len(self._slots),
                     pinned=[s.arena is not None and bool(s.pieces) for s in self._slots],
                     node_memory=[s.node is not None and s.arena is not None and
                                  s.node.owns(s.arena) for s in self._slots],
                     populate_s=round(sum(p for p, _ in spent), 3),
                     register_s=round(sum(r for _, r in spent), 3),
                     seconds=round(time.perf_counter() - t0, 3))
            if all(slot.arena is None for slot in self._slots):
                self._arena_thread = None  # per-tensor buffers; a later call may try again

        self._arena_thread = threading.Thread(target=reserve, name="ckpt-pin", daemon=True)
        self._arena_thread.start()

    def _reserve(self, slot: _Slot, nbytes: int, pin: bool) -> tuple[float, float]:
        """The reservation thread: `slot`'s arena (its adopted one, else a node memory file,
        else anonymous memory), registered with CUDA when `pin`, its pages faulted in first
        (`populate`). Returns the seconds populating and registering."""
        adopted = slot.arena if slot.adopted else None
        loan = self._loan if slot is self._slots[0] else None
        arena = adopted
        if loan is not None:  # a restore reads into it: registered once the read is over
            loan.finished.wait()
            arena = loan.arena
        if arena is None:
            arena = self._new_arena(slot, nbytes)
        address = ctypes.addressof(ctypes.c_char.from_buffer(arena))
        t0 = time.perf_counter()
        if pin:  # the page faults first, without CUDA's driver lock (after a read: its tail)
            populate(address, len(arena))
        t1 = time.perf_counter()
        # lent: one registration, since the load's copies may cross any piece's edge
        slot.piece = len(arena) if loan is not None and loan.arena is arena \
            else self._pin_piece
        pieces = register_in_pieces(address, len(arena), slot.piece) if pin else []
        spent = (t1 - t0, time.perf_counter() - t1)
        if loan is not None:
            loan.registered.set()
        if pieces is not None:
            slot.arena, slot.pieces = arena, pieces
        elif adopted is None:  # host memory short or locked-memory limit: pin per tensor
            slot.refused = True
            if slot.node is not None and slot.node.owns(arena):
                log.warning("node_memory_unavailable", reason="cudaHostRegister refused "
                            "the arena", slot=slot.node.slot, detail="per-tensor pinned "
                            "buffers: a crash restarts from disk")
                slot.node.remove()
        return spent

    def _new_arena(self, slot: _Slot, nbytes: int) -> mmap.mmap:
        """A fresh arena for `slot`: a node memory file where kept and there is room, else
        anonymous memory."""
        arena = slot.node.create(nbytes) if slot.node is not None else None
        return arena if arena is not None else anonymous_buffer(nbytes)

    def lend_arena(self, nbytes: int) -> ArenaLoan | None:
        """Before the arenas' reservation (`reserve_pinned` of the same `nbytes`): slot 0's
        arena for a restore's read (ArenaLoan), or None when that slot already has one (an
        adopted node memory arena holds a snapshot) or was lent before."""
        slot = self._slots[0]
        if self._loan is not None or self._arena_thread is not None or slot.arena is not None:
            return None
        self._loan = ArenaLoan(lambda: self._new_arena(slot, nbytes), nbytes)
        return self._loan

    def await_loan(self, timeout: float = 60.0) -> None:
        """Before the load from a lent arena: waits (at most `timeout`) for its registration,
        which follows the read by ~1 s, so that the load copies from page-locked memory."""
        loan = self._loan
        if loan is not None and loan.arena is not None and self._arena_thread is not None:
            loan.registered.wait(timeout)

    def end_loan(self, served: dict[str, memoryview]) -> bool:
        """After the load that `served` (the read's views into the lent arena, by path) fed:
        True, with the views released (no later access reads a snapshot's bytes as the
        checkpoint's), when no tensor the load made still uses their bytes. False, with the
        arena given up for per-tensor buffers, when one does (a loaded tensor kept the read's
        bytes instead of copying them to the device: the next save would overwrite it)."""
        loan, self._loan = self._loan, None
        users, self._served_users = self._served_users, {}
        if loan is None or loan.arena is None:
            return True
        gc.collect()  # loaded state dicts dropped in reference cycles
        kept = sorted(os.path.basename(path) for path in served
                      if any(not ref.expired() for ref in users.get(path, [])))
        if not kept:
            for view in served.values():
                try:
                    view.release()
                except BufferError:  # exported to no tensor (checked above), but still lent out
                    pass
            return True
        self.wait_arena()
        slot = self._slots[0]
        if slot.arena is loan.arena:  # registered and in use by tensors: left as it is
            slot.arena, slot.pieces, slot.refused = None, [], True
            if slot.node is not None:
                slot.node.remove()
        log.warning("restore_buffers_still_referenced", files=kept,
                    detail="the loaded state keeps host tensors of the read; snapshots use "
                           "buffers of their own (slower first save)")
        return False

    def wait_arena(self) -> None:
        """Blocks until the arena's reservation (and registration) has finished."""
        thread = self._arena_thread
        if thread is not None:
            thread.join()

    def adopt_node_memory(self, local_dir: str) -> tuple[int, str] | None:
        """At a restart, before any save: maps back this rank's arena from node memory when
        its marker is valid for this rank's job and layout (node_memory.py). The snapshot it
        names becomes `held()` (its files under `local_dir`/tag) and the arena this process's
        (registered with CUDA by the next `reserve_pinned`). Returns the held (step, meta
        JSON), or None when nothing usable is held."""
        adopted: list[tuple[_Slot, Any]] = []
        for slot in self._slots:
            if slot.node is None or slot.arena is not None:
                continue
            got = slot.node.adopt()
            if got is not None:
                slot.arena, slot.adopted = got[0], True
                adopted.append((slot, got[1]))
        for slot, held in sorted(adopted, key=lambda a: a[1].step):  # older first
            self._made += 1
            slot.order = self._made
            slot.held = HeldSnapshot(held.tag, {
                os.path.normpath(os.path.join(local_dir, held.tag, name)): state
                for name, state in held.files.items()}, held.step, held.meta, held.durable)
        newest = self.held()
        return None if newest is None else (newest.step, newest.meta)

    @property
    def arena_adopted(self) -> bool:
        """An arena was mapped back from node memory (`adopt_node_memory`)."""
        return any(slot.adopted for slot in self._slots)

    @property
    def slots(self) -> int:
        """Arena slots: 2 when memory-only snapshots are on."""
        return len(self._slots)

    def limit_slots(self, slots: int) -> None:
        """Before the first save and the arena's reservation: keeps only the first `slots`
        slots; the others' snapshots and node memory files go."""
        if self._arena_thread is not None:
            raise CheckpointError("internal: the arena slots are limited before their "
                                  "reservation, not while it runs")
        for slot in self._slots[slots:]:
            self._forget(slot)
            if slot.node is not None:
                slot.node.remove()
        self._slots = self._slots[:max(slots, 1)]
        self._slot = min(self._slot, len(self._slots) - 1)

    @contextmanager
    def memory_only(self) -> Iterator[None]:
        """While open, a save (DeepSpeed's `save_checkpoint`) is a memory-only snapshot: it
        is copied into the slot the writer is not reading from, never waiting for the writer
        (overwriting the older memory-only snapshot there), held in memory (and in node
        memory, with its marker) like any save, but no folder is made and nothing is written
        or handed to `on_durable`."""
        if len(self._slots) < 2:
            raise CheckpointError("memory-only snapshots need an engine with two arena slots")
        self._memory_only = True
        try:
            yield
        finally:
            self._memory_only = False

    def describe_next_save(self, step: int, meta: str) -> None:
        """The step and manifest metadata (JSON) of the save about to be made, for its node
        memory marker."""
        self._next_save = (step, meta)

    def forget_held(self, unless_tag: str | None = None, older_kept: int | None = None) -> None:
        """Forgets the held snapshots, and their node memory markers, but `unless_tag`'s and,
        when `older_kept` is given, those of a step below it (the restored state's past): a
        restore or rollback to another state abandons them (a restart must never come back
        to them)."""
        for slot in self._slots:
            held = slot.held
            if held is not None and (held.tag == unless_tag or (
                    older_kept is not None and 0 <= held.step < older_kept)):
                continue
            self._forget(slot)

    def _forget(self, slot: _Slot) -> None:
        slot.held, slot.order = None, -1
        if slot.node is not None:
            slot.node.forget()

    def release_node_memory(self) -> None:
        """A clean exit: this rank's node memory files go (nothing will restart from them);
        the mappings stay valid until the arenas are closed."""
        for slot in self._slots:
            if slot.node is not None:
                slot.node.remove()

    def _mark_node_memory(self, slot: _Slot, tag: str, step: int, meta: str,
                          durable: bool) -> None:
        """Writes the node memory marker of the save just committed into `slot`: its copies
        are complete (`save` synchronised the device after each file's), and every tensor lies
        in the arena (else no marker: a copy outside it dies with this process)."""
        if slot.node is None or slot.held is None or slot.arena is None:
            return
        slot.node.mark(tag, step, meta, {os.path.basename(p): state
                                         for p, state in slot.held.files.items()}, slot.arena,
                       durable)

    def written(self, tag: str) -> WrittenSave | None:
        """Inside `on_durable(tag, ...)` (writer thread): the hashes of the tag's files taken
        while they were written, and the writes' timings; None at any other time."""
        durable = self._durable
        return durable[1] if durable is not None and durable[0] == tag else None

    def held(self, tag: str | None = None) -> HeldSnapshot | None:
        """The newest held snapshot (of `tag`, when given), or None: none was made in this
        process, or later saves have begun reusing its slot."""
        found = [s for s in self._slots if s.held is not None
                 and (tag is None or s.held.tag == tag)]
        return max(found, key=lambda s: s.order).held if found else None

    def held_snapshots(self) -> list[HeldSnapshot]:
        """Every held snapshot, newest first (one per arena slot at most)."""
        return [s.held for s in sorted(self._slots, key=lambda s: -s.order)
                if s.held is not None]

    def held_skeleton(self, tag: str | None = None) -> dict[str, Any]:
        """Each file's name of the held snapshot (`held(tag)`) -> its state with every tensor
        a meta tensor (shape and dtype, no data): what another rank needs to list and check
        this rank's files."""
        held = self.held(tag)
        return {} if held is None else {os.path.basename(p): _skeleton(snap)
                                        for p, snap in held.files.items()}

    @contextmanager
    def serving_held(self, others: dict[str, Any], device: torch.device | None = None,
                     tag: str | None = None) -> Iterator[str]:
        """Yields a folder to give DeepSpeed's `load_checkpoint` as its load_dir: it holds the
        held tag's folder with an empty stand-in file for each of this rank's files and each
        name in `others` (the other ranks' `held_skeleton()`), so DeepSpeed's listing (glob)
        and existence checks see what the finished writes will show, whether or not they have
        finished. While open, loads are served from memory, never from a file: one of this
        rank's files gets a copy of what its save copied (new tensors and objects, as
        `torch.load` of the written file would give, so training never writes into the host
        buffers, which the writer thread may still be serialising); another rank's file gets
        its skeleton (DeepSpeed reads the first file of a listing only to check its
        `mp_world_size`; any use of its tensors fails loudly, since meta tensors hold no data).

        With a CUDA `device` that has room for a file's tensors, those of 1 MiB or more are
        copied straight onto it (from the pinned arena, at full bandwidth) rather than into new
        host memory that DeepSpeed would then copy up at pageable speed; the bytes are the
        same, and DeepSpeed copies every such tensor into its own device state anyway. Small
        ones (torch's non-fused Adam keeps its step counters on the CPU) stay on the host.
        `tag`: serve that held snapshot (default: the newest)."""
        held = self.held(tag)
        if held is None:
            raise CheckpointError("no checkpoint is held in host memory (a later save has begun "
                                  "reusing its buffers); roll back from the local tier")
        mine = {os.path.basename(p): snap for p, snap in held.files.items()}
        with tempfile.TemporaryDirectory(prefix="ds3d-memory-rollback-") as stand_ins:
            folder = Path(stand_ins) / held.tag
            folder.mkdir()
            for name in set(mine) | set(others):
                (folder / name).touch()
            self._serving = _Serving(str(folder), mine, others, device)
            try:
                yield stand_ins
            finally:
                self._serving = None

    @contextmanager
    def serving_buffers(self, files: dict[str, memoryview]) -> Iterator[None]:
        """While open, a load of one of `files` (absolute, normalised paths) is served from its
        bytes, already read and verified (read_ahead.py), instead of reading the file again;
        any other file is read from disk as usual."""
        self._served_files = dict(files)
        try:
            yield
        finally:
            self._served_files = {}

    def memory_slot_ready(self) -> bool:
        """A memory-only snapshot now would copy into a reserved arena: not into new pageable
        memory (a whole state's worth, at a third of the speed) while the arenas are still
        being reserved and pinned."""
        if self._arena_thread is None:
            return True
        free = [s for s in self._slots if not s.writing] or self._slots
        slot = min(free, key=lambda s: s.order)
        return slot.arena is not None or slot.refused

    def arena_ready(self) -> bool:
        """No arena is being reserved any more (or none was asked for)."""
        return self._arena_thread is None or all(slot.arena is not None or slot.refused
                                                  for slot in self._slots)

    def busy(self) -> bool:
        """Writes or a commit still queued or running."""
        return self._jobs.unfinished_tasks > 0

    def wait(self) -> None:
        """Blocks until every queued write and commit is done."""
        self._jobs.join()

    def close(self) -> None:
        self.wait()
        self._jobs.put(("stop", None, None))
        self._thread.join(timeout=60)
        for slot in self._slots:
            if slot.arena is not None:
                slot.buffers = {}  # the arena's views go first (mmap refuses to close under them)
                unregister_pieces(slot.pieces)
                slot.arena, slot.pieces = None, []
        self._raise_pending_error()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background checkpoint write failed: {err}") from err

    @staticmethod
    def _serve(serving: _Serving, path: str, copier: Callable[[torch.Tensor, torch.Tensor],
                                                                None]) -> Any:
        folder, name = os.path.split(os.path.normpath(path))
        if folder != serving.folder or (name not in serving.mine and name not in serving.others):
            raise CheckpointError(f"rollback from memory: {path} is not part of the held "
                                  f"checkpoint ({serving.folder})")
        if name not in serving.mine:
            return copy.deepcopy(serving.others[name])
        snapshot, device = serving.mine[name], serving.device
        if device is not None and device.type == "cuda":
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(snapshot))
            free, _total = torch.cuda.mem_get_info(device)
            if free < nbytes * 1.1 + (1 << 30):
                device = None  # no room for a second copy of this file: host memory
        return _fresh_copy(snapshot, device if device is not None and device.type == "cuda"
                           else None, copier)

    def _to_host(self, obj: Any, name: str, counter: list[int]) -> Any:
        if isinstance(obj, torch.Tensor):
            key = (name, counter[0])
            counter[0] += 1
            counter[1] += obj.numel() * obj.element_size()
            return self._copy(obj, key)
        if isinstance(obj, dict):
            return type(obj)((k, self._to_host(v, name, counter)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._to_host(v, name, counter) for v in obj]
        if isinstance(obj, torch.Size):  # a tuple, but DeepSpeed's tools call .numel() on it
            return obj
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._to_host(v, name, counter) for v in obj)
        return obj

    def _copy(self, t: torch.Tensor, key: tuple[str, int]) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._new_buffer(t)
            if buf is None:  # the pinned arena is still being registered: pageable, this once
                return t.to("cpu", copy=True)
            self._buffers[key] = buf
        self._device_copies |= t.device.type == "cuda"
        if t.device.type == "cuda":
            self._device_host_copy(buf, t)
        else:
            buf.copy_(t)
        return buf

    def _device_host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst.copy_(src)` between a GPU and host memory, asynchronous, as one copy per
        registered piece of the arena the host side lies in: a copy whose host range spans two
        registrations may be staged like pageable memory."""
        host = dst if dst.device.type == "cpu" else src
        ranges: list[tuple[int, int]] = []
        if host.is_contiguous() and dst.is_contiguous() and src.is_contiguous():
            nbytes = host.numel() * host.element_size()
            for slot in self._slots:  # the arena the host side lies in, if any
                if slot.arena is None or not slot.pieces:
                    continue
                offset = host.data_ptr() - slot.pieces[0]
                if 0 <= offset and offset + nbytes <= len(slot.arena):
                    ranges = piece_ranges(offset, nbytes, host.element_size(), slot.piece)
                    break
        if len(ranges) <= 1:
            dst.copy_(src, non_blocking=True)
            return
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        for i, j in ranges:
            flat_dst[i:j].copy_(flat_src[i:j], non_blocking=True)

    def _new_buffer(self, t: torch.Tensor) -> torch.Tensor | None:
        """A host buffer for `t`: carved from the arena when one was asked for (None while it
        is still being reserved), else (or when the estimate was short) one of its own."""
        slot = self._slots[self._slot]
        if slot.arena is not None:
            carved = self._carve(t)
            if carved is not None:
                return carved
        elif self._arena_thread is not None and not slot.refused:
            return None
        return torch.empty(t.shape, dtype=t.dtype, device="cpu",
                           pin_memory=t.device.type == "cuda")

    def _carve(self, t: torch.Tensor) -> torch.Tensor | None:
        """`t`'s buffer carved from the current slot's arena (None: no room left)."""
        slot = self._slots[self._slot]
        assert slot.arena is not None
        nbytes = t.numel() * t.element_size()
        start = -(-slot.used // 256) * 256  # aligned for every dtype and fast DMA
        if nbytes == 0 or start + nbytes > len(slot.arena):
            return None
        slot.used = start + nbytes
        # a tensor of its own storage over just these bytes: torch.save writes a view's whole
        # storage, and refuses one storage viewed as several dtypes
        return torch.frombuffer(slot.arena, dtype=t.dtype, count=t.numel(),
                                offset=start).view(t.shape)

    # -- writer thread --------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            kind, a, b = self._jobs.get()
            try:
                if kind == "stop":
                    return
                if kind == "write":
                    self._write(a, b)
                elif kind == "commit":
                    self._commit(a, *b[:3])
            except BaseException as e:  # surfaced on the next save or at close
                self._error = e
            finally:
                if kind == "commit":
                    b[3].writing = False  # its slot's buffers are free for any save again
                self._jobs.task_done()


    def _write(self, snapshot: Any, path: str) -> None:
        tag = _tag_of(path)
        if tag in self._full:
            return  # this save is abandoned already: its other files need no space
        try:
            self._written[path] = _atomic_save(
                snapshot, path, _stable_ranges(snapshot) if self.hash_while_writing else None)
        except BaseException as e:
            if not is_disk_full(e):
                raise
            self._full[tag] = e

    def _commit(self, tag: str, paths: list[str], needed: int, queued_at: float) -> None:
        written = {p: w for p in paths if (w := self._written.pop(p, None)) is not None}
        error = self._full.pop(_tag_of(paths[0]) if paths else tag, None)
        refused = False
        if error is None:
            if self.on_durable is None:
                return
            save = WrittenSave(written, queued_at, sum(w.write_s for w in written.values()))
            self._durable = (tag, save)
            try:
                self.on_durable(tag, paths)
                return
            except BaseException as e:
                # the files fitted, the save's bookkeeping (its upload marker) did not: failed
                # like a save that did not fit, not kept as an error that fails the next save
                if not is_disk_full(e):
                    raise
                error, refused = e, True
            finally:
                self._durable = None
        where = os.path.dirname(paths[0])
        # measured after the partial files went; but a save whose files all fitted is measured
        # before they go: the disk they filled is what refused its bookkeeping
        fitted = shortage(where, needed) if refused else None
        _discard(paths)
        short = fitted or shortage(where, needed)
        if self.on_failed is None:
            raise RuntimeError(short.message(f"checkpoint {tag}")) from error
        self.on_failed(tag, paths, short, str(error))


def _fresh_copy(obj: Any, device: torch.device | None = None,
                copier: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> Any:
    """What `torch.load` of a snapshot's file gives: the same structure, values and dtypes, in
    new tensors and objects that share nothing with the snapshot (tensors of 1 MiB or more on
    `device` when one is given)."""
    if isinstance(obj, torch.Tensor):
        if device is not None and obj.numel() * obj.element_size() >= 1 << 20:
            if copier is None:
                return obj.to(device, copy=True, non_blocking=True)
            out = torch.empty_like(obj, device=device)
            copier(out, obj)
            return out
        return obj.clone()
    if isinstance(obj, dict):
        return type(obj)((k, _fresh_copy(v, device, copier)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_fresh_copy(v, device, copier) for v in obj]
    if isinstance(obj, torch.Size):
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_fresh_copy(v, device, copier) for v in obj)
    return copy.deepcopy(obj)


def _skeleton(obj: Any) -> Any:
    """`obj` with every tensor replaced by a meta tensor of its shape and dtype."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        return type(obj)((k, _skeleton(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_skeleton(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size) and not hasattr(obj, "_fields"):
        return tuple(_skeleton(v) for v in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return [t for v in obj for t in _tensors(v)]
    return []


def _tag_of(path: str) -> str:
    """`<local_dir>/<tag>/<file>` -> the tag folder (DeepSpeed writes a tag's files there)."""
    return os.path.dirname(os.path.abspath(path))


def _tmp_name(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


def _stable_ranges(obj: Any) -> list[tuple[int, int]]:
    """(address, bytes) of the storages of every tensor in a snapshot: host memory no one
    writes while the writer thread serialises it (the next durable save's `create` waits for
    it, a memory-only snapshot copies into the other slot)."""
    out = []
    for t in _tensors(obj):
        if t.device.type == "cpu":
            storage = t.untyped_storage()
            out.append((storage.data_ptr(), storage.nbytes()))
    return out


def _atomic_save(obj: Any, path: str, stable: list[tuple[int, int]] | None) -> WrittenFile:
    """Writes `obj` into `path` (temp file, fsync, rename), hashing its bytes on the way
    unless `stable` is None (then the file has no digest and is hashed by reading it back)."""
    tmp = _tmp_name(path)
    t0 = time.perf_counter()
    try:
        with open(tmp, "wb") as fh:
            if stable is None:
                torch.save(obj, fh)
                fh.flush()
                os.fsync(fh.fileno())
                digest, waited = None, 0.0
            else:
                with HashingWriter(fh, stable) as hashing:
                    torch.save(obj, hashing)
                    fh.flush()
                    os.fsync(fh.fileno())  # the hashes trailing the writes run meanwhile
                    t_wait = time.perf_counter()
                    digest = hashing.digest()
                    waited = time.perf_counter() - t_wait
                    if hashing.unknown is not None:
                        log.warning("checkpoint_hash_read_back", path=path,
                                    cause=hashing.unknown)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a partial file would only take space
        raise
    if digest is not None and os.stat(path).st_size != digest.size:
        log.warning("checkpoint_hash_read_back", path=path, cause=f"the file is not the "
                    f"{digest.size} bytes written into it")
        digest = None
    return WrittenFile(digest, time.perf_counter() - t0, waited)


def _discard(paths: list[str]) -> None:
    """Removes every file of an abandoned save (and its folder, once empty)."""
    folders = set()
    for path in paths:
        for p in (path, _tmp_name(path)):
            Path(p).unlink(missing_ok=True)
        folders.add(os.path.dirname(path))
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            pass  # not empty (another rank's files, on a shared disk) or gone
