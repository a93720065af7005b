"""The registry of kinds (trainer/kinds.py) is the only list: each side covers exactly it, and
the proto comments and the docs list exactly it. Adding a kind on one side only fails here."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from ds3d.daemon import cli
from ds3d.daemon.jobdir import JobDir
from ds3d.daemon.reports import record_to_event
from ds3d.daemon.service import JobService, event_kinds
from ds3d.daemon.store import Store
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.faults import FAULT_ACTIONS, SLOW_FORWARD_S, SPIKE_FACTOR, FaultInjector
from ds3d.trainer.kinds import DoneReason, EventKind, FaultKind, RecordKind
from ds3d.trainer.report import Reporter, read_records, report_path

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PROTO = (ROOT / "protos/ds3d/v1/control.proto").read_text()
FAULTS = {k.value for k in FaultKind}
EVENTS = {k.value for k in EventKind}


# ---- fault kinds: the trainer acts on exactly the registry, the daemon accepts exactly it ------

def test_every_fault_kind_has_a_behaviour_in_the_trainer():
    assert set(FAULT_ACTIONS) == set(FaultKind)


def test_the_cli_accepts_exactly_the_registry_s_fault_kinds():
    for kind in FaultKind:
        assert cli.build_parser().parse_args(["inject", "j", kind, "--rank", "0"]).kind == kind
    with pytest.raises(cli.UsageError, match="invalid choice: 'oops'"):
        cli.build_parser().parse_args(["inject", "j", "oops", "--rank", "0"])


def test_the_daemon_refuses_an_unknown_fault_kind_before_writing_anything(tmp_path):
    store = Store(tmp_path / "state.db")
    service = JobService(store, None, tmp_path / "jobs", "n1",  # type: ignore[arg-type]
                         enable_fault_injection=True)
    with pytest.raises(ConfigError) as e:
        service.inject("j", "oops", 0, 0)
    assert str(e.value) == ("fault kind 'oops' is unknown; use one of "
                            + ", ".join(k.value for k in FaultKind))
    assert not (tmp_path / "jobs").exists() and not store.events()


class _Layers(torch.nn.Module):
    """Two linear layers: the injector hooks the first (nan, slow) and the last (spike)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x))


def _inject_and_step(tmp_path: Path, kind: FaultKind) -> tuple[torch.nn.Module, list[dict]]:
    """The daemon's writer puts the request in control/inject.json; rank 1's injector reads
    it at step 3 and acts; returns the model and the records it emitted."""
    jobdir = JobDir(tmp_path, "job")
    jobdir.create("{}")
    jobdir.write_inject(7, kind, rank=1, at_step=3)
    records: list[dict] = []
    injector = FaultInjector(jobdir.path, rank=1,
                             emit=lambda k, **f: records.append({"kind": k, **f}))
    model = _Layers()
    assert injector.before_step(2, model) is None  # not yet
    assert injector.before_step(3, model) == kind
    assert (jobdir.control / "inject-done-7").read_text() == "3"
    return model, records


def test_a_nan_written_by_the_daemon_poisons_the_rank_s_next_forward_once(tmp_path):
    model, records = _inject_and_step(tmp_path, FaultKind.NAN)
    assert records == [{"kind": RecordKind.FAULT, "cause": "injected_nan", "step": 3,
                        "detail": "drill: injected nan on rank 1 (request 7)"}]
    x = torch.ones(2, 4)
    assert torch.isnan(model(x)).all()
    assert torch.isfinite(model(x)).all()


def test_a_spike_written_by_the_daemon_scales_the_last_layer(tmp_path):
    model, _ = _inject_and_step(tmp_path, FaultKind.SPIKE)
    x = torch.ones(2, 4)
    with torch.no_grad():
        plain = torch.nn.functional.linear(model.first(x), model.last.weight, model.last.bias)
    assert torch.allclose(model(x), plain * SPIKE_FACTOR)


def test_slow_written_by_the_daemon_slows_every_forward(tmp_path):
    model, _ = _inject_and_step(tmp_path, FaultKind.SLOW)
    t0 = time.perf_counter()
    model(torch.ones(2, 4))
    model(torch.ones(2, 4))
    assert time.perf_counter() - t0 >= 2 * SLOW_FORWARD_S


def test_a_kind_this_trainer_does_not_know_is_not_acted_on_and_said(tmp_path, capsys):
    jobdir = JobDir(tmp_path, "job")
    jobdir.create("{}")
    (jobdir.control / "inject.json").write_text(
        json.dumps({"id": 4, "kind": "melt", "rank": 0, "at_step": 1}))
    records: list[dict] = []
    injector = FaultInjector(jobdir.path, rank=0, emit=lambda k, **f: records.append(f))
    assert injector.before_step(1, _Layers()) is None
    assert records == [] and (jobdir.control / "inject-done-4").exists()  # not tried again
    assert "cannot inject fault 'melt' (request 4)" in capsys.readouterr().err


