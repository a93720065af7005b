"""Fixtures shared by unit test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ds3d.daemon.ports import hold_port


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
