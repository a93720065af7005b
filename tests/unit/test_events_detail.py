"""`ds3dctl events --json` carries an event's whole detail (issue 24 item 2: the hang's stacks
were only in SQLite) and `--detail` prints it for people."""

from __future__ import annotations

import io
import json

from ds3d.daemon import cli
from ds3d.v1 import control_pb2 as pb

DETAIL = {"stacks": {"0": "py-spy dump:\nThread 7 (idle)\n    all_reduce (distributed_c10d.py:2)"},
          "stack_method": "py-spy", "suspects": [1],
          "unanswered": {"1": {"pid": 4242, "host": "node-a",
                               "why": "the process is stopped (SIGSTOP/SIGTSTP)"}}}
EVENT = pb.Event(seq=7, job="j", time=1.0, kind="fault", step=12, rank=1, node="node-a",
                 restart=0, cause="hang", message="no report ...",
                 detail_json=json.dumps(DETAIL))


class _Client:
    def __init__(self, *_a, **_k) -> None:
        pass

    def stream(self, method, request):
        assert method == "WatchEvents"
        return [EVENT]


def _run(monkeypatch, *flags: str) -> str:
    monkeypatch.setattr(cli, "Client", _Client)
    args = cli.build_parser().parse_args(["events", "j", *flags])
    out = io.StringIO()
    cli.run(args, out)
    return out.getvalue()


def test_events_json_has_the_full_detail(monkeypatch):
    [line] = _run(monkeypatch, "--json").splitlines()
    got = json.loads(line)
    assert got["detail"] == DETAIL
    assert (got["seq"], got["kind"], got["cause"], got["rank"], got["node"]) == \
        (7, "fault", "hang", 1, "node-a")


def test_events_detail_prints_stacks_and_the_unanswered_rank(monkeypatch):
    text = _run(monkeypatch, "--detail")
    assert text.splitlines()[0] == cli.event_line(EVENT)
    assert "    stacks:\n      0:\n        py-spy dump:\n        Thread 7 (idle)" in text
    assert "      1:\n        pid: 4242\n        host: node-a\n" in text
    assert "why: the process is stopped (SIGSTOP/SIGTSTP)" in text
