"""The DeepSpeed config the workers get, built from the job's own fields only, and DeepSpeed's
own parser as a check of it before launch.

Why one builder from fields: job.json, `ds3dctl status` and the engine then cannot disagree
(a user's DeepSpeed JSON is translated into fields first: trainer/ds_config_import.py).
Why DeepSpeed's parser at submission: what DeepSpeed would refuse in every worker after a
restart loop is refused once, before any process starts, in DeepSpeed's own words.

`build_deepspeed_config` imports nothing heavy; `deepspeed_verdict` imports deepspeed (~1.5 s),
only when called.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from typing import Any

from .errors import ConfigError

_NEVER = 2**31 - 1  # DeepSpeed's steps_per_print when ds3d reports steps itself
# one parse at a time: it swaps process-wide state (sys.stdout, deepspeed.comm.get_rank, the
# DeepSpeed logger's level), and ds3dd parses in its RPC threads, several StartJobs at once
_PARSE_LOCK = threading.Lock()


def build_deepspeed_config(cfg: Any, dp: int, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON for job `cfg` at data-parallel degree `dp` (which may differ from the
    configured one after an elastic reshape: the global batch is kept, accumulation
    recomputed)."""
    t, p = cfg.train, cfg.parallel
    gas = t.grad_accum(dp)
    zero: dict[str, Any] = {"stage": p.zero_stage}
    zero.update({k: v for k, v in p.zero_options.model_dump().items() if v is not None})
    ds: dict[str, Any] = {
        "train_batch_size": t.micro_batch_size * gas * dp,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": t.steps_per_print or _NEVER,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0,
                 "initial_scale_power": t.initial_scale_power,
                 "loss_scale_window": t.loss_scale_window, "hysteresis": t.hysteresis,
                 "min_loss_scale": t.min_loss_scale},
    }
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    if t.precision == "bf16" and p.zero_stage == 1:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}  # fp32 master weights and accumulation
    return ds


class _DataParallelGroup:
    """What DeepSpeedConfig asks an `mpu` for: the DP world size it checks batch sizes with."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def deepspeed_verdict(ds: dict[str, Any], dp: int) -> str | None:
    """DeepSpeed's own config parser on `ds` as rank 0 of `dp` data-parallel ranks, without a
    process group. None when it accepts the config, else its message (one line)."""
    return _parse_verdict(dict(ds), dp)


def check_with_deepspeed(cfg: Any) -> dict[str, Any]:
    """The DeepSpeed config of `cfg` at its configured DP, accepted by DeepSpeed's parser, or a
    ConfigError with DeepSpeed's message."""
    ds = build_deepspeed_config(cfg, cfg.parallel.dp)
    verdict = deepspeed_verdict(ds, cfg.parallel.dp)
    if verdict is not None:
        raise ConfigError(f"job {cfg.name!r}: DeepSpeed refuses the config ds3d would give it "
                          f"({verdict}); `ds3dctl check` prints that config")
    return ds


def deepspeed_file_verdict(path: str, dp: int) -> str | None:
    """DeepSpeed's own parser on a raw config file, as `deepspeed.initialize` would read it
    (hjson) at `dp` data-parallel ranks: None if it accepts the file, else its message."""
    return _parse_verdict(path, dp)


def _parse_verdict(config: dict[str, Any] | str, dp: int) -> str | None:
    """DeepSpeedConfig(config) as rank 0 of `dp` ranks (get_rank patched: no process group),
    quietly; None when accepted, else the refusal in one line."""
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    with _PARSE_LOCK:
        quiet = logging.getLogger("DeepSpeed")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        saved = ds_comm.get_rank
        ds_comm.get_rank = lambda *a, **k: 0  # type: ignore[assignment]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                DeepSpeedConfig(config, mpu=_DataParallelGroup(dp))
        except Exception as e:  # noqa: BLE001 - any refusal of DeepSpeed's parser is the verdict
            return _one_line(e)
        finally:
            ds_comm.get_rank = saved  # type: ignore[assignment]
            quiet.setLevel(level)
        return None


def _one_line(e: Exception) -> str:
    """An exception as one line: pydantic's header and its first field, or the message."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' / '.join(lines[:2])}"[:300]
