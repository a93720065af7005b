"""The time each rank spends inside its tensor-parallel all-reduces (trainer/tensor_parallel.py
`TP_WAIT`, reported as a sampled step's `tp_wait`): two real gloo ranks of one TP group, one of
them slow before the all-reduce (as `inject slow` makes a rank's first layer): the fast rank
waits for it there, the slow one does not. This is what the straggler diagnosis tells the slow
rank of a TP group by (daemon/step_analysis.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

SLOW_S = 0.3


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    from ds3d.trainer.step_timing import StepTimer
    from ds3d.trainer.tensor_parallel import TPGroup, copy_to_tp, reduce_from_tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    tp = TPGroup(dist.new_group([0, 1]), rank, 2)
    timer = StepTimer(object(), torch.device("cpu"), interval=1)
    x = torch.ones(64, requires_grad=True)
    for step in (2, 3):  # both sampled (interval 1)
        timer.begin(step)
        if rank == 1:
            time.sleep(SLOW_S)  # a slow device, before its all-reduce
        y = reduce_from_tp(copy_to_tp(x, tp) * 2.0, tp)
        y.sum().backward()
        split = timer.end(1.0, 1, 1)
        out.put((rank, step, split["tp_wait"] if split else None))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_fast_rank_waits_for_the_slow_one_inside_the_tp_all_reduce():
    from ds3d.daemon.ports import hold_port

    with hold_port() as held:
        port = held.port
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {(r, s): w for r, s, w in (out.get(timeout=90) for _ in range(4))}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got[(0, 2)] >= SLOW_S * 0.8, got  # the fast rank waited for the slow one
    assert got[(1, 2)] < SLOW_S * 0.5, got   # the slow one found its peer waiting
    assert got[(0, 3)] >= SLOW_S * 0.8 and got[(1, 3)] < SLOW_S * 0.5, got


def test_nothing_timed_is_reported_as_not_measured():
    """TP = 1, or a compiled model (its collectives run inside the graph, untimed): `tp_wait`
    is left out of the split, so the straggler analysis does not read 0 s as 'waits for no
    one'."""
    from ds3d.trainer.tensor_parallel import TP_WAIT

    TP_WAIT.start()
    assert TP_WAIT.stop() is None
