"""Pipeline partition from measured costs (trainer/partition.py): the dynamic programme against
brute force, the predictions, partition.json, merging the ranks' profile records, and the layer
profiler's hooks on a fake pipeline engine with known costs."""

from __future__ import annotations

import itertools
import json
import random
import re
import time

import pytest

from ds3d.trainer.config import build_job_config
from ds3d.trainer.partition import (
    LayerCost,
    MemoryModel,
    PartitionError,
    best_partition,
    check_boundaries,
    current_partition,
    deepspeed_balanced,
    in_flight,
    layer_param_counts,
    merge_profile_records,
    method_boundaries,
    predict,
    propose,
    read_partition_file,
    stage_boundaries,
    write_partition_file,
)


def _splits(n: int, p: int):
    """Every split of n layers into p non-empty contiguous stages, as boundaries."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield [0, *cuts, n]


def _stage_sums(values, parts):
    return [sum(values[parts[k]:parts[k + 1]]) for k in range(len(parts) - 1)]


def _fits(parts, static, act, m, limit):
    p = len(parts) - 1
    return all(sum(static[parts[k]:parts[k + 1]]) + in_flight(k, p, m) *
               sum(act[parts[k]:parts[k + 1]]) <= limit for k in range(p))


@pytest.mark.parametrize("seed", range(60))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    n, p = rng.randint(2, 9), 0
    p = rng.randint(1, min(4, n))
    costs = [rng.choice([rng.uniform(0.1, 5.0), float(rng.randint(1, 4))]) for _ in range(n)]
    parts = best_partition(costs, p)
    assert check_boundaries(parts, n - 2, p) is None
    brute = min(max(_stage_sums(costs, s)) for s in _splits(n, p))
    assert max(_stage_sums(costs, parts)) == pytest.approx(brute, rel=1e-12)
    # among the optimal splits, the most even one (smallest sum of squares)
    even = min(sum(x * x for x in _stage_sums(costs, s)) for s in _splits(n, p)
               if max(_stage_sums(costs, s)) <= brute * (1 + 1e-9))
    assert sum(x * x for x in _stage_sums(costs, parts)) == pytest.approx(even, rel=1e-9)


@pytest.mark.parametrize("seed", range(60))
def test_dp_with_memory_limit_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 9)
    p = rng.randint(1, min(4, n))
    m = rng.randint(1, 6)
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    static = [rng.uniform(0, 10) for _ in range(n)]
    act = [rng.uniform(0, 3) for _ in range(n)]
    limit = rng.uniform(5, 40)
    feasible = [s for s in _splits(n, p) if _fits(s, static, act, m, limit)]
    if not feasible:
        with pytest.raises(PartitionError):
            best_partition(costs, p, static_bytes=static, activation_bytes=act,
                           micro_batches=m, limit_bytes=limit)
        return
    parts = best_partition(costs, p, static_bytes=static, activation_bytes=act,
                           micro_batches=m, limit_bytes=limit)
    assert _fits(parts, static, act, m, limit)
    brute = min(max(_stage_sums(costs, s)) for s in feasible)
    assert max(_stage_sums(costs, parts)) == pytest.approx(brute, rel=1e-12)


def test_memory_limit_moves_layers_off_the_early_stages():
    """Stage 0 keeps min(p, m) micro-batches of activations in flight under 1F1B, the last one
    only one: a tight limit pushes activation-heavy layers towards the end."""
    costs = [1.0] * 8
    free = best_partition(costs, 2)
    assert free == [0, 4, 8]
    tight = best_partition(costs, 2, static_bytes=[0] * 8, activation_bytes=[1] * 8,
                           micro_batches=4, limit_bytes=6)
    assert tight == [0, 3, 8]  # stage 0: 3 layers x 2 in flight = 6; stage 1: 5 x 1


def test_seed_example_prediction():
    """The seed's hand tuning: 12 equal-param blocks whose later ones cost more; the measured
    split lowers the bubble and the step time."""
    costs = [LayerCost(i, c, 2 * c) for i, c in enumerate(
        [1.0, 1.0, 1.0, 1.2, 1.2, 1.2, 1.2, 1.6, 1.6, 1.6, 1.6, 1.6])]
    even = predict(costs, [0, 4, 8, 12], micro_batches=8)
    assert even.stage_s == pytest.approx([12.6, 15.6, 19.2])
    assert even.step_s == pytest.approx((8 + 3 - 1) * 19.2)
    assert even.bubble == pytest.approx(1 - 8 * (12.6 + 15.6 + 19.2) / (3 * 10 * 19.2))
    best = propose(costs, [0, 4, 8, 12], micro_batches=8, threshold=0.05)
    assert best.proposed.boundaries == [0, 5, 9, 12]
    assert best.proposed.slowest_s < even.slowest_s and best.proposed.bubble < even.bubble
    assert best.worth_it and best.improvement == pytest.approx(1 - best.proposed.slowest_s / 19.2)


def test_balanced_bubble_is_the_schedule_bubble():
    costs = [LayerCost(i, 1.0, 2.0) for i in range(8)]
    pred = predict(costs, [0, 2, 4, 6, 8], micro_batches=12)
    assert pred.bubble == pytest.approx((4 - 1) / (12 + 4 - 1))


def test_threshold_keeps_the_current_split():
    costs = [LayerCost(i, 1.0, 2.0) for i in range(6)]
    costs[5] = LayerCost(5, 1.06, 2.12)  # the best split differs, but barely
    prop = propose(costs, [0, 3, 6], micro_batches=4, threshold=0.05)
    assert not prop.worth_it
    assert propose(costs, [0, 3, 6], micro_batches=4, threshold=0.0).worth_it is \
        (prop.proposed.boundaries != [0, 3, 6])


def test_stage_memory_prediction():
    costs = [LayerCost(i, 1.0, 1.0, params=100, activation_bytes=10) for i in range(4)]
    pred = predict(costs, [0, 2, 4], micro_batches=8, memory=MemoryModel(16.0))
    assert pred.stage_memory_bytes == [2 * 100 * 16 + 2 * 2 * 10, 2 * 100 * 16 + 1 * 2 * 10]


@pytest.mark.parametrize("seed", range(25))
def test_parameters_method_equals_deepspeed(seed):
    from deepspeed.runtime import utils as ds_utils

    rng = random.Random(seed)
    weights = [rng.randint(1, 1000) for _ in range(rng.randint(1, 14))]
    parts = rng.randint(1, 6)
    assert deepspeed_balanced(weights, parts) == [int(x) for x in ds_utils.partition_balanced(
        weights=weights, num_parts=parts)]


@pytest.mark.parametrize("seed", range(60))
def test_equal_costs_break_ties_as_deepspeed_does(seed):
    """Uniform blocks between a heavy embedding and head (a GPT's layers) make many splits cost
    the same: DeepSpeed keeps the last; the vectorised search must too, at sizes past the
    random test's."""
    from deepspeed.runtime import utils as ds_utils

    rng = random.Random(seed)
    n = rng.randint(3, 70)
    weights = [rng.choice([50, 100])] + [rng.choice([7, 7, 7, 9])] * (n - 2) + [100] \
        if seed % 2 else [rng.choice([5, 5, 6]) for _ in range(n)]
    parts = rng.randint(1, 16)
    assert deepspeed_balanced(weights, parts) == [int(x) for x in ds_utils.partition_balanced(
        weights=weights, num_parts=parts)]


def test_the_fit_search_over_a_1024_layer_model_answers():
    """A hostile StartJob (1024 layers of d 65536, every value within the schema) kept ds3dd's
    fit check busy for over 5 minutes: DeepSpeed's O(n^2 m) split in Python for each PP the
    search considers. It answers now (seconds), refusing with the reason."""
    from ds3d.daemon.fit_check import check_fit
    from ds3d.trainer.errors import ConfigError
    from ds3d.trainer.memory_model import NodeResources

    cfg = build_job_config("tiny", ["model.d_model=65536", "model.n_layers=1024",
                                    "model.vocab_size=4194304"])
    with pytest.raises(ConfigError, match="will not fit this node"):
        check_fit(cfg, NodeResources(gpus=8, gpu_bytes=80 << 30, host_bytes=1 << 40))


def test_methods_and_partition_file(tmp_path):
    cfg = build_job_config("tiny", ["parallel.pp=2", 'parallel.partition_method="measured"'])
    counts = layer_param_counts(cfg.model)
    assert len(counts) == cfg.model.n_layers + 2
    assert method_boundaries(cfg) == deepspeed_balanced(counts, 2)
    assert current_partition(cfg, tmp_path).source == "parameters"
    uniform = build_job_config("tiny", ["parallel.pp=2", 'parallel.partition_method="uniform"'])
    assert stage_boundaries(uniform) == [0, 3, 6]
    write_partition_file(tmp_path, cfg, [0, 4, 6], "measured", decision="applied")
    got = current_partition(cfg, tmp_path)
    assert (got.boundaries, got.source, got.detail["decision"]) == ([0, 4, 6], "measured",
                                                                     "applied")
    # a file that does not fit the job (other pp or model) is ignored
    four = build_job_config("tiny", ["parallel.pp=4"])
    assert read_partition_file(tmp_path, four) is None
    other = build_job_config("tiny", ["parallel.pp=2", "model.d_model=128"])
    assert stage_boundaries(other, tmp_path) == method_boundaries(other)
    with pytest.raises(ValueError, match="non-empty|increasing"):
        write_partition_file(tmp_path, cfg, [0, 6, 6], "measured")
    assert json.loads((tmp_path / "partition.json").read_text())["boundaries"] == [0, 4, 6]


def test_config_accepts_measured_and_its_knobs():
    cfg = build_job_config("tiny", ["parallel.pp=2", 'parallel.partition_method="measured"',
                                    "parallel.partition_threshold=0.1",
                                    "parallel.partition_profile_steps=2"])
    assert cfg.parallel.partition_method == "measured"
    from ds3d.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="partition_method"):
        build_job_config("tiny", ['parallel.partition_method="fastest"'])
    with pytest.raises(ConfigError, match="partition_threshold"):
        build_job_config("tiny", ["parallel.partition_threshold=1.5"])


