"""The agents of one attempt meet before torch elastic's rendezvous.

Why: torch elastic's dynamic rendezvous closes a round `last_call_timeout` (5 s, launcher.py)
after its `min_nodes` have joined. An agent's start (Python, torch, its forkserver) takes seconds
and more on a loaded node, so in a job with `min_nodes` < `nnodes` an agent that comes more than
5 s after the others misses the first round: the group forms without it and trains on fewer nodes
until the next restart (seen in CI: a planned restart that takes a lost node back formed again
without it). A longer last call would delay every re-rendezvous after a real node loss by as
much.

So each agent first says it has arrived, on the rendezvous's own store (c10d's TCPStore, or
etcd), and waits until every node the head started this attempt has arrived, at most
`ARRIVAL_WAIT_S`; then all of them enter the rendezvous within a poll of each other. The head's
agent alone knows how many nodes were started (its spec's `expected_nodes`) and publishes it;
the others wait for that too. A node that never comes costs the wait once, at the start of an
attempt, and the rendezvous then forms under `min_nodes` as before. Re-rendezvous inside a
running attempt (after a node loss) does not pass here.
"""

from __future__ import annotations

import time
from typing import Any

ARRIVAL_WAIT_S = 60.0
POLL_S = 0.2


def _keys(run_id: str) -> tuple[str, str]:
    prefix = f"ds3d/arrivals/{run_id}"
    return f"{prefix}/expected", f"{prefix}/arrived"


def rendezvous_store(backend: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int,
                     configs: dict[str, Any]) -> Any:
    """A client of the store torch elastic's rendezvous of this attempt uses (built the way
    torch builds it: c10d's TCPStore client, or the etcd store)."""
    import importlib

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes, **configs)
    name = "c10d" if backend == "c10d" else "etcd"
    module = importlib.import_module(
        f"torch.distributed.elastic.rendezvous.{name}_rendezvous_backend")
    _, store = module.create_backend(params)
    return store


def meet(store: Any, run_id: str, expected_nodes: int | None,
         wait_s: float = ARRIVAL_WAIT_S) -> tuple[int, int | None, float]:
    """Records this agent's arrival and waits until `expected` agents have arrived (the head
    passes `expected_nodes` and publishes it; the others pass None and read it), or `wait_s`.
    Returns (arrived, expected or None if never published, seconds waited)."""
    expected_key, arrived_key = _keys(run_id)
    if expected_nodes is not None:
        store.set(expected_key, str(expected_nodes))
    started = time.monotonic()
    arrived = int(store.add(arrived_key, 1))
    expected = expected_nodes
    while True:
        if expected is None and store.check([expected_key]):
            expected = int(store.get(expected_key))
        if expected is not None and arrived >= expected:
            break
        if time.monotonic() - started >= wait_s:
            break
        time.sleep(POLL_S)
        arrived = int(store.add(arrived_key, 0))
    return arrived, expected, time.monotonic() - started
