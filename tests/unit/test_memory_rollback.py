"""The snapshot engine serves its newest save from host memory (an in-process rollback): what a
load gets equals what `torch.load` of the written file gives, shares nothing with the host
buffers, and nothing is served once a later save has begun reusing them."""

import glob
import os

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds3d.checkpoints.errors import CheckpointError
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine


def _state(scale: float) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) * scale,
            "h": (torch.ones(7, 3) * scale).to(torch.bfloat16),
            "step": torch.tensor(int(scale)), "groups": [{"lr": 0.1 * scale, "params": [0, 1]}],
            "size": torch.Size([2, 3]), "pair": (torch.ones(2) * scale, "x")}


def _info(tag: str, folder) -> CheckpointCommitInfo:
    return CheckpointCommitInfo(tag=tag, save_dir=str(folder), save_latest=False)


def _save(engine, folder, tag, states: dict[str, dict]) -> list[str]:
    """One DeepSpeed-style save of `states` (file name -> state) into folder/tag/."""
    engine.create(_info(tag, folder))
    os.makedirs(folder / tag, exist_ok=True)
    paths = []
    for name, state in states.items():
        paths.append(str(folder / tag / name))
        engine.save(state, paths[-1])
    engine.commit(_info(tag, folder))
    return paths


def _equal(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, list | tuple) and not isinstance(a, torch.Size):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal(x, y)
    else:
        assert a == b


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_held_save_is_served_as_the_file_would_be_and_shares_nothing(tmp_path):
    engine = SnapshotCheckpointEngine()
    try:
        (path,) = _save(engine, tmp_path, "global_step4", {"mp_rank_00_model_states.pt":
                                                           _state(4.0)})
        engine.wait()
        from_disk = torch.load(path, weights_only=False)
        with engine.serving_held({}) as folder:
            stand_in = os.path.join(folder, "global_step4", "mp_rank_00_model_states.pt")
            from_memory = engine.load(stand_in, map_location="cpu")
            again = engine.load(stand_in, map_location="cpu")
        assert not os.path.exists(folder)  # the stand-ins are gone after the load
        _equal(from_memory, from_disk)
        buffers = {b.untyped_storage().data_ptr() for b in engine._buffers.values()}
        served = _tensors(from_memory)
        assert served and not {t.untyped_storage().data_ptr() for t in served} & buffers
        for t in served:  # training writes into what it loaded: the held copy stays as saved
            t.add_(1)
        _equal(again, from_disk)
        assert from_memory["groups"] is not again["groups"]  # objects are copies too
        assert engine.load(path)["w"].equal(from_disk["w"])  # outside: the file, as before
    finally:
        engine.close()


def test_nothing_is_held_once_a_later_save_begins(tmp_path):
    engine = SnapshotCheckpointEngine()
    try:
        _save(engine, tmp_path, "global_step2", {"a.pt": _state(2.0)})
        assert engine.held() is not None and engine.held().tag == "global_step2"
        engine.create(_info("global_step4", tmp_path))  # the next save starts reusing buffers
        assert engine.held() is None and engine.held_skeleton() == {}
        with pytest.raises(CheckpointError, match="roll back from the local tier"):
            with engine.serving_held({}):
                pass
        (tmp_path / "global_step4").mkdir()
        engine.save(_state(4.0), str(tmp_path / "global_step4" / "a.pt"))
        engine.commit(_info("global_step4", tmp_path))
        assert engine.held().tag == "global_step4"
    finally:
        engine.close()


def test_stand_ins_list_every_ranks_files_and_another_ranks_file_has_no_data(tmp_path):
    """DeepSpeed finds a tag's files with glob, checks they exist, and reads the first of a
    listing to check its mp_world_size: the stand-in folder lists this rank's files and the
    other ranks' (their skeletons) before any is written; another rank's file carries its
    keys and plain values, and its tensors hold no data, so using them fails loudly."""
    other = SnapshotCheckpointEngine()
    engine = SnapshotCheckpointEngine()
    try:
        _save(other, tmp_path, "global_step6", {"mp_rank_00_model_states.pt":
                                                {**_state(5.0), "mp_world_size": 2}})
        _save(engine, tmp_path, "global_step6", {"mp_rank_01_model_states.pt":
                                                 {**_state(6.0), "mp_world_size": 2}})
        peers = other.held_skeleton()
        assert peers["mp_rank_00_model_states.pt"]["w"].device.type == "meta"
        with engine.serving_held(peers) as folder:
            tag = os.path.join(folder, "global_step6")
            listed = sorted(glob.glob(os.path.join(tag, "mp_rank_*_model_states.pt")))
            assert [os.path.basename(p) for p in listed] == ["mp_rank_00_model_states.pt",
                                                             "mp_rank_01_model_states.pt"]
            first = engine.load(listed[0])
            assert first["mp_world_size"] == 2 and first["w"].shape == (1000,)
            with pytest.raises(NotImplementedError, match="meta"):
                torch.zeros(1000).copy_(first["w"])
            _equal(engine.load(listed[1]), {**_state(6.0), "mp_world_size": 2})
            with pytest.raises(CheckpointError, match="not part of the held checkpoint"):
                engine.load(os.path.join(tag, "zero_pp_rank_0_mp_rank_01_optim_states.pt"))
            with pytest.raises(CheckpointError, match="not part of the held checkpoint"):
                engine.load(str(tmp_path / "global_step6" / "mp_rank_01_model_states.pt"))
    finally:
        engine.close()
        other.close()
