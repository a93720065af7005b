"""The fit check at `ds3dctl start`: a job whose predicted peak memory per rank
(trainer/memory_model.py) does not fit this node's GPUs or host memory is refused before
anything is launched, with the per-rank breakdown and the smallest layout that fits.

Why: an OOM otherwise shows up only after minutes of process start, rendezvous and engine build,
on every restart of a crash loop. The node is the daemon's own (nodes of a job are assumed
alike); its GPUs are read with nvidia-smi (no torch import in the daemon), its memory with psutil.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import psutil

from ds3d.trainer.config import JobConfig
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.memory_model import NodeResources, breakdown, estimate, problems, smallest_fitting

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB|MB|MiB|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "mb": 10**6, "mib": 1 << 20, "gb": 10**9, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'141GB', '141 GiB', '80000MiB' or plain bytes -> bytes; a clear error otherwise."""
    m = _SIZE_RE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--report-gpu-memory {text!r}: give a positive size such as 141GB, "
                          "80GiB or 81920MiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def gpu_memory() -> list[int]:
    """Total memory of each GPU of this node, bytes (empty without NVIDIA GPUs or nvidia-smi)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(float(line)) << 20 for line in out.split() if line.strip()]  # MiB


def cpu_has_fp16(cpuinfo: str | None = None) -> bool | None:
    """Whether this x86 CPU has the fp16 instructions oneDNN's fp16 kernels need (the flags
    `avx512_fp16` or `amx_fp16` in /proc/cpuinfo: Intel Sapphire Rapids and later, not AMD
    EPYC), which DeepSpeed's CPU accelerator requires for fp16; None where it cannot tell
    (not x86 Linux). The workers check again with torch itself (trainer/layout.py)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), None)
    if flags is None or "avx2" not in flags:  # not an x86 CPU this heuristic knows
        return None
    return "avx512_fp16" in flags or "amx_fp16" in flags


def node_resources(reported_gpu_bytes: int | None = None,
                   reported_gpus: int = 1) -> NodeResources:
    """This node as the daemon sees it; `reported_gpu_bytes` (ds3dd --report-gpu-memory, for
    tests and dry runs) stands in for `reported_gpus` GPUs of that size."""
    host = psutil.virtual_memory().total
    if reported_gpu_bytes is not None:
        return NodeResources(reported_gpus, reported_gpu_bytes, host,
                             "reported by ds3dd --report-gpu-memory", cpu_has_fp16())
    gpus = gpu_memory()
    return NodeResources(len(gpus), min(gpus) if gpus else None, host,
                         "measured with nvidia-smi" if gpus else "no GPU", cpu_has_fp16())


def check_fit(cfg: JobConfig, node: NodeResources) -> None:
    """Raises ConfigError with the breakdown and a layout that fits when the job does not."""
    if cfg.launch.device == "cuda" and node.gpus == 0:  # the workers would crash at start
        raise ConfigError(f"job {cfg.name!r} asks for launch.device=\"cuda\" but this node has no "
                          f"GPU ({node.source}); use launch.device=\"cpu\", or \"auto\" (GPUs "
                          "where a node has them), or start it from a node with GPUs")
    on_cpu = cfg.launch.device == "cpu" or node.gpus == 0
    if on_cpu and cfg.train.precision == "fp16" and node.cpu_fp16 is False:
        raise ConfigError(f'job {cfg.name!r}: train.precision = "fp16" cannot run on this '
                          "node's CPU: it has neither AVX512-FP16 nor AMX-FP16, which DeepSpeed's "
                          'fp16 on a CPU needs (oneDNN). Set train.precision = "bf16" or "fp32" '
                          '(from a DeepSpeed config: "fp16": {"enabled": false}), or run the job '
                          "on GPUs")
    ranks_per_node = cfg.launch.nproc_per_node or max(1, cfg.parallel.world_size //
                                                      cfg.launch.nnodes)
    est = estimate(cfg)
    found = problems(est, node, ranks_per_node)
    if not found:
        return
    advice = smallest_fitting(cfg, node)
    if advice is None:
        fix = "no layout of up to 4096 GPUs like these fits; lower train.micro_batch_size"
    else:
        layout, _ = advice
        nodes = -(-layout.gpus // max(node.gpus, 1))
        fix = (f"the smallest layout that fits: {layout.describe()} ({nodes} node(s) like this "
               f"one): " + " ".join(f"--set {s}" for s in layout.sets()))
    raise ConfigError(f"job {cfg.name!r} will not fit this node: " + "; ".join(found) +
                      f".\n{fix}\n{breakdown(est)}")
