"""`ds3dctl status JOB` shows where the step time goes: the daemon's per-stage split of the newest
sampled step (StepAnalysis -> JobService.step_split -> StepSplit proto) printed as a table with
the bubble and reduce/forward targets flagged; and `ds3dctl logs` says where the files are."""

import io
import json
import math

import pytest

from ds3d.daemon import cli
from ds3d.daemon.api import split_to_proto
from ds3d.daemon.reports import Observation
from ds3d.daemon.service import JobService
from ds3d.daemon.step_analysis import StepAnalysis
from ds3d.v1 import control_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def beat(rank, stage, forward, backward, p2p, reduce=0.0, bubble=None, step=6):
    split = {"forward": forward, "backward": backward, "optimizer": 0.01, "p2p_wait": p2p,
             "dp_reduce": reduce, "data": 0.001, "step_s": 1.0,
             "compute_s": forward + backward + 0.01}
    if bubble is not None:
        split.update(bubble=bubble, bubble_theoretical=0.2)
    if reduce:
        split["reduce_to_forward"] = round(reduce / forward, 4)
    return {"kind": "heartbeat", "rank": rank, "step": step, "stage": stage, "node": "n1",
            "split": split}


class _Sups:
    def __init__(self, analysis):
        self._a = analysis

    def analysis(self, name):
        return self._a if name == "j" else None


def analysed(*beats):
    a = StepAnalysis()
    o = Observation()
    o.records = list(beats)
    a.check(None, o, None)
    return a


def service(analysis):
    return JobService(None, _Sups(analysis), None, "n1")  # step_split reads only supervisors


# two stages x two DP ranks; stage 1 waits longer and rank 3 reduces slowly
BEATS = [beat(0, 0, 0.10, 0.20, 0.05, 0.02, bubble=0.30),
         beat(1, 0, 0.12, 0.22, 0.04, 0.02, bubble=0.32),
         beat(2, 1, 0.20, 0.40, 0.10, 0.03, bubble=0.10),
         beat(3, 1, 0.20, 0.41, 0.09, 0.08, bubble=0.12)]


def test_per_stage_takes_the_slowest_rank_and_the_mean_bubble():
    stages = analysed(*BEATS).per_stage()
    assert [s["stage"] for s in stages] == [0, 1] and [s["ranks"] for s in stages] == [2, 2]
    assert stages[0]["forward"] == 0.12 and stages[0]["backward"] == 0.22
    assert stages[1]["dp_reduce"] == 0.08 and stages[1]["p2p_wait"] == 0.10
    assert stages[0]["bubble"] == pytest.approx(0.31) and stages[1]["bubble"] == pytest.approx(0.11)
    assert stages[1]["reduce_to_forward"] == pytest.approx(0.4)
    assert stages[0]["step"] == 6


def test_status_proto_carries_the_split_and_the_targets():
    sp = split_to_proto(service(analysed(*BEATS)).step_split("j"))
    assert [st.stage for st in sp.stages] == [0, 1]
    assert sp.bubble == pytest.approx(0.21) and sp.bubble_theoretical == pytest.approx(0.2)
    assert sp.reduce_to_forward == pytest.approx(0.4)
    assert sp.bubble_target == 0.15 and sp.reduce_to_forward_target == 0.30
    # no sampled step yet (or another job): the field stays unset
    assert service(StepAnalysis()).step_split("j") is None
    assert service(analysed(*BEATS)).step_split("other") is None
    assert not pb.JobStatus().HasField("step_split")


