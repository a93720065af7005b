"""One error hierarchy for all of ds3d.

Every error a user can cause or act on is a `Ds3dError`: its message says what was wrong and what
to do, and its `grpc_code` names the gRPC status the daemon answers with (as a string, so that this
module imports nothing and neither storage nor the trainer depends on grpc). Anything else that
escapes is a bug, logged with its traceback but never shown to a client.

It lives in the lowest layer (storage) because every layer raises these: `checkpoints/` itself,
the trainer (`ds3d.trainer.errors` re-exports them) and the daemon (`daemon/errors.py` maps them
to gRPC status codes). Each class is defined here only, so `isinstance` holds across layers.
"""

from __future__ import annotations


class Ds3dError(Exception):
    """Base of every error ds3d reports to a person. Terminal unless a subclass says otherwise."""

    grpc_code = "INTERNAL"
    retryable = False


class ConfigError(Ds3dError):
    """A job configuration (TOML, preset, override or request) that cannot run as given."""

    grpc_code = "INVALID_ARGUMENT"


class NotFoundError(Ds3dError):
    """A named thing (job, checkpoint, preset file) does not exist."""

    grpc_code = "NOT_FOUND"


class StateError(Ds3dError):
    """The request is valid but not in the object's current state (pause a stopped job)."""

    grpc_code = "FAILED_PRECONDITION"


class AlreadyExistsError(Ds3dError):
    grpc_code = "ALREADY_EXISTS"


class PermissionError_(Ds3dError):
    """Credentials missing or wrong (bearer token, S3 keys)."""

    grpc_code = "PERMISSION_DENIED"


class StorageError(Ds3dError):
    """Object storage refused or failed an operation."""

    grpc_code = "UNAVAILABLE"


class TransientStorageError(StorageError):
    """An outage (connection refused, 5xx, timeout): worth retrying with backoff."""

    retryable = True


class CheckpointError(Ds3dError):
    """A checkpoint is missing, incomplete, corrupt, or cannot be restored into this layout."""

    grpc_code = "FAILED_PRECONDITION"


class RestoreError(CheckpointError):
    """A restore that failed at this start (a node could not get the step rank 0 chose, a
    conversion to a new layout failed, DeepSpeed found nothing to load): not a refusal of the
    job's configuration. The worker group is restarted, and the daemon acts on a checkpoint
    that keeps failing (daemon/load_failures.py) or the restart budget ends the loop."""

    retryable = True
