"""Restart policy: whether and when a faulted worker group is started again.

ds3d counts restarts itself (the elastic agent's `max_restarts` can be bypassed by a fast
exit-and-rejoin, pytorch#147064): every relaunch by the daemon and every group restart reported
by the workers count against one budget, `launch.max_restarts` restarts in a row without
progress. Progress is a checkpoint committed past the newest one at the previous restart: a
weeks-long job whose hardware fails every few hours trains on through any number of independent
faults, while a crash loop (the same failure before any new checkpoint, Megatron-LM#5281's 44
restarts) spends the budget and fails. The delay grows exponentially so that a crash loop does
not burn the budget in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds3d.trainer.config import JobConfig

from .store import Job


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float
    reason: str


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0

    def decide(self, restarts_so_far: int, cause: str) -> Decision:
        if restarts_so_far >= self.max_restarts:
            return Decision(False, 0.0, f"{cause}: restart budget spent ({restarts_so_far} of "
                            f"{self.max_restarts} restarts used, in a row without a new "
                            "checkpoint); raise launch.max_restarts or fix the cause and start a "
                            "new job")
        delay = min(self.max_delay_s, self.base_delay_s * 2 ** restarts_so_far)
        return Decision(True, delay, f"{cause}: restart {restarts_so_far + 1} of "
                        f"{self.max_restarts} in {delay:.0f} s")


def restart_policy_for(cfg: JobConfig) -> RestartPolicy:
    """ds3dd's policy for a job: its `launch.max_restarts`, delays 1, 2, 4 ... 60 s."""
    return RestartPolicy(max_restarts=cfg.launch.max_restarts)


def restarts_in_a_row(job: Job) -> int:
    """The restarts the budget counts now: those since the job last made progress (a
    checkpoint committed past `progress_mark`, the newest one at the previous restart); 0 once
    it has."""
    return job.restarts_in_a_row if job.last_ckpt_step <= job.progress_mark else 0


def counted_restarts(job: Job, n: int = 1) -> dict[str, int]:
    """The job's columns after `n` more restarts: the total (status, metrics) and the budget's
    count, marked at the newest committed checkpoint."""
    return {"restarts": job.restarts + n, "restarts_in_a_row": restarts_in_a_row(job) + n,
            "progress_mark": job.last_ckpt_step}
