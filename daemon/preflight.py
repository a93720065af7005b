"""Checks made at `ds3dctl start`, before anything is launched, of what would otherwise only fail
once the workers run (and then in a crash loop): the checkpoint store's credentials, bucket and
permissions, the data file, and the etcd members of `launch.rendezvous`. Each failure keeps its
own error type, so the client gets the right status code (PERMISSION_DENIED for wrong keys,
NOT_FOUND for a missing bucket, UNAVAILABLE for an unreachable endpoint) with what to fix."""

from __future__ import annotations

from pathlib import Path

from ds3d.checkpoints.identity import check_owner, claim_prefix
from ds3d.checkpoints.layout import JOB_ID_KEY
from ds3d.checkpoints.storage import job_store_url, join_url, open_storage
from ds3d.trainer.config import JobConfig, is_readable_file
from ds3d.trainer.errors import ConfigError, Ds3dError

from .rendezvous import RendezvousError, etcd_problem

# Fail fast at submission: an outage is reported, not waited out (the job can be started again).
_PREFLIGHT_S3 = {"max_attempts": 2, "outage_retries": 0, "connect_timeout": 3.0,
                 "read_timeout": 10.0}


def preflight(cfg: JobConfig, job_id: str = "", run_dir: Path | None = None) -> None:
    """Raises what is wrong (nothing is created before the store check, which comes last).
    With `job_id`, a store prefix owned by another job (checkpoints/identity.py) is refused
    before anything is written there, and once every check has passed the job claims it;
    `run_dir` is where the default file store would be."""
    source = cfg.data.source
    # "indexed": the blend's files were opened by validate_job
    if source not in ("synthetic", "indexed") and not is_readable_file(source) \
            and not cfg.launch.hosts[1:]:
        raise ConfigError(f"data.source={source!r} does not exist on this node; give the path of "
                          "a token file every node can read (see `python -m ds3d.trainer.data "
                          "encode`)")
    down = [p for p in (etcd_problem(h, port) for h, port in cfg.launch.etcd_endpoints) if p]
    if down:  # every listed member: the agents fail over among them
        raise RendezvousError(f"launch.rendezvous {cfg.launch.rendezvous!r} is not usable, so the "
                              f"job was not started: {'; '.join(down)}. Start etcd there (see "
                              "docs/runbook.md, \"etcd rendezvous\") or fix launch.rendezvous")
    # last: the store check creates the job's prefix (and a probe object it deletes)
    store = cfg.checkpoint.store
    if store:
        url = join_url(store, cfg.name)  # the job's prefix, as its workers will use it
        try:
            storage = open_storage(url, **(_PREFLIGHT_S3 if url.startswith("s3://") else {}))
            if job_id:  # read-only, before check_access writes its probe
                check_owner(storage, job_id, cfg.name)
            storage.check_access()
            if job_id:  # every check passed: the prefix is this job's (one winner of a race)
                claim_prefix(storage, job_id, cfg.name)
        except Ds3dError as e:
            raise type(e)(f"checkpoint.store {store!r} is not usable, so the job was not "
                          f"started: {e}") from None
    elif job_id and run_dir is not None:  # the default store: a folder left in the job's run dir
        default = open_storage(job_store_url(None, cfg.name, run_dir))
        if default.exists(JOB_ID_KEY):
            check_owner(default, job_id, cfg.name)