def _record(rank, stage, layers, step=4, rnd=1.0, **extra):
    return {"kind": "profile", "rank": rank, "stage": stage, "step": step, "round": rnd,
            "micro_batches": 4, "partition": [0, 3, 6], "bytes_per_param": 16.0,
            "layers": [{"layer": i, "forward_s": f, "backward_s": 2 * f, "params": 10,
                        "activation_bytes": 5} for i, f in layers], **extra}


def test_merge_profile_records():
    recs = [_record(0, 0, [(0, 0.1), (1, 1.0), (2, 1.0)]),
            _record(1, 0, [(0, 0.3), (1, 3.0), (2, 1.0)]),   # a DP replica of stage 0
            _record(2, 1, [(3, 2.0), (4, 2.0), (5, 4.0)])]
    assert merge_profile_records(recs[:2], n_layers=4) is None  # stage 1 missing
    merged = merge_profile_records(recs, n_layers=4)
    costs = merged["layers"]
    assert [c.forward_s for c in costs] == [pytest.approx(0.2), 2.0, 1.0, 2.0, 2.0, 4.0]
    assert merged["micro_batches"] == 4 and merged["step"] == 4
    # a newer round wins for the layers it measured; older rounds fill the rest
    newer = _record(0, 0, [(0, 0.5), (1, 0.5), (2, 0.5)], step=9, rnd=2.0)
    merged = merge_profile_records([*recs, newer], n_layers=4)
    assert [c.forward_s for c in merged["layers"]][:4] == [0.5, 0.5, 0.5, 2.0]
    assert merged["step"] == 9


