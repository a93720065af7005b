"""Prometheus metrics of one daemon (served on --metrics-port).

Names follow Prometheus conventions (`_total` counters, base units: seconds, bytes). Labels are
bounded: job names, pipeline stages and a fixed set of causes/states/parts, never steps. One
exception: `ds3d_rank_step_seconds` has a `rank` label, because naming the slow rank is its
purpose (a straggler hides in any aggregate); it is one series per rank of the job.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .states import JobState

# The `problem` label of ds3d_checkpoint_problems_total (a fixed set, never a step)
CHECKPOINT_PROBLEMS = ("skipped", "abandoned", "failed", "cleanup_failed", "load_failed",
                       "reshape_failed", "corrupt", "missing", "foreign")


class Metrics:
    """All metrics on their own registry, so that tests can create several daemons."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.job_state = Gauge("ds3d_job_state", "1 for the job's current state, 0 otherwise",
                               ["job", "state"], registry=r)
        self.step = Gauge("ds3d_job_step", "last completed optimizer step", ["job"], registry=r)
        self.loss = Gauge("ds3d_job_loss", "training loss at the last step", ["job"], registry=r)
        self.tokens_per_s = Gauge("ds3d_job_tokens_per_second",
                                  "training throughput, tokens per second over all ranks",
                                  ["job"], registry=r)
        self.restarts = Counter("ds3d_job_restarts_total", "worker-group restarts by cause",
                                ["job", "cause"], registry=r)
        self.faults = Counter("ds3d_job_faults_total", "faults detected by cause",
                              ["job", "cause"], registry=r)
        self.detect_seconds = Histogram(
            "ds3d_recovery_detect_seconds",
            "fault noticed - the last step before it, per recovered fault (daemon/incidents.py)",
            ["job", "cause"], buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r)
        self.recover_seconds = Histogram(
            "ds3d_recovery_seconds",
            "fault noticed - the first step after the recovery, per recovered fault",
            ["job", "cause"], buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r)
        self.steps_lost = Counter("ds3d_recovery_steps_lost_total",
                                  "steps trained again after a fault (rolled back or restarted "
                                  "from an older checkpoint)", ["job", "cause"], registry=r)
        self.checkpoint_blocked = Histogram(
            "ds3d_checkpoint_blocked_seconds", "seconds training was blocked by a save",
            ["job"], buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r)
        self.upload_bytes = Counter("ds3d_checkpoint_upload_bytes_total",
                                    "checkpoint bytes uploaded to the durable tier", ["job"],
                                    registry=r)
        self.checkpoint_problems = Counter(
            "ds3d_checkpoint_problems_total",
            "checkpoints a restore skipped (corrupt, incomplete, unreadable, foreign), uploads "
            "abandoned or failed, failed cleanups, and what reconciling the index with the store "
            "found (corrupt, missing, foreign); problem is one of CHECKPOINT_PROBLEMS",
            ["job", "problem"], registry=r)
        self.checkpoint_index_fixed = Counter(
            "ds3d_checkpoint_index_corrections_total",
            "checkpoint index rows the reconciliation with the store changed, by the new phase",
            ["job", "phase"], registry=r)
        self.last_commit = Gauge(
            "ds3d_checkpoint_last_commit_timestamp_seconds",
            "unix time of the newest committed checkpoint", ["job"], registry=r)
        self.goodput = Gauge(
            "ds3d_job_goodput_ratio",
            "useful training time / wall time since the job started (re-trained steps, restarts "
            "and blocked saves are not useful)", ["job"], registry=r)
        self.rank_step_seconds = Gauge(
            "ds3d_rank_step_seconds", "seconds per step of each rank (straggler signal)",
            ["job", "rank"], registry=r)
        self.step_split = Gauge(
            "ds3d_step_time_split_seconds",
            "where a step's time goes, per pipeline stage (slowest rank of the stage)",
            ["job", "stage", "part"], registry=r)
        self.bubble = Gauge(
            "ds3d_pipeline_bubble_ratio",
            "pipeline bubble fraction of the step: measured, and theoretical (p-1)/(m+p-1)",
            ["job", "kind"], registry=r)
        self.reduce_to_forward = Gauge(
            "ds3d_dp_reduce_to_forward_ratio",
            "data-parallel gradient reduction time / forward time", ["job"], registry=r)
        self.mfu = Gauge("ds3d_job_mfu_ratio",
                         "model FLOPs utilisation against the job's configured peak", ["job"],
                         registry=r)
        self.rpcs = Counter("ds3d_rpc_requests_total", "RPCs answered by method", ["method"],
                            registry=r)

    def set_state(self, job: str, state: JobState) -> None:
        for s in JobState:
            self.job_state.labels(job, s.name).set(1 if s is state else 0)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Starts the HTTP exporter; returns the bound port (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)