def test_split_table_flags_missed_targets():
    sp = split_to_proto(service(analysed(*BEATS)).step_split("j"))
    text = cli.split_text(sp)
    lines = text.splitlines()
    assert "sampled step 6" in lines[0]
    head = lines[1].split()
    assert head[:4] == ["STAGE", "RANKS", "FORWARD", "BACKWARD"] and "REDUCE/FWD" in head
    stage0, stage1 = lines[2].split(), lines[3].split()
    assert stage0[:4] == ["0", "2", "0.120", "0.220"]
    # stage 0: bubble 31% > 15% flagged; its largest reduce/forward, rank 0's 0.02/0.10, is
    # within 30%
    assert "31.0%" in stage0 and stage0[stage0.index("31.0%") + 1] == "!"
    assert stage0[-1] == "20.0%"
    assert stage1[-2:] == ["40.0%", "!"]
    assert "pipeline bubble 21.0% measured vs 20.0% theoretical (p-1)/(m+p-1); target < 15%: " \
           "ABOVE TARGET" in text
    assert "DP reduce / forward 40.0%; target < 30%: ABOVE TARGET" in text


def test_single_stage_without_reduction_says_what_is_not_measured():
    sp = split_to_proto(service(analysed(beat(0, 0, 0.1, 0.2, 0.0))).step_split("j"))
    text = cli.split_text(sp)
    assert "pipeline bubble: none (one pipeline stage)" in text
    assert "DP reduce / forward: not measured" in text
    row = text.splitlines()[2].split()
    assert row[-2:] == ["-", "-"]
    d = cli.split_dict(sp)
    assert d["bubble"] is None and d["bubble_ok"] is None and d["reduce_to_forward_ok"] is None


class FakeClient:
    """Stands in for the gRPC client: GetJob and WatchEvents answers from memory."""

    job: pb.JobStatus
    events: list = []

    def __init__(self, args):
        pass

    def call(self, method, request):
        assert method == "GetJob" and request.name == self.job.spec.name
        return pb.JobResponse(job=self.job)

    def stream(self, method, request):
        assert method == "WatchEvents"
        if set(request.kinds) == {"checkpoint_interval"}:  # status JOB: an "auto" interval
            return iter([e for e in self.events if e.kind == "checkpoint_interval"])
        assert set(request.kinds) == {"start", "recovery"}
        return iter(self.events)


def run(monkeypatch, job, *argv, events=()):
    FakeClient.job, FakeClient.events = job, list(events)
    monkeypatch.setattr(cli, "Client", FakeClient)
    out = io.StringIO()
    assert cli.run(cli.build_parser().parse_args(list(argv)), out) == 0
    return out.getvalue()


def a_job(tmp_path, nnodes=1, split=True):
    return pb.JobStatus(
        spec=pb.JobSpec(name="j", tp=1, pp=2, dp=2, total_steps=10, nnodes=nnodes),
        state=pb.RUNNING, desired_state=pb.RUNNING, step=6, loss=math.nan, node="head",
        run_dir=str(tmp_path / "jobs" / "j"),
        step_split=split_to_proto(service(analysed(*BEATS)).step_split("j")) if split else None)


def test_status_prints_the_split_under_the_job_and_in_json(monkeypatch, tmp_path):
    text = run(monkeypatch, a_job(tmp_path), "status", "j")
    assert text.splitlines()[0].startswith("NAME") and "j " in text.splitlines()[1]
    assert "step-time split, seconds, sampled step 6" in text and "ABOVE TARGET" in text
    data = json.loads(run(monkeypatch, a_job(tmp_path), "status", "j", "--json"))
    sp = data["step_split"]
    assert [s["stage"] for s in sp["stages"]] == [0, 1]
    assert sp["stages"][1]["dp_reduce_s"] == 0.08 and sp["stages"][0]["bubble"] == 0.31
    assert sp["targets"] == {"bubble": 0.15, "reduce_to_forward": 0.3}
    assert sp["bubble_ok"] is False and sp["reduce_to_forward_ok"] is False
    # before the first sampled step: no split section, JSON null
    assert "step-time split" not in run(monkeypatch, a_job(tmp_path, split=False), "status", "j")
    data = json.loads(run(monkeypatch, a_job(tmp_path, split=False), "status", "j", "--json"))
    assert data["step_split"] is None