# ---- the profiler's hooks, on a fake pipeline engine with known costs -----------------------

class _Sleep:
    """A layer costing `fwd` seconds forward and `bwd` seconds backward."""

    @staticmethod
    def make(fwd: float, bwd: float):
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                time.sleep(fwd)
                return x * 1.0

            @staticmethod
            def backward(ctx, g):
                time.sleep(bwd)
                return g

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(4))

            def forward(self, x):
                return Fn.apply(x * self.w)

        return Layer()


def _fake_engine(costs, loss_s=0.0, hook_cost_s=0.0):
    import torch
    from deepspeed.runtime.pipe import schedule

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._local_start = 3
            self.forward_funcs = [_Sleep.make(f, b) for f, b in costs]
            for i, f in enumerate(self.forward_funcs):
                self.add_module(str(3 + i), f)

    class Engine:
        def __init__(self):
            self.module = Module()
            self.outputs = []

        def _exec_forward_pass(self, buffer_id):
            x = torch.ones(4, requires_grad=True)
            for f in self.module.forward_funcs:
                x = f(x)
                if f._forward_pre_hooks:  # what hooks cost the profiled steps
                    time.sleep(hook_cost_s)
            time.sleep(loss_s)
            self.outputs.append(x.sum())

        def _exec_backward_pass(self, buffer_id):
            self.outputs.pop(0).backward()

        _INSTRUCTION_MAP = {schedule.ForwardPass: _exec_forward_pass,
                            schedule.BackwardPass: _exec_backward_pass}

        def run_step(self, micro_batches):
            for _ in range(micro_batches):
                self._INSTRUCTION_MAP[schedule.ForwardPass](self, buffer_id=0)
            for _ in range(micro_batches):
                self._INSTRUCTION_MAP[schedule.BackwardPass](self, buffer_id=0)

    return Engine()


