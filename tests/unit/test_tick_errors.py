"""A supervisor tick failing the same way again and again is reported once on the job (event and
status line) instead of only as a traceback per tick in ds3dd's log (12-06: a refused state
transition kept a job RECOVERING for good, its status silent)."""

from __future__ import annotations

import pytest

from ds3d.daemon.logging import get_logger
from ds3d.daemon.store import Store
from ds3d.daemon.tick_errors import TickErrors
from ds3d.trainer.config import build_job_config

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _faults(store: Store, name: str) -> list[str]:
    return [e.message for e in store.events(job=name) if e.kind == "fault"]


def test_a_persisting_tick_error_is_reported_once_on_the_job(tmp_path):
    store = Store(tmp_path / "ds3d.db")
    store.create_job("j", build_job_config("tiny", name="j").dump_json(), "n1",
                     str(tmp_path / "jobs" / "j"))
    clock = Clock()
    counted: list[int] = []
    errors = TickErrors(store, "j", get_logger("test"), lambda: counted.append(1),
                        report_after_s=30, clock=clock)
    boom = RuntimeError("cannot go from RECOVERING to RECOVERING")
    for _ in range(5):  # 20 s of failing ticks: logged, not yet on the job
        errors.failed(boom)
        clock.now += 5
    assert _faults(store, "j") == []
    clock.now += 15
    errors.failed(boom)
    errors.failed(boom)
    [fault] = _faults(store, "j")
    assert "every pass fails with RuntimeError: cannot go from RECOVERING" in fault
    assert "for 40 s" in fault and "traceback is in ds3dd's log" in fault
    assert store.get_job("j").message == fault
    [event] = [e for e in store.events(job="j") if e.kind == "fault"]
    assert event.cause == "supervisor_error" and counted == [1]

    errors.succeeded()  # passes again, then fails another way: counted afresh
    errors.failed(KeyError("x"))
    clock.now += 31
    errors.failed(KeyError("x"))
    assert len(_faults(store, "j")) == 2 and "KeyError: 'x'" in _faults(store, "j")[1]
