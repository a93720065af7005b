"""Where this process sits in the (pipe, data, model) grid, built from one topology object.

DeepSpeed's `PipeModelDataParallelTopology` orders ranks pipe-major, tensor-parallel fastest, so a
TP group is made of consecutive ranks (on one node when TP <= GPUs per node: TP's all-reduces are
the most frequent and must stay on NVLink). The same topology is handed to the PipelineModule;
`PipelineParallelGrid` builds the TP, PP and DP process groups from it and serves as the `mpu`
DeepSpeed uses for gradient clipping and checkpoint naming.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from .config import JobConfig, validate_job
from .tensor_parallel import TPGroup


@dataclass(frozen=True)
class ProcessEnv:
    """What torch.distributed.elastic tells a worker through its environment."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int
    run_id: str

    @classmethod
    def from_env(cls) -> ProcessEnv:
        return cls(rank=int(os.environ.get("RANK", 0)),
                   world_size=int(os.environ.get("WORLD_SIZE", 1)),
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                   restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   run_id=os.environ.get("TORCHELASTIC_RUN_ID", "local"))


def pick_device(cfg: JobConfig, local_rank: int) -> torch.device:
    want = cfg.launch.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_precision(cfg: JobConfig, device: torch.device) -> None:
    """Refuses (ConfigError: the job FAILS at once, not a restart loop) a precision this device
    cannot run, which DeepSpeed's engine would otherwise reject with a bare ValueError ("Type
    fp16 is not supported on your device") at every restart. On a CPU, fp16 needs oneDNN's
    fp16 kernels (AVX512-FP16 or AMX-FP16: Intel Sapphire Rapids and later; not AMD EPYC)."""
    from deepspeed.accelerator import get_accelerator

    precision = cfg.train.precision
    accelerator = get_accelerator()
    supported = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}
    if precision not in supported or supported[precision]():
        return
    from .errors import ConfigError

    hint = " (oneDNN has no fp16 kernels for this CPU: AVX512-FP16 or AMX-FP16 are missing)" \
        if device.type == "cpu" and precision == "fp16" else ""
    raise ConfigError(
        f'train.precision = "{precision}" cannot run on this {device.type} device{hint}: '
        f"DeepSpeed's {accelerator.device_name()} accelerator does not support it. Set "
        f'train.precision = "bf16" or "fp32" (from a DeepSpeed config: "{precision}": '
        '{"enabled": false}), or run the job where ' + precision + " is supported")


def init_distributed(device: torch.device, timeout: timedelta) -> None:
    """NCCL on GPU, gloo on CPU; the collective timeout turns a stuck collective into an error
    (the daemon's hang detector usually fires first)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                                   timeout=timeout)


class ParallelLayout:
    """The topology, the process groups built from it, and this rank's coordinates."""

    def __init__(self, cfg: JobConfig, env: ProcessEnv) -> None:
        from deepspeed.runtime.pipe.topology import (
            PipelineParallelGrid,
            PipeModelDataParallelTopology,
        )

        p = cfg.parallel
        validate_job(cfg, world_size=env.world_size)
        self.topology = PipeModelDataParallelTopology(num_pp=p.pp, num_mp=p.tp, num_dp=p.dp)
        self.grid = PipelineParallelGrid(topology=self.topology)
        coord = self.topology.get_coord(env.rank)
        self.rank, self.world_size = env.rank, env.world_size
        self.tp_size, self.pp_size, self.dp_size = p.tp, p.pp, p.dp
        self.tp_rank, self.stage, self.dp_rank = coord.model, coord.pipe, coord.data
        self.tp = TPGroup(self.grid.get_slice_parallel_group(), self.tp_rank, p.tp)

    def describe(self) -> dict[str, int]:
        return {"world_size": self.world_size, "tp": self.tp_size, "pp": self.pp_size,
                "dp": self.dp_size, "stage": self.stage, "dp_rank": self.dp_rank,
                "tp_rank": self.tp_rank}