@pytest.mark.timing  # sleeps measured against bounds: not beside another test
def test_layer_profiler_measures_known_costs():
    import torch

    from ds3d.trainer.layer_profile import LayerProfiler

    # sleeps of known length; large enough that a loaded machine's late wake-ups (additive,
    # a few ms) stay inside the tolerance
    costs = [(0.016, 0.048), (0.040, 0.008), (0.008, 0.080)]
    engine = _fake_engine(costs, loss_s=0.020)
    prof = LayerProfiler(engine, torch.device("cpu"))
    engine.run_step(2)  # unsampled: no hooks
    for _ in range(3):
        prof.begin()
        engine.run_step(2)
        prof.end()
    assert "_INSTRUCTION_MAP" not in engine.__dict__  # hooks and wrappers removed
    rows = {r["layer"]: r for r in prof.summary()}
    assert sorted(rows) == [3, 4, 5] and prof.micro_batches == 2
    for i, (f, b) in enumerate(costs):
        want_f = f + (0.020 if i == 2 else 0.0)  # the last layer carries the loss
        # a sleep on a loaded machine wakes late, never early: allow lateness, not shortfall
        assert want_f - 0.002 <= rows[3 + i]["forward_s"] <= want_f + 0.012, i
        assert b - 0.002 <= rows[3 + i]["backward_s"] <= b + 0.012, i
        assert rows[3 + i]["params"] == 4
        assert rows[3 + i]["activation_bytes"] > 0


@pytest.mark.timing  # sleeps measured against bounds: not beside another test
def test_layer_profile_is_calibrated_by_unhooked_steps():
    import torch

    from ds3d.trainer.layer_profile import LayerProfiler

    # hooked steps pay 30 ms per layer more than unhooked ones: the stage's layers are scaled
    # back to what the stage takes without hooks
    costs = [(0.016, 0.048), (0.040, 0.008), (0.008, 0.080)]
    engine = _fake_engine(costs, loss_s=0.020, hook_cost_s=0.030)
    prof = LayerProfiler(engine, torch.device("cpu"))
    for hooks in (False, False, True, True, True):
        prof.begin(hooks=hooks)
        engine.run_step(2)
        prof.end()
    assert "_INSTRUCTION_MAP" not in engine.__dict__
    assert len(prof.unhooked) == 2 and len(prof.steps) == 3
    # per micro-batch: 0.220 s of layers and loss, 0.090 s of hooks (sleeps on a loaded machine
    # wake late: a few ms each, 7 of them per micro-batch, never early)
    cal = prof.calibration()
    assert 0.218 <= cal["unhooked_s"] <= 0.220 + 0.060
    assert 0.088 - 0.020 <= cal["hooked_s"] - cal["unhooked_s"] <= 0.090 + 0.060
    assert cal["scale"] == pytest.approx(cal["unhooked_s"] / cal["hooked_s"], abs=1e-3)
    rows = prof.summary()
    assert sum(r["forward_s"] + r["backward_s"] for r in rows) == pytest.approx(cal["unhooked_s"],
                                                                                rel=1e-3)
    # without calibration steps the profile is used as measured
    prof.reset()
    for _ in range(2):
        prof.begin()
        engine.run_step(1)
        prof.end()
    assert prof.calibration()["scale"] == 1.0


