"""The restart budget (daemon/policies.py): `launch.max_restarts` restarts in a row without
progress. A crash loop spends it and the job fails; a long job whose faults are independent
(a new checkpoint committed between them) trains on through any number of them."""

from __future__ import annotations

from ds3d.daemon.policies import RestartPolicy, counted_restarts, restarts_in_a_row
from ds3d.daemon.store import Store


def restart(job_store: Store, policy: RestartPolicy) -> bool:
    """One fault: the policy's decision on the stored job, counted as a restart if it allows."""
    job = job_store.get_job("j")
    decision = policy.decide(restarts_in_a_row(job), "worker_exit")
    if decision.restart:
        job_store.update("j", **counted_restarts(job))
    return decision.restart


def test_a_crash_loop_spends_the_budget(job_store):
    policy = RestartPolicy(max_restarts=3)
    job_store.update("j", last_ckpt_step=10)  # progress before the loop began counts for nothing
    assert [restart(job_store, policy) for _ in range(4)] == [True, True, True, False]
    job = job_store.get_job("j")
    assert (job.restarts, job.restarts_in_a_row, job.progress_mark) == (3, 3, 10)
    reason = policy.decide(restarts_in_a_row(job), "worker_exit").reason
    assert reason.startswith("worker_exit: restart budget spent (3 of 3 restarts used, in a "
                             "row without a new checkpoint)"), reason


def test_independent_faults_with_progress_between_them_never_spend_it(job_store):
    policy = RestartPolicy(max_restarts=2)
    for fault in range(10):
        assert restart(job_store, policy), f"fault {fault}"
        job_store.update("j", last_ckpt_step=100 * (fault + 1))  # trained on, committed a new one
    job = job_store.get_job("j")
    assert job.restarts == 10 and restarts_in_a_row(job) == 0 and job.restarts_in_a_row == 1


def test_an_older_checkpoint_committed_again_is_not_progress(job_store):
    """After a rollback the steps up to the old newest checkpoint are trained again: saving
    them again is no progress (the daemon's last_ckpt_step never goes back)."""
    policy = RestartPolicy(max_restarts=1)
    job_store.update("j", last_ckpt_step=50)
    assert restart(job_store, policy)
    job_store.update("j", last_ckpt_step=50)
    assert not restart(job_store, policy)
    job_store.update("j", last_ckpt_step=52)
    assert restart(job_store, policy)


def test_group_restarts_count_together(job_store):
    job = job_store.get_job("j")
    job_store.update("j", **counted_restarts(job, 2))
    job = job_store.get_job("j")
    assert (job.restarts, restarts_in_a_row(job)) == (2, 2)


def test_a_new_leader_takes_the_count_over():
    """etcd mode: the leader's published record carries the count, so that a crash loop does
    not start over with each new leader; records of older and newer daemons still parse."""
    import json

    from ds3d.daemon.job_leadership import JobRecord

    rec = JobRecord("j", "id", "{}", "a:1", 1, "RUNNING", "RUNNING", 4, 10, 0.0, 8, 2, [],
                    restarts_in_a_row=2, progress_mark=8)
    back = JobRecord.parse(rec.dump())
    assert back == rec
    older = json.loads(rec.dump())
    del older["restarts_in_a_row"], older["progress_mark"]
    assert (JobRecord.parse(json.dumps(older)).restarts_in_a_row,
            JobRecord.parse(json.dumps(older)).progress_mark) == (0, -1)
    newer = {**json.loads(rec.dump()), "a_later_field": 1}
    assert JobRecord.parse(json.dumps(newer)) == rec


def test_status_shows_the_budget_of_a_job_that_restarted(job_store, tmp_path):
    """GetJob carries the budget's count beside the total; `ds3dctl status JOB` says both."""
    from ds3d.daemon.api import job_to_proto
    from ds3d.daemon.cli import budget_text, job_dict
    from ds3d.trainer.config import build_job_config

    cfg = build_job_config("tiny", ["launch.max_restarts=3"], name="b")
    job_store.create_job("b", cfg.dump_json(), "n", str(tmp_path / "b"))
    assert budget_text(job_to_proto(job_store.get_job("b"))) is None  # never restarted
    job_store.update("b", restarts=4, restarts_in_a_row=1, progress_mark=20, last_ckpt_step=20)
    status = job_to_proto(job_store.get_job("b"))
    assert (status.restarts, status.restarts_in_a_row) == (4, 1)
    assert job_dict(status)["restarts_in_a_row"] == 1
    assert budget_text(status) == ("restart budget: 1 of 3 used (restarts in a row without a "
                                   "new checkpoint; 4 restarts in all)")
    job_store.update("b", last_ckpt_step=30)  # progress since the last restart: the budget is whole
    assert job_to_proto(job_store.get_job("b")).restarts_in_a_row == 0
