"""Fixtures shared by unit test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ds3d.daemon.ports import hold_port
from ds3d.daemon.store import Store


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone: the collectives of the checkpoint code
    (agreement on a step, on verified hashes) run for real with world size 1."""
    # the store's port held while its TCPStore binds it (with SO_REUSEADDR): no parallel
    # test's bind(0) can take it in between (daemon/ports.py)
    with hold_port() as held:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{held.port}", rank=0,
                                world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def job_store(tmp_path) -> Iterator[Store]:
    """A daemon state store holding one PENDING job, "j"."""
    s = Store(tmp_path / "state.db")
    s.create_job("j", "{}", "n", str(tmp_path / "run"))
    yield s
    s.close()