# ---- the daemon's Rebalance (service + CLI text), on a store fed with profile records -------

class _Supervisors:
    def __init__(self):
        self.poked = []

    def poke(self, name):
        self.poked.append(name)


def _service(tmp_path, method="parameters"):
    from ds3d.daemon.service import JobService
    from ds3d.daemon.store import Store

    cfg = build_job_config("tiny", ["parallel.pp=2", f'parallel.partition_method="{method}"'],
                           name="pj")
    store = Store(tmp_path / "ds3d.db")
    run_dir = tmp_path / "jobs" / "pj"
    run_dir.mkdir(parents=True)
    store.create_job("pj", cfg.dump_json(), "n1", str(run_dir))
    return JobService(store, _Supervisors(), tmp_path / "jobs", "n1"), store, cfg


def _ingest_profile(store, head_heavy=True):
    # tiny: layers 0..5; stage 0 = [0, 3) under "parameters", the head (5) is expensive
    f = [0.001, 0.01, 0.01, 0.01, 0.01, 0.05 if head_heavy else 0.01]
    recs = [_record(0, 0, [(i, f[i]) for i in range(3)]),
            _record(1, 1, [(i, f[i]) for i in range(3, 6)])]
    store.ingest("pj", {"rank-00000.jsonl": 1},
                 [{"time": 1.0, "kind": "profile", "step": 4, "rank": r["rank"], "detail": r}
                  for r in recs])


def test_rebalance_without_profile_asks_running_workers(tmp_path):
    from ds3d.daemon.states import JobState
    from ds3d.trainer.errors import StateError

    svc, store, _ = _service(tmp_path)
    with pytest.raises(StateError, match="no layer profile and is PENDING"):
        svc.rebalance("pj", dry_run=True)
    store.transition("pj", JobState.STARTING, "go")
    store.transition("pj", JobState.RUNNING, "go")
    with pytest.raises(StateError, match=r"next 5 steps \(command 1\)"):
        svc.rebalance("pj", dry_run=True)
    job = store.get_job("pj")
    assert (job.command_id, job.command_action) == (1, "profile")
    with pytest.raises(StateError, match=r"command 1\)"):  # asked once, not again
        svc.rebalance("pj", dry_run=True)
    assert store.get_job("pj").command_id == 1
    store.transition("pj", JobState.COMPLETED, "done")  # no resume to suggest any more
    with pytest.raises(StateError, match="is COMPLETED: .* a new job of the same model") as e:
        svc.rebalance("pj", dry_run=True)
    assert "resume" not in str(e.value)


def test_rebalance_dry_run_then_apply(tmp_path):
    from ds3d.daemon.api import rebalance_to_proto
    from ds3d.daemon.cli import rebalance_text
    from ds3d.daemon.states import JobState
    from ds3d.trainer.errors import StateError

    svc, store, cfg = _service(tmp_path)
    _ingest_profile(store)
    r = svc.rebalance("pj", dry_run=True)
    assert r.action == "dry_run" and r.proposal.current.boundaries == method_boundaries(cfg)
    assert r.proposal.proposed.boundaries == [0, 5, 6] and r.proposal.worth_it
    text = rebalance_text("pj", rebalance_to_proto(r))
    assert re.search(r"current +0\|3\|6 +63\.0 210\.0 +210\.0 +1050 +48\.0%", text), text
    assert re.search(r"proposed +0\|5\|6 +123\.0 150\.0 +150\.0 +750 +27\.2%", text), text
    assert "slowest stage -28.6% (threshold 5%)" in text and "dry run" in text
    assert store.get_job("pj").command_id == 0
    with pytest.raises(StateError, match="it is PENDING"):
        svc.rebalance("pj", dry_run=False)
    store.transition("pj", JobState.STARTING, "go")
    store.transition("pj", JobState.RUNNING, "go")
    r = svc.rebalance("pj", dry_run=False)
    assert r.action == "scheduled" and r.command_id == 1
    assert store.get_job("pj").command_action == "repartition:0,5,6"


