"""Who the hang diagnosis suspects: ranks that did not answer first, then ranks whose stack shows
no wait on a peer. Every worker's stack ends in torch elastic's @record wrapper
(torch/distributed/elastic/...): that frame is not a wait, or no rank would ever be suspected."""

from ds3d.daemon.stacks import StackDump, suspects

RECORD = "    wrapper (torch/distributed/elastic/multiprocessing/errors/__init__.py:355)\n"
WAITS = "    all_reduce (torch/distributed/distributed_c10d.py:2810)\n"
P2P = "    recv (deepspeed/runtime/pipe/p2p.py:80)\n"
BUSY = "    forward (ds3d/trainer/model.py:90)\n    sleep (ds3d/trainer/faults.py:120)\n"


def test_a_rank_busy_in_its_own_code_is_suspected_despite_the_record_frame():
    dump = StackDump(stacks={0: WAITS + RECORD, 1: BUSY + RECORD, 2: P2P + RECORD},
                     method="py-spy")
    assert suspects(dump) == [1]


def test_ranks_that_did_not_answer_come_first():
    dump = StackDump(stacks={0: WAITS + RECORD, 2: BUSY + RECORD}, method="py-spy",
                     unanswered={1: {"pid": 7, "host": "h", "why": "stopped"}})
    assert suspects(dump) == [1, 2]
