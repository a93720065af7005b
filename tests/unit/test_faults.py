"""Fault detectors of the step loop: pure logic, no processes."""

import pytest

from ds3d.trainer.config import FaultsConfig
from ds3d.trainer.faults import RollbackBudget, SpikeDetector


def test_spike_needs_k_mads_for_m_steps():
    d = SpikeDetector(FaultsConfig(spike_window=20, spike_mads=6.0, spike_patience=3))
    losses = [3.0 + 0.01 * (i % 5) for i in range(20)]  # median 3.02, MAD 0.01
    assert not any(d.observe(x) for x in losses)
    assert not d.observe(3.5)  # 1st step far above: not yet
    assert not d.observe(3.5)  # 2nd
    assert d.observe(3.5)      # 3rd in a row: a spike
    d.reset()
    assert not d.observe(3.5)  # no history, no verdict


def test_a_single_outlier_is_not_a_spike_and_does_not_move_the_baseline():
    d = SpikeDetector(FaultsConfig(spike_window=20, spike_mads=6.0, spike_patience=2))
    for i in range(20):
        d.observe(2.0 + 0.01 * (i % 3))
    assert not d.observe(9.0)
    assert not d.observe(2.01)  # the run of high losses is broken
    assert not d.observe(9.0)
    assert d.observe(9.0)


def test_noise_on_a_converged_loss_is_not_a_spike():
    """What a soak saw: late in a smooth run the MAD is tiny, so 20 of them (0.066) were passed
    by a 5% wobble for 3 steps. The rise must also reach spike_min_rise of the median; a real
    spike still does, and spike_min_rise = 0 gives the bare MAD rule back."""
    def fed(min_rise: float) -> SpikeDetector:
        d = SpikeDetector(FaultsConfig(spike_window=50, spike_mads=20.0, spike_patience=3,
                                       spike_min_rise=min_rise))
        for i in range(50):
            d.observe(5.077 + 0.003 * (i % 3 - 1))  # median 5.077, MAD 0.003
        return d

    d = fed(0.1)
    assert not any(d.observe(5.35) for _ in range(5))  # +5.4%: noise
    assert d.threshold == pytest.approx(5.077 * 1.1)
    assert [d.observe(6.0) for _ in range(3)] == [False, False, True]  # +18%: a spike
    bare = fed(0.0)
    assert [bare.observe(5.35) for _ in range(3)] == [False, False, True]


def test_slowly_falling_loss_is_never_a_spike():
    d = SpikeDetector(FaultsConfig(spike_window=50, spike_mads=6.0, spike_patience=3))
    assert not any(d.observe(5.0 * 0.995 ** i) for i in range(300))


def test_rollback_budget_pauses_a_fault_loop():
    b = RollbackBudget(FaultsConfig(max_rollbacks=2, rollback_window_steps=100))
    assert b.allow(10) and b.allow(50)
    assert not b.allow(60)      # a third rollback within 100 steps: pause instead
    assert b.allow(200)         # the window has moved past the old ones
