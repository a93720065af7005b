"""Which failures of a checkpoint's load are the checkpoint's.

A load that raises after every hash verified has two kinds of cause: the checkpoint itself (a
writer's bug, a key or shape the model does not have: DeepSpeed's strict load refuses it on every
try), or the moment (a peer lost during the load's collectives, memory). Only the first is
reported (a `checkpoint` record, phase `load_failed`): the daemon rolls back past a step whose
load failed in two worker groups (daemon/load_failures.py), where restarting it again would spend
the restart budget on the same error and fail the job.
"""

from __future__ import annotations

from .oom import is_oom

# what gloo and NCCL say when a peer of a collective is gone or the network fails
_PEER_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe",
                 "timed out", "timeout")


def checkpoint_at_fault(exc: BaseException) -> bool:
    """True unless the error is an allocation failure, a collective's (peer, network) or the
    disk's at that moment (EIO, ENOSPC: the bytes verified just before). A file the load looks
    for and does not find is the checkpoint's (another layout's file names)."""
    import torch.distributed as dist

    if is_oom(exc) or isinstance(exc, dist.DistError):
        return False
    if isinstance(exc, OSError) and \
            not isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError):
        return False
    text = str(exc).lower()
    return not any(m in text for m in _PEER_MARKERS)


def brief(exc: BaseException, limit: int = 500) -> str:
    """`Type: message`, on one line and short enough for an event."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