def test_logs_tensorboard_names_the_folder_the_host_and_the_viewer(monkeypatch, tmp_path):
    job = a_job(tmp_path)
    tb = tmp_path / "jobs" / "j" / "tensorboard"
    starts = [pb.Event(kind="start", rank=1, node="other"),
              pb.Event(kind="start", rank=0, node="gpu-a"),
              pb.Event(kind="recovery", rank=0, node="gpu-b")]
    text = run(monkeypatch, job, "logs", "j", "--tensorboard", events=starts)
    assert f"  {tb}\n" in text and "on host gpu-b" in text  # rank 0's newest start
    assert "not on this machine" in text
    assert f"view: tensorboard --logdir {tb} --bind_all" in text
    tb.mkdir(parents=True)
    (tb / "events.out.tfevents.1.gpu-b.1.0").write_bytes(b"")
    (tb / "events.out.tfevents.2.gpu-b.1.0").write_bytes(b"")
    assert "2 event file(s) here" in run(monkeypatch, job, "logs", "j", "--tensorboard")
    # multi-node: only rank 0's node has event files; the others have reports only
    text = run(monkeypatch, a_job(tmp_path, nnodes=2), "logs", "j", "--tensorboard",
               events=starts)
    assert "on host gpu-b, in that node's job directory" in text
    assert "the other nodes hold no event files" in text


def test_log_paths_list_every_file_kind():
    job = pb.JobStatus(spec=pb.JobSpec(name="j", nnodes=2), node="head", run_dir="/s/jobs/j")
    text = cli.log_paths_text(job)
    assert "files of j on node head" in text
    assert "/s/jobs/j/logs/ (agent.log, attempt-N/...)" in text
    assert "/s/jobs/j/reports/rank-*.jsonl  (other nodes' copies in reports/nodes/)" in text
    assert "/s/jobs/j/tensorboard/" in text and "ds3dctl events j" in text


def test_status_shows_the_newest_auto_interval_with_its_inputs(monkeypatch, tmp_path):
    """checkpoint.interval = "auto": the newest `checkpoint_interval` event, as text and JSON."""
    detail = {"interval_s": 762.6, "save_cost_s": 40.4, "mtbf_s": 7200.0, "failures": 3}
    events = [pb.Event(kind="checkpoint_interval", step=s, message=f"checkpoint every {s} s",
                       detail_json=json.dumps({**detail, "step": s})) for s in (10, 40)]
    text = run(monkeypatch, a_job(tmp_path, split=False), "status", "j", events=events)
    assert "checkpoint every 40 s (as of step 40)" in text and "every 10 s" not in text
    data = json.loads(run(monkeypatch, a_job(tmp_path, split=False), "status", "j", "--json",
                          events=events))
    assert data["checkpoint_interval"] == {**detail, "step": 40}
    # a job without "auto" has no such event, and no line
    assert "checkpoint every" not in run(monkeypatch, a_job(tmp_path, split=False), "status", "j")


def test_a_long_message_is_cut_in_the_table_and_whole_under_one_job(monkeypatch, tmp_path):
    """`ds3dctl status JOB` is where the runbook sends an operator for the reason a job failed:
    it was cut at 60 characters there too ('... restarts used); rai'). A job not training shows
    no rate and no ETA (a FAILED job read 'ETA 0:00:00', a paused one its last rate's ETA)."""
    reason = ("agent_exit: restart budget spent (5 of 3 restarts used); raise "
              "launch.max_restarts or fix the cause and start a new job")
    job = a_job(tmp_path, split=False)
    job.state, job.message, job.tokens_per_s, job.eta_s = pb.FAILED, reason, 7.0, 0.0
    one = run(monkeypatch, job, "status", "j")
    row = one.splitlines()[1]
    assert reason[:59] + "…" in row and reason not in row
    assert f"message: {reason}" in one
    assert row.split()[4:6] == ["-", "-"]  # TOKENS/S, ETA
    job.state = pb.RUNNING
    assert run(monkeypatch, job, "status", "j").splitlines()[1].split()[4:6] == ["7", "0:00:00"]
