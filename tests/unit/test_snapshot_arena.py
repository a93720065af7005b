"""The snapshot engine's host arena: buffers carved from one reservation are written as tensors
of their own (torch.save writes a view's whole storage and refuses one storage viewed as several
dtypes), are reused by the next save, and a short arena falls back to buffers of their own.
On CPU the arena is not page-locked; the carving and the files are the same as on a GPU."""

import os

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine


def _state(scale: float) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) * scale,
            "h": (torch.ones(7, 3) * scale).to(torch.bfloat16),
            "step": torch.tensor(int(scale)), "empty": torch.zeros(0),
            "groups": [torch.full((5,), scale, dtype=torch.float64)], "lr": 0.1}


def _save(engine, path, state, tag):
    info = CheckpointCommitInfo(tag=tag, save_dir=os.path.dirname(path), save_latest=False)
    engine.create(info)
    engine.save(state, path)
    engine.commit(info)
    engine.wait()


def _in_arena(engine) -> dict[tuple[int, ...], bool]:
    """shape of each snapshot buffer -> whether its bytes lie inside the engine's arena."""
    probe = torch.frombuffer(engine._arena, dtype=torch.uint8, count=1)
    start, end = probe.data_ptr(), probe.data_ptr() + len(engine._arena)
    del probe  # an exported pointer into the mmap would keep it from closing
    out = {}
    for buf in engine._buffers.values():
        first, last = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        assert (start <= first and last <= end) or last <= start or first >= end, \
            "a buffer straddles the arena's edge"
        out[tuple(buf.shape)] = start <= first < end
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], list):
            assert all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True)), k
        else:
            assert a[k] == b[k], k


def test_arena_buffers_are_written_alone_and_reused(tmp_path):
    engine = SnapshotCheckpointEngine()
    engine.reserve_pinned(1 << 20, pin=False)
    engine._arena_thread.join()
    assert engine.arena_ready() and engine._arena is not None
    path = str(tmp_path / "a.pt")
    _save(engine, path, _state(1.0), "t1")
    _same(torch.load(path, weights_only=False), _state(1.0))
    assert os.path.getsize(path) < 64 << 10, "the file holds the tensors, not the 1 MiB arena"
    used, ptrs = engine._arena_used, {k: b.data_ptr() for k, b in engine._buffers.items()}
    assert 0 < used < 1 << 20
    _save(engine, path, _state(3.0), "t2")  # the next save copies into the same buffers
    _same(torch.load(path, weights_only=False), _state(3.0))
    assert engine._arena_used == used
    assert {k: b.data_ptr() for k, b in engine._buffers.items()} == ptrs
    # every buffer was carved from the arena but the empty tensor's (nothing to carve)
    assert _in_arena(engine) == {(1000,): True, (7, 3): True, (): True, (5,): True, (0,): False}
    engine.close()


def test_a_short_arena_gives_tensors_buffers_of_their_own(tmp_path):
    engine = SnapshotCheckpointEngine()
    engine.reserve_pinned(2048, pin=False)  # room for the small tensors, not for "w"
    engine._arena_thread.join()
    path = str(tmp_path / "b.pt")
    _save(engine, path, _state(2.0), "t1")
    _same(torch.load(path, weights_only=False), _state(2.0))
    # "w" (4000 bytes) did not fit: its buffer is memory of its own, outside the arena, while
    # the small tensors were still carved from it; the empty tensor needs no buffer from it
    assert _in_arena(engine) == {(1000,): False, (7, 3): True, (): True, (5,): True, (0,): False}
    engine.close()


def test_piece_ranges_split_a_tensor_where_it_crosses_a_registration():
    from ds3d.checkpoints.host_memory import piece_ranges

    assert piece_ranges(0, 400, 4, piece=1024) == [(0, 100)]
    assert piece_ranges(768, 512, 4, piece=1024) == [(0, 64), (64, 128)]
    assert piece_ranges(1024, 2048, 2, piece=1024) == [(0, 512), (512, 1024)]
    assert piece_ranges(256, 3000, 8, piece=1024) == [(0, 96), (96, 224), (224, 352), (352, 375)]
    assert piece_ranges(512, 0, 4, piece=1024) == []


def test_a_copy_into_an_arena_registered_in_pieces_lands_whole(tmp_path):
    """The arena is page-locked a piece at a time on a GPU; a copy into a buffer that crosses
    pieces is split at their edges. Here the pieces are 1 KiB (not registered: CPU), and every
    carved buffer must still receive each of its source's bytes at the right place."""
    engine = SnapshotCheckpointEngine()
    engine.reserve_pinned(64 << 10, pin=False)
    engine._arena_thread.join()
    probe = torch.frombuffer(engine._arena, dtype=torch.uint8, count=1)
    engine._arena_pieces, engine._slots[0].piece = [probe.data_ptr()], 1024
    del probe
    sources = [torch.randn(1000), torch.randn(300).to(torch.bfloat16), torch.randn(7, 129),
               torch.arange(2000, dtype=torch.int64)]
    for src in sources:
        dst = engine._carve(src)
        assert dst is not None
        engine._device_host_copy(dst, src)
        assert torch.equal(dst, src)
    assert engine._arena_used > 3 * 1024  # the buffers did cross several pieces
    engine._arena_pieces = []  # nothing was registered: nothing to unregister
    engine._buffers = {}
    engine.close()
