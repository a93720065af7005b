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


def slow3(step, slow=0.9):
    return obs(*(beat(r, slow if r == 3 else 0.3, step=step) for r in range(4)))


def test_the_slow_rank_is_named_once_with_how_much_slower():
    a = StepAnalysis()
    assert drain(a, slow3(4)) == []  # one sampled step: not yet
    found = drain(a, slow3(6))
    assert [f.cause for f in found] == ["straggler"]
    f = found[0]
    assert f.kind == "diagnosis" and not f.restart and f.rank == 3 and f.step == 6
    assert "rank 3" in f.message and "3.0x longer" in f.message and "node n1" in f.message
    assert "slow on 2 sampled steps in a row" in f.message
    assert f.detail["slow_ranks"] == [3] and f.detail["sampled_steps"] == 2
    # the same straggler on the next sampled step: no second event within the cooldown
    assert drain(a, slow3(8)) == []


def test_one_slow_sample_is_noise_not_a_straggler():
    """CI, 3 tests on 2 cores: rank 3 computed > 1.5x the median on the job's first sampled
    step and was named a straggler 5 steps before any slowdown. A rank must be the slow one on
    consecutive sampled steps; a sample that names no one, or another rank, or a new group,
    starts the count again."""
    a = StepAnalysis()
    assert drain(a, slow3(2)) == []
    assert drain(a, slow3(4, slow=0.3)) == []  # no one slow
    assert drain(a, slow3(6)) == []
    assert drain(a, obs(*(beat(r, 0.9 if r == 1 else 0.3, step=8) for r in range(4)))) == []
    assert drain(a, slow3(10)) == []
    a.check(None, obs({"kind": "start", "rank": 0}), None)  # a restarted group
    assert drain(a, slow3(12)) == []
    # the same step read again (another rank's heartbeat of it in a later poll) is one sample
    assert drain(a, obs(beat(0, 0.3, step=12))) == []
    assert [f.rank for f in drain(a, slow3(14))] == [3]


def test_equal_ranks_and_small_gaps_are_not_stragglers():
    a = StepAnalysis()
    assert drain(a, obs(*(beat(r, 0.30 + 0.01 * r) for r in range(4)))) == []
    b = StepAnalysis()  # 2x slower but only 20 ms: noise on a tiny model, not a straggler
    assert drain(b, obs(beat(0, 0.02), beat(1, 0.02), beat(2, 0.04))) == []


def test_nothing_to_compare_with_is_no_diagnosis_and_no_error():
    """Every other rank's compute all spent waiting in TP all-reduces (own compute 0): the
    ratio to their median had no meaning (a ZeroDivisionError in the supervisor's tick)."""
    a = StepAnalysis()
    beats = [beat(0, 0.5, tp_wait=0.0), beat(1, 0.4, tp_wait=0.45), beat(2, 0.4, tp_wait=0.4)]
    assert drain(a, obs(*beats)) == []


def twice_in_a_row(analysis, *beats):
    """The beats on sampled steps 4 and 6: the faults of the second (a diagnosis needs what
    it says on 2 sampled steps in a row)."""
    assert drain(analysis, obs(*({**b, "step": 4} for b in beats))) == []
    return drain(analysis, obs(*({**b, "step": 6} for b in beats)))


def test_bubble_diagnosis_says_which_fix_applies():
    a = StepAnalysis()
    many_micro = twice_in_a_row(a, beat(0, 1, bubble=0.30, bubble_theoretical=0.05),
                                beat(1, 1, stage=1, bubble=0.28, bubble_theoretical=0.05))
    assert [f.cause for f in many_micro] == ["pipeline_bubble"]
    assert "29%" in many_micro[0].message and "rebalance" in many_micro[0].message
    assert many_micro[0].detail["sampled_steps"] == 2
    b = StepAnalysis()
    few_micro = twice_in_a_row(b, beat(0, 1, bubble=0.35, bubble_theoretical=0.33))
    assert "micro-batches" in few_micro[0].message
    c = StepAnalysis()
    assert twice_in_a_row(c, beat(0, 1, bubble=0.10, bubble_theoretical=0.05)) == []
    # one noisy sample (the first, still compiling) between good ones: no diagnosis
    d = StepAnalysis()
    assert drain(d, obs(beat(0, 1, step=2, bubble=0.40, bubble_theoretical=0.05))) == []
    assert drain(d, obs(beat(0, 1, step=4, bubble=0.10, bubble_theoretical=0.05))) == []
    assert drain(d, obs(beat(0, 1, step=6, bubble=0.40, bubble_theoretical=0.05))) == []