def test_rebalance_balanced_job_is_unchanged(tmp_path):
    from ds3d.daemon.states import JobState

    svc, store, _ = _service(tmp_path, method="uniform")
    _ingest_profile(store, head_heavy=False)
    store.transition("pj", JobState.STARTING, "go")
    store.transition("pj", JobState.RUNNING, "go")
    r = svc.rebalance("pj", dry_run=False)
    assert r.action == "unchanged" and "nothing to change" in r.message
    assert store.get_job("pj").command_id == 0


def test_rebalance_refuses_one_stage(tmp_path):
    from ds3d.daemon.service import JobService
    from ds3d.daemon.store import Store
    from ds3d.trainer.errors import StateError

    store = Store(tmp_path / "ds3d.db")
    store.create_job("one", build_job_config("tiny", name="one").dump_json(), "n1",
                     str(tmp_path / "one"))
    with pytest.raises(StateError, match="one pipeline stage"):
        JobService(store, _Supervisors(), tmp_path, "n1").rebalance("one", dry_run=True)


def test_job_status_shows_the_partition(tmp_path):
    from ds3d.daemon.api import job_to_proto

    svc, store, cfg = _service(tmp_path)
    status = job_to_proto(store.get_job("pj"))
    assert (list(status.stage_boundaries), status.partition_source) == ([0, 3, 6], "parameters")
    write_partition_file(tmp_path / "jobs" / "pj", cfg, [0, 4, 6], "rebalance")
    status = job_to_proto(store.get_job("pj"))
    assert (list(status.stage_boundaries), status.partition_source) == ([0, 4, 6], "rebalance")


@pytest.mark.parametrize("content", ["[0, 4, 6]", "5", "null", '"x"', "DIR",
                                     '{"boundaries": [0, 3.5, 6]}',
                                     '{"boundaries": [false, 4, 6]}'])
def test_a_partition_file_that_is_no_partition_is_ignored_not_a_crash(tmp_path, content):
    """Was: AttributeError (a JSON list or number) or IsADirectoryError from every GetJob and
    ListJobs of the daemon (job_to_proto reads the file), and [0, 3.5, 6] ran as [0, 3, 6]."""
    from ds3d.daemon.api import job_to_proto

    svc, store, cfg = _service(tmp_path)
    path = tmp_path / "jobs" / "pj" / "partition.json"
    if content == "DIR":
        path.mkdir()
    else:
        path.write_text(content)
    status = job_to_proto(store.get_job("pj"))
    assert (list(status.stage_boundaries), status.partition_source) == ([0, 3, 6], "parameters")
    assert read_partition_file(path.parent, cfg) is None


# ---- stage 0 never holds the embedding alone (DeepSpeed's ZeRO step hangs on it) -------------

def test_stage_zero_keeps_a_block_beside_the_embedding():
    from ds3d.trainer.partition import check_runnable, keep_embedding_company

    assert keep_embedding_company([0, 1, 6, 9, 10]) == [0, 2, 6, 9, 10]
    assert keep_embedding_company([0, 1, 2, 3, 10]) == [0, 2, 3, 4, 10]
    assert keep_embedding_company([0, 3, 10]) == [0, 3, 10]
    assert keep_embedding_company([0, 10]) == [0, 10]
    # a large vocabulary: balancing parameters alone would put the embedding alone on stage 0
    cfg = build_job_config("tiny", ["model.n_layers=8", "model.d_model=128", "model.n_heads=4",
                                    "model.vocab_size=4096", "parallel.pp=4",
                                    "model.layer_d_ff=[64,64,64,64,64,64,64,1024]"])
    ds = deepspeed_balanced(layer_param_counts(cfg.model), 4)
    assert ds[1] == 1
    assert method_boundaries(cfg) == keep_embedding_company(ds)
    assert check_runnable(method_boundaries(cfg), 8, 4) is None
    assert "besides the embedding" in check_runnable([0, 1, 6, 9, 10], 8, 4)
    # measured: a first stage of one layer only where allowed
    costs = [3.0, 5.0, 1.0, 1.0, 5.0, 5.0]
    assert best_partition(costs, 4)[:2] == [0, 1]
    assert best_partition(costs, 4, first_at_least=2)[:2] == [0, 2]
