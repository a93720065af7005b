"""What the workers' sampled step-time splits say: stragglers, pipeline bubble, slow
data-parallel reduction, each as a diagnosis that names the cause and the fix.

Every rank reports, on sampled steps (`train.timing_interval`), a heartbeat with its split
(trainer/step_timing.py): forward, backward, optimizer, pipeline wait, DP reduction and its
compute time (forward + backward + optimizer, no waiting). Synchronous training makes every
rank's wall step time equal, so the straggler signal is compute time: the slow rank computes
longer, the others wait for it.

But the tensor-parallel all-reduces sit inside forward and backward: a slow rank's TP peers wait
for it there, and their compute time grows by as much as its own (a probe: 0.529 s and 0.528 s
for the slow rank and its peer, the named one a rounding accident). So each rank's own compute
is its compute time less `tp_wait`, the time it spent inside those all-reduces (measured by the
workers, trainer/tensor_parallel.py `TP_WAIT`): the slow rank waits least. Workers that report
no `tp_wait` cannot tell a TP group's ranks apart; the group is then named as such, not one rank
of it. The reference is the median of the other ranks (with four ranks, the median of all is the
mean of a fast and a slow one when a whole TP group of two looks slow).

One sampled step is not enough: a rank descheduled for 100 ms on a loaded host, or still warming
up on the first sample (step 2, under torch.compile still compiling), looks like a straggler for
that step (CI saw rank 3 named at step 2 of a job whose slowdown began at step 7), and its
bubble or reduction time are as noisy. Each diagnosis is raised once what it says held on
`samples` sampled steps in a row: the same slow rank (or TP group), a bubble or a reduction over
its target; a sample that says otherwise starts the count again.

A detector (the supervisor's `Detector` protocol) that never restarts anything: its faults are
diagnoses (event kind `diagnosis`), each kind raised once per cooldown.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from ds3d.trainer.kinds import EventKind, RecordKind

from .detectors import Fault
from .metrics import Metrics
from .reports import Observation
from .store import Job

BUBBLE_TARGET = 0.15           # the seed's tuning targets
REDUCE_TO_FORWARD_TARGET = 0.30


# the parts of a sampled step's split (trainer/step_timing.py), each a ds3d_step_time_split_seconds
SPLIT_PARTS = ("forward", "backward", "optimizer", "p2p_wait", "dp_reduce", "data")


class StepAnalysis:
    def __init__(self, straggler_factor: float = 1.5, straggler_min_gap_s: float = 0.05,
                 samples: int = 2, cooldown_s: float = 600.0) -> None:
        self.factor, self.min_gap_s, self.cooldown_s = straggler_factor, straggler_min_gap_s, \
            cooldown_s
        self.samples = samples
        # diagnosis kind -> (what it names: the slow rank or TP group, or (); its newest sampled
        # step; sampled steps in a row it held)
        self._streaks: dict[str, tuple[tuple[int, ...], int, int]] = {}
        self.splits: dict[int, dict[str, Any]] = {}  # rank -> newest sampled split (+ stage, node)
        self._raised: dict[tuple[str, int], float] = {}  # (kind, -1) -> monotonic time
        self._pending: list[Fault] = []
        self._exported: set[int] = set()  # ranks with a ds3d_rank_step_seconds series
        self._tp: tuple[str, int] | None = None  # (the job's config text, its parallel.tp)

    # -- Detector ---------------------------------------------------------------------------

    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None:
        if job is not None:
            self._note_tp(job)
        if obs.kinds(RecordKind.START):
            self.splits.clear()  # a new group: ranks may have other roles now
            self._streaks.clear()
        fresh = False
        for rec in obs.kinds(RecordKind.HEARTBEAT):
            split = rec.get("split")
            if isinstance(split, dict) and isinstance(split.get("compute_s"), int | float):
                self.splits[int(rec.get("rank", -1))] = {
                    **split, "stage": int(rec.get("stage", 0)), "node": rec.get("node", ""),
                    "step": int(rec.get("step", 0))}
                fresh = True
        if fresh:
            self._diagnose()
        return self._pending.pop(0) if self._pending else None

    # -- diagnoses --------------------------------------------------------------------------

    def _diagnose(self) -> None:
        self._straggler()
        newest = max(int(s.get("step", 0)) for s in self.splits.values())
        bubble = self.bubble()
        over = bubble is not None and bubble[0] > BUBBLE_TARGET
        if self._persists("pipeline_bubble", () if over else None, newest) and \
                bubble is not None:
            measured, theory = bubble
            m = next((s for s in self.splits.values() if "bubble" in s), {})
            self._raise("pipeline_bubble", -1, m.get("step"), (
                f"pipeline bubble {measured:.0%} of the step (target < {BUBBLE_TARGET:.0%}; "
                f"the 1F1B schedule alone gives {theory:.0%}): "
                + ("raise the micro-batches per step (train.global_batch_size / "
                   "micro_batch_size / dp) so that (p-1)/(m+p-1) falls"
                   if theory > BUBBLE_TARGET else
                   "the stages are unbalanced; re-split them by measured cost "
                   "(parallel.partition_method = \"measured\", or `ds3dctl rebalance`)")),
                {"bubble": measured, "bubble_theoretical": theory,
                 "sampled_steps": self.samples})
        ratio = self.reduce_to_forward()
        over = ratio is not None and ratio > REDUCE_TO_FORWARD_TARGET
        if self._persists("dp_reduce_slow", () if over else None, newest) and \
                ratio is not None:
            self._raise("dp_reduce_slow", -1, None, (
                f"data-parallel gradient reduction takes {ratio:.0%} of the forward time "
                f"(target < {REDUCE_TO_FORWARD_TARGET:.0%}): use a larger micro-batch (more "
                "compute per reduction), larger reduce buckets (train.deepspeed_config: "
                "reduce_bucket_size) with overlap_comm, or fewer DP ranks per node link"),
                {"reduce_to_forward": ratio, "sampled_steps": self.samples})

    def _note_tp(self, job: Job) -> None:
        text = getattr(job, "config_json", "")
        if self._tp is None or self._tp[0] != text:
            try:
                tp = int(json.loads(text)["parallel"]["tp"])
            except (ValueError, TypeError, KeyError):
                tp = 1
            self._tp = (text, max(1, tp))

    @property
    def tp(self) -> int:
        """The job's tensor-parallel size (1 when not known)."""
        return self._tp[1] if self._tp is not None else 1

    def tp_group(self, rank: int) -> list[int]:
        """The ranks of `rank`'s TP group: DeepSpeed's topology orders ranks tensor-parallel
        fastest (trainer/layout.py), so a group is `tp` consecutive ranks."""
        first = rank - rank % self.tp
        return [r for r in range(first, first + self.tp) if r in self.splits]

    def tp_waits(self) -> dict[int, float] | None:
        """Each rank's time inside the TP all-reduces (`tp_wait`), where every rank reports
        it (workers under torch.compile do not); else None."""
        waits = {r: s.get("tp_wait") for r, s in self.splits.items()}
        if all(isinstance(w, int | float) for w in waits.values()):
            return {r: float(w or 0.0) for r, w in waits.items()}
        return None

    def own_compute(self) -> dict[int, float]:
        """Each rank's compute time less its time inside the TP all-reduces, where every rank
        reports it; else compute time as it is."""
        compute = {r: float(s["compute_s"]) for r, s in self.splits.items()}
        waits = self.tp_waits()
        if waits is not None:
            return {r: max(0.0, c - waits[r]) for r, c in compute.items()}
        return compute

    def _straggler(self) -> None:
        if len(self.splits) < 2:
            return
        compute = {r: float(s["compute_s"]) for r, s in self.splits.items()}
        own = self.own_compute()
        waits = self.tp_waits()
        measured = waits is not None
        rank, worst = max(own.items(), key=lambda kv: (kv[1], -kv[0]))
        median = statistics.median(c for r, c in own.items() if r != rank)
        if median <= 0:  # nothing measured to compare with (every other rank's time all waits)
            return
        slow = sorted(r for r, c in own.items()
                      if c > self.factor * median and c - median > self.min_gap_s)
        s = self.splits[rank]
        group = self.tp_group(rank)
        # without tp_wait a TP group's ranks compute alike, the slowest of them by chance
        named = tuple(group) if not measured and len(group) > 1 and set(group) <= set(slow) \
            else (rank,)
        if not self._persists("straggler", named if slow else None, int(s.get("step", 0))):
            return
        where = f"stage {s['stage']}" + (f" on node {s['node']}" if s.get("node") else "")
        fix = (f"slow on {self.samples} sampled steps in a row; check that device and host "
               "(clocks, thermal throttling, ECC errors, other processes), and drain the node if "
               "it stays slow")
        detail: dict[str, Any] = {"compute_s": compute, "own_compute_s": own,
                                  "median_s": median, "slow_ranks": slow,
                                  "tp_wait_measured": measured, "sampled_steps": self.samples}
        if waits is not None:
            detail["tp_wait_s"] = waits
        if len(named) > 1:
            # its TP peers wait for it inside forward/backward: compute time cannot say which
            others = [r for r in slow if r not in group]
            names = ", ".join(str(r) for r in group[:-1]) + f" and {group[-1]}"
            self._raise("straggler", -1, s.get("step"), (
                f"straggler: ranks {names} (one tensor-parallel group, {where}) compute "
                f"{worst / median:.1f}x longer per step than the median of the other ranks "
                f"({', '.join(f'{compute[r]:.3f}' for r in group)} s vs {median:.3f} s; the "
                "others wait for them): one of them is slow and its tensor-parallel peers wait "
                "for it inside their all-reduces, which compute time alone cannot tell apart "
                "(these workers report no time in TP all-reduces, tp_wait)"
                + (f"; also slow: ranks {others}" if others else "")
                + f": {fix.replace('that device and host', 'those devices and hosts')}"),
                {**detail, "tp_group": group})
            return
        peers = [r for r in group if r != rank]
        peer_note = (f"; its tensor-parallel peer{'s' if len(peers) > 1 else ''} "
                     f"{', '.join(f'rank {r}' for r in peers)} wait"
                     f"{'' if len(peers) > 1 else 's'} for it inside the all-reduces ("
                     + ", ".join(f"{waits[r]:.3f} s" for r in peers) + f" vs its "
                     f"{waits[rank]:.3f} s)" if waits is not None and peers else "")
        also = [r for r in slow if r != rank]
        self._raise("straggler", rank, s.get("step"), (
            f"straggler: rank {rank} ({where}) computes {worst / median:.1f}x longer per "
            f"step than the median rank ({worst:.3f} s vs {median:.3f} s"
            + (", time inside tensor-parallel all-reduces left out" if measured and peers
               else "")
            + f"; the others wait for it){peer_note}"
            + (f"; also slow: ranks {also}" if also else "") + f": {fix}"),
            detail)

    def _persists(self, kind: str, named: tuple[int, ...] | None, step: int) -> bool:
        """Counts the sampled steps in a row on which diagnosis `kind` held, naming the ranks
        `named` (None: it did not hold); True once that is `self.samples`."""
        if named is None:
            self._streaks.pop(kind, None)
            return False
        prev = self._streaks.get(kind)
        if prev is None or prev[0] != named:
            prev = (named, step, 1)
        elif step > prev[1]:
            prev = (named, step, prev[2] + 1)
        self._streaks[kind] = prev
        return prev[2] >= self.samples

    def _raise(self, kind: str, rank: int, step: int | None, message: str,
               detail: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self._raised.get((kind, -1), -1e18) < self.cooldown_s:
            return
        self._raised[(kind, -1)] = now
        self._pending.append(Fault(kind, message, restart=False, rank=rank, step=step,
                                   detail=detail, kind=EventKind.DIAGNOSIS))

    # -- figures ----------------------------------------------------------------------------

    def bubble(self) -> tuple[float, float] | None:
        """(measured, theoretical): the mean over ranks of the newest sampled steps."""
        vals = [(s["bubble"], s["bubble_theoretical"]) for s in self.splits.values()
                if "bubble" in s]
        if not vals:
            return None
        return statistics.mean(v for v, _ in vals), vals[0][1]

    def reduce_to_forward(self) -> float | None:
        vals = [s["reduce_to_forward"] for s in self.splits.values() if "reduce_to_forward" in s]
        return max(vals) if vals else None

    def per_stage(self) -> list[dict[str, Any]]:
        """The newest sampled split per pipeline stage, for `ds3dctl status`: each part from
        the stage's slowest rank (as the step-split gauge), the bubble as the mean of the stage's
        ranks, reduce/forward as the largest."""
        stages: dict[int, list[dict[str, Any]]] = {}
        for s in self.splits.values():
            stages.setdefault(s["stage"], []).append(s)
        out = []
        for stage, ss in sorted(stages.items()):
            row: dict[str, Any] = {"stage": stage, "ranks": len(ss),
                                   "step": max(s["step"] for s in ss)}
            for part in (*SPLIT_PARTS, "compute_s", "step_s"):
                row[part] = max(float(s.get(part, 0.0)) for s in ss)
            bubbles = [float(s["bubble"]) for s in ss if "bubble" in s]
            ratios = [float(s["reduce_to_forward"]) for s in ss if "reduce_to_forward" in s]
            row["bubble"] = statistics.mean(bubbles) if bubbles else None
            row["reduce_to_forward"] = max(ratios) if ratios else None
            out.append(row)
        return out

    def export(self, metrics: Metrics, job: str) -> None:
        for rank in self._exported - set(self.splits):  # ranks of a group that is gone
            metrics.rank_step_seconds.remove(job, str(rank))
        self._exported = set(self.splits)
        for rank, own in self.own_compute().items():  # not waiting on other ranks (metrics.md)
            metrics.rank_step_seconds.labels(job, str(rank)).set(own)
        for row in self.per_stage():
            for part in SPLIT_PARTS:
                metrics.step_split.labels(job, str(row["stage"]), part).set(row[part])
        bubble = self.bubble()
        if bubble is not None:
            metrics.bubble.labels(job, "measured").set(bubble[0])
            metrics.bubble.labels(job, "theoretical").set(bubble[1])
        ratio = self.reduce_to_forward()
        if ratio is not None:
            metrics.reduce_to_forward.labels(job).set(ratio)
