"""The daemon's reading of sampled step splits: stragglers, bubble and reduction diagnoses, the
per-rank and per-stage series; and the trainer's split arithmetic."""

from prometheus_client import generate_latest

from ds3d.daemon.metrics import Metrics
from ds3d.daemon.reports import Observation
from ds3d.daemon.step_analysis import StepAnalysis
from ds3d.trainer.step_timing import StepTimer, theoretical_bubble


def obs(*records):
    o = Observation()
    o.records = list(records)
    return o


def beat(rank, compute, stage=0, step=4, **split):
    return {"kind": "heartbeat", "rank": rank, "step": step, "stage": stage, "node": "n1",
            "split": {"compute_s": compute, "forward": compute / 3, **split}}


def drain(analysis, o):
    out, f = [], analysis.check(None, o, None)
    while f is not None:
        out.append(f)
        f = analysis.check(None, obs(), None)
    return out


def test_the_slow_rank_is_named_once_with_how_much_slower():
    a = StepAnalysis()
    found = drain(a, obs(*(beat(r, 0.9 if r == 3 else 0.3) for r in range(4))))
    assert [f.cause for f in found] == ["straggler"]
    f = found[0]
    assert f.kind == "diagnosis" and not f.restart and f.rank == 3 and f.step == 4
    assert "rank 3" in f.message and "3.0x longer" in f.message and "node n1" in f.message
    assert f.detail["slow_ranks"] == [3]
    # the same straggler on the next sampled step: no second event within the cooldown
    assert drain(a, obs(*(beat(r, 0.9 if r == 3 else 0.3, step=6) for r in range(4)))) == []


def test_equal_ranks_and_small_gaps_are_not_stragglers():
    a = StepAnalysis()
    assert drain(a, obs(*(beat(r, 0.30 + 0.01 * r) for r in range(4)))) == []
    b = StepAnalysis()  # 2x slower but only 20 ms: noise on a tiny model, not a straggler
    assert drain(b, obs(beat(0, 0.02), beat(1, 0.02), beat(2, 0.04))) == []


def test_bubble_diagnosis_says_which_fix_applies():
    a = StepAnalysis()
    many_micro = drain(a, obs(beat(0, 1, bubble=0.30, bubble_theoretical=0.05),
                              beat(1, 1, stage=1, bubble=0.28, bubble_theoretical=0.05)))
    assert [f.cause for f in many_micro] == ["pipeline_bubble"]
    assert "29%" in many_micro[0].message and "rebalance" in many_micro[0].message
    b = StepAnalysis()
    few_micro = drain(b, obs(beat(0, 1, bubble=0.35, bubble_theoretical=0.33)))
    assert "micro-batches" in few_micro[0].message
    c = StepAnalysis()
    assert drain(c, obs(beat(0, 1, bubble=0.10, bubble_theoretical=0.05))) == []


def test_slow_reduction_is_diagnosed_against_forward():
    a = StepAnalysis()
    found = drain(a, obs(beat(0, 1, reduce_to_forward=0.45), beat(1, 1, reduce_to_forward=0.2)))
    assert [f.cause for f in found] == ["dp_reduce_slow"] and "45%" in found[0].message


def test_series_follow_the_current_group():
    m, a = Metrics(), StepAnalysis()
    a.check(None, obs(*(beat(r, 0.3, stage=r // 2, p2p_wait=0.1 * r) for r in range(4))), None)
    a.export(m, "j")
    text = generate_latest(m.registry).decode()
    assert text.count("ds3d_rank_step_seconds{") == 4
    assert 'ds3d_step_time_split_seconds{job="j",part="p2p_wait",stage="1"} 0.30000000000000004' \
        in text  # the slowest rank of stage 1
    # the group restarts with two ranks (a node lost): the old ranks' series go away
    a.check(None, obs({"kind": "start", "rank": 0}, beat(0, 0.3), beat(1, 0.3)), None)
    a.export(m, "j")
    assert generate_latest(m.registry).decode().count("ds3d_rank_step_seconds{") == 2


def test_split_arithmetic_of_a_sampled_step():
    assert theoretical_bubble(4, 8) == 3 / 11 and theoretical_bubble(1, 8) == 0
    t = StepTimer(engine=object(), device=__import__("torch").device("cpu"), interval=10)
    assert [s for s in range(1, 31) if t.sampled(s)] == [2, 10, 20, 30]
    t.begin(2)
    t.parts.update(forward=0.2, backward=0.4, optimizer=0.1, p2p_wait=0.2, dp_reduce=0.05,
                   data=0.05)
    out = t.end(1.0, stages=2, micro_batches=4)
    assert out["compute_s"] == 0.7
    assert out["bubble"] == round(1 - 0.6 / 0.8, 4) and out["bubble_theoretical"] == 0.2
    assert out["reduce_to_forward"] == 0.25
    t.begin(3)
    assert t.end(1.0, 2, 4) is None  # not sampled: nothing measured
