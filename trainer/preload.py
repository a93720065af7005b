"""The forkserver's last preload (daemon/agent.py TRAINER_PRELOAD): work every worker would
otherwise repeat after its fork, done once before it.

Each item showed in a restore's worker on an H100 (`DS3D_STARTUP_PROFILE`,
trainer/startup_profile.py; seconds under cProfile); none of it initialises CUDA, which a forked
child could not use:

* TensorBoard's writer, which rank 0 imports for its event files (0.3 s, on CPU);
* Triton's cache key, a hash of Triton's own files (libtriton alone is hundreds of MB) taken at
  the first kernel compile or cache lookup of each process (0.4 s of the first step);
* `gc.freeze()`, last: the objects every import above made (~325,000) move to the collector's
  permanent generation, so that a full collection no longer traverses them (0.15 s each on
  this repository's 2-core CPU, ~0 after the freeze): DeepSpeed's engine build runs six
  (its BF16_Optimizer reports memory with `see_memory_usage(force=True)`; 0.7-1.1 s of a
  worker's build), Python runs its own as the build allocates, and forked workers no longer
  dirty those pages by collecting them.
"""

from __future__ import annotations

import gc


def _import_tensorboard() -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401 - imported for its side effect
    except ImportError:  # TensorBoard not installed: the trainer says so when it needs it
        pass


def _triton_cache_key() -> None:
    try:
        from triton.runtime import cache
    except ImportError:  # no Triton (CPU installs)
        return
    key = getattr(cache, "triton_key", None)
    if callable(key):
        try:
            key()  # functools.lru_cache'd: the forked workers inherit the result
        except Exception:  # noqa: BLE001 - a warm-up only: the worker computes it as before
            pass


_import_tensorboard()
_triton_cache_key()
gc.freeze()
