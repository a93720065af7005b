"""ds3d's error hierarchy, under the trainer's name.

The classes are defined once, in the lowest layer (`ds3d.checkpoints.errors`), which storage,
the trainer and the daemon all import; this module re-exports them so that trainer and daemon
code keeps writing `from ds3d.trainer.errors import ConfigError`. They are the same classes, so
an error raised by storage is caught as `ds3d.trainer.errors.StorageError` too.
"""

from __future__ import annotations

from ds3d.checkpoints.errors import (
    AlreadyExistsError,
    CheckpointError,
    ConfigError,
    Ds3dError,
    NotFoundError,
    PermissionError_,
    StateError,
    StorageError,
    TransientStorageError,
)

__all__ = ["AlreadyExistsError", "CheckpointError", "ConfigError", "Ds3dError", "NotFoundError",
           "PermissionError_", "StateError", "StorageError", "TransientStorageError"]
