"""The sample order is a pure function of (seed, step, DP rank)."""

import numpy as np
import pytest

from ds3d.trainer.config import build_job_config
from ds3d.trainer.data import BatchPlan, batch_index, encode_text
from ds3d.trainer.schedule import WarmupCosine


def _step_samples(cfg, dp, step):
    rows = []
    for r in range(dp):
        for x, _ in BatchPlan(cfg, dp, r).step_iterator(step):
            rows.extend(map(tuple, x))
    return rows


def test_same_step_same_samples_in_a_fresh_plan():
    cfg = build_job_config("tiny")
    a = list(BatchPlan(cfg, 1, 0).step_iterator(7))
    b = list(BatchPlan(cfg, 1, 0).step_iterator(7))
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
        assert np.array_equal(xa[:, 1:], ya[:, :-1])  # labels are inputs shifted by one


def test_global_batch_is_the_same_set_for_any_dp_degree():
    cfg = build_job_config("tiny")  # global batch 8
    one = _step_samples(cfg, 1, 3)
    assert len(one) == 8
    assert _step_samples(cfg, 2, 3) == one
    assert _step_samples(cfg, 4, 3) == one
    assert _step_samples(cfg, 1, 4) != one


def test_skip_window():
    assert batch_index(4, []) == 4
    assert batch_index(4, [(5, 8)]) == 4
    assert batch_index(5, [(5, 8)]) == 8
    assert batch_index(6, [(5, 8), (10, 12)]) == 9
    assert batch_index(7, [(10, 12), (5, 8)]) == 12
    cfg = build_job_config("tiny", ["data.skip_batches=[[2, 3]]"])
    plain = build_job_config("tiny")
    assert _step_samples(cfg, 1, 2) == _step_samples(plain, 1, 3)


def test_token_file(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 100)
    out = tmp_path / "t.bin"
    assert encode_text(text, out) == 1300
    cfg = build_job_config("tiny", [f'data.source="{out}"'])
    x, y = next(BatchPlan(cfg, 1, 0).step_iterator(0))
    assert x.shape == (2, 64) and set(np.unique(x)) <= set(b"hello world, ")


def test_token_out_of_vocab_is_a_clear_error(tmp_path):
    out = tmp_path / "t.bin"
    np.full(1000, 300, dtype=np.uint16).tofile(out)
    from ds3d.trainer.errors import ConfigError
    with pytest.raises(ConfigError, match="token id 300 at token 0 is outside"):
        build_job_config("tiny", [f'data.source="{out}"'])  # token_scan.py, before any start
    # beyond the scanned prefix, each sample is checked as it is drawn
    cfg = build_job_config("tiny", [f'data.source="{out}"', "model.vocab_size=512"])
    cfg.model.vocab_size = 256
    with pytest.raises(ConfigError, match="vocab_size=256"):
        next(BatchPlan(cfg, 1, 0).step_iterator(0))


def test_warmup_cosine():
    s = WarmupCosine(warmup_steps=4, total_steps=20, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == pytest.approx(1.0)
    assert s(12) == pytest.approx(0.55)
    assert s(20) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
