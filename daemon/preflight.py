"""Checks made at `ds3dctl start`, before anything is launched, of what would otherwise only fail
once the workers run (and then in a crash loop): the checkpoint store's credentials, bucket and
permissions, and the data file. Each failure keeps its own error type, so the client gets the
right status code (PERMISSION_DENIED for wrong keys, NOT_FOUND for a missing bucket,
UNAVAILABLE for an unreachable endpoint) with what to fix."""

from __future__ import annotations

from ds3d.trainer.config import JobConfig, is_readable_file
from ds3d.trainer.errors import ConfigError, Ds3dError

# Fail fast at submission: an outage is reported, not waited out (the job can be started again).
_PREFLIGHT_S3 = {"max_attempts": 2, "outage_retries": 0, "connect_timeout": 3.0,
                 "read_timeout": 10.0}


def preflight(cfg: JobConfig) -> None:
    source = cfg.data.source
    if source != "synthetic" and not is_readable_file(source) and not cfg.launch.hosts[1:]:
        raise ConfigError(f"data.source={source!r} does not exist on this node; give the path of "
                          "a token file every node can read (see `python -m ds3d.trainer.data "
                          "encode`)")
    # last: the store check creates the job's prefix (and a probe object it deletes)
    store = cfg.checkpoint.store
    if store:
        from ds3d.checkpoints.storage import join_url, open_storage

        url = join_url(store, cfg.name)  # the job's prefix, as its workers will use it
        try:
            storage = open_storage(url, **(_PREFLIGHT_S3 if url.startswith("s3://") else {}))
            storage.check_access()
        except Ds3dError as e:
            raise type(e)(f"checkpoint.store {store!r} is not usable, so the job was not "
                          f"started: {e}") from None