# ---- record and event kinds ---------------------------------------------------------------------

def test_every_record_kind_is_stored_as_an_event_kind_but_heartbeats():
    for kind in RecordKind:
        ev = record_to_event({"kind": kind.value, "time": 1.0, "rank": 0, "step": 3})
        if kind is RecordKind.HEARTBEAT:
            assert ev is None
        else:
            assert ev is not None and ev["kind"] in EVENTS, kind
    restarted = record_to_event({"kind": "start", "time": 1.0, "rank": 0, "restart": 1})
    assert restarted is not None and restarted["kind"] == EventKind.RECOVERY


def test_every_daemon_event_kind_is_written_somewhere():
    """An EventKind that is no record kind must be written by the daemon (else it is dead):
    stored by `record(job, KIND, ...)`, or the kind of a Fault, a transition or an event row."""
    daemon = "\n".join(p.read_text() for p in (ROOT / "daemon").glob("*.py"))
    used = set(re.findall(r'(?:record\([^,()]+,\s*|kind=|"kind": |kind: EventKind = )'
                          r"EventKind\.([A-Z_]+)", daemon))
    own = {k.name for k in EventKind if k.value not in {r.value for r in RecordKind}}
    assert own - used == set()


def test_the_reporter_writes_registered_kinds_only(tmp_path):
    reporter = Reporter(tmp_path, rank=2, restart=0)
    reporter.emit(RecordKind.STEP, step=1)
    with pytest.raises(ValueError, match="'stpe' is not a RecordKind"):
        reporter.emit("stpe", step=2)
    reporter.close()
    records, _ = read_records(report_path(tmp_path, 2))
    assert [(r["kind"], r["step"]) for r in records] == [("step", 1)]


def test_watch_events_refuses_an_unknown_kind():
    assert event_kinds(["fault", "recovered"]) == [EventKind.FAULT, EventKind.RECOVERED]
    with pytest.raises(ConfigError, match="event kind\\(s\\) 'faults' unknown; use one of state, "):
        event_kinds(["fault", "faults"])
    with pytest.raises(cli.UsageError, match="invalid choice: 'faults'"):
        cli.build_parser().parse_args(["events", "j", "--kind", "faults"])


# ---- the proto comments and the docs list exactly the registry ---------------------------------

def _comment_before(marker: str) -> str:
    """The // comment lines right above `marker` in the proto."""
    lines = PROTO[:PROTO.index(marker)].splitlines()
    block = []
    for line in reversed(lines[:-1] if not lines[-1].strip() else lines):
        if not line.strip().startswith("//"):
            break
        block.append(line)
    return "\n".join(reversed(block))


def test_the_proto_lists_exactly_the_event_kinds():
    listed = set(re.findall(r'"([a-z_]+)"', _comment_before("message Event {")))
    assert listed == EVENTS


def test_the_proto_lists_exactly_the_fault_kinds():
    listed = set(re.findall(r'"([a-z_]+)" \(', _comment_before("  string kind = 2;")))
    assert listed == FAULTS


DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "daemon/cli.py"]


def test_every_inject_command_in_the_docs_lists_exactly_the_fault_kinds():
    found = 0
    for path in DOCS:
        for kinds in re.findall(r"ds3dctl inject JOB ([a-z|]+)", path.read_text()):
            found += 1
            assert set(kinds.split("|")) == FAULTS, path.name
    assert found >= 3  # architecture, diagnoses, ds3dctl's usage


def test_every_kind_the_docs_filter_events_by_is_an_event_kind():
    found = set()
    for path in DOCS:
        for kinds in re.findall(r"--kind ([a-z_|]+)", path.read_text()):
            found |= set(kinds.split("|"))
    assert found and found - EVENTS == set()


def test_the_runbook_lists_exactly_the_event_kinds():
    row = next(line for line in (ROOT / "docs/runbook.md").read_text().splitlines()
               if line.startswith("| `ds3dctl events JOB"))
    listed = set(re.findall(r"`([a-z_]+)`", row.split("Kinds (", 1)[1]))
    assert listed == EVENTS


def test_report_py_lists_exactly_the_record_kinds_and_done_reasons():
    doc = (ROOT / "trainer/report.py").read_text().split('"""')[1]
    table = doc.split("and their extra fields:\n", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"^    ([a-z_]+) ", table, re.M)) == {k.value for k in RecordKind}
    reasons = re.search(r"reason \(`DoneReason`: ([^)]*)\)", table)
    assert reasons is not None
    assert set(re.findall(r'"([a-z_]+)"', reasons[1])) == {r.value for r in DoneReason}