def test_slow_reduction_is_diagnosed_against_forward():
    a = StepAnalysis()
    found = twice_in_a_row(a, beat(0, 1, reduce_to_forward=0.45),
                           beat(1, 1, reduce_to_forward=0.2))
    assert [f.cause for f in found] == ["dp_reduce_slow"] and "45%" in found[0].message
    b = StepAnalysis()
    assert drain(b, obs(beat(0, 1, step=2, reduce_to_forward=0.45))) == []
    assert drain(b, obs(beat(0, 1, step=4, reduce_to_forward=0.1))) == []
    assert drain(b, obs(beat(0, 1, step=6, reduce_to_forward=0.45))) == []


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


def tp_job(tp):
    from types import SimpleNamespace

    return SimpleNamespace(config_json=f'{{"parallel": {{"tp": {tp}, "pp": 2}}}}')


def probe_split(slow_rank, tp_wait=True, step=4):
    """The probe's numbers (tiny, TP 2 x PP 2): the slow rank and its TP peer both compute
    ~0.53 s, the peer a little more (it waits ~0.215 s inside its all-reduces), stage 0
    ~0.31 s."""
    compute = {0: 0.3100, 1: 0.3120, slow_rank: 0.5276, 5 - slow_rank: 0.5290}
    waits = {0: 0.004, 1: 0.005, 2: 0.003, 3: 0.003}
    waits[5 - slow_rank] = 0.2150  # the peer of 2 is 3 and of 3 is 2
    return [beat(r, compute[r], stage=r // 2, step=step,
                 **({"tp_wait": waits[r]} if tp_wait else {})) for r in range(4)]


def twice(analysis, job, slow_rank, tp_wait=True):
    """The probe's split on two sampled steps in a row (a straggler persists): the faults."""
    assert drain_job(analysis, job, obs(*probe_split(slow_rank, tp_wait, step=4))) == []
    return drain_job(analysis, job, obs(*probe_split(slow_rank, tp_wait, step=6)))


def test_the_slow_rank_of_a_tp_group_is_the_one_that_waits_least_in_its_all_reduces():
    """Probe of 12-06: `inject slow --rank 2` named rank 3, `--rank 3` named rank 2 (compute
    0.529 vs 0.5276 s: its TP peer waits for it inside forward). With each rank's time inside
    the TP all-reduces the slow one is named, whichever it is, alone."""
    for slow_rank in (2, 3):
        a = StepAnalysis()
        [f] = twice(a, tp_job(2), slow_rank)
        assert f.cause == "straggler" and f.rank == slow_rank, f.message
        assert f.detail["slow_ranks"] == [slow_rank], f.message
        peer = 5 - slow_rank
        assert f"straggler: rank {slow_rank} (stage 1 on node n1)" in f.message
        assert f"its tensor-parallel peer rank {peer} waits for it inside the all-reduces " \
               f"(0.215 s vs its 0.003 s)" in f.message, f.message
        assert "also slow" not in f.message
        # against the other ranks' own compute, not the mean of a fast and a slow one
        assert abs(f.detail["median_s"] - 0.307) < 1e-6, f.detail  # of 0.306, 0.307, 0.314


def test_without_tp_wait_the_tp_group_is_named_not_one_rank_of_it():
    """Workers that report no time in TP all-reduces: compute time cannot tell the slow rank
    from its TP peer; the diagnosis names the group honestly instead of a rounding accident."""
    a = StepAnalysis()
    [f] = twice(a, tp_job(2), 2, tp_wait=False)
    assert f.cause == "straggler" and f.rank == -1 and f.detail["tp_group"] == [2, 3]
    assert f.message.startswith("straggler: ranks 2 and 3 (one tensor-parallel group, stage 1 "
                                "on node n1) compute 1.7x longer"), f.message
    assert "cannot tell apart" in f.message and "0.528, 0.529 s vs 0.312 s" in f.message
    # which of the group computes longest is a rounding accident: the group persists, not it
    b = StepAnalysis()
    assert drain_job(b, tp_job(2), obs(*probe_split(2, tp_wait=False, step=4))) == []
    flipped = probe_split(3, tp_wait=False, step=6)  # rank 2 now 1.4 ms the slower one
    [g] = drain_job(b, tp_job(2), obs(*flipped))
    assert g.detail["tp_group"] == [2, 3], g.message


def test_the_per_rank_series_is_own_compute_without_tp_waits():
    m, a = Metrics(), StepAnalysis()
    a.check(tp_job(2), obs(*probe_split(2)), None)
    a.export(m, "j")
    text = generate_latest(m.registry).decode()
    assert 'ds3d_rank_step_seconds{job="j",rank="2"} 0.5246' in text
    assert 'ds3d_rank_step_seconds{job="j",rank="3"} 0.314' in text, text


def drain_job(analysis, job, o):
    out, f = [], analysis.check(job, o, None)
    while f is not None:
        out.append(f)
        f = analysis.check(job, obs(), None)
    return out
