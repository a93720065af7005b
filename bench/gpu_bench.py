"""GPU benchmark of the trainer and checkpoints, every number against a baseline of the same run.

One command does it all (each section in its own process, for a clean CUDA context); results are
appended to --out after every section, so a run cut short still leaves what it measured:

    python bench/gpu_bench.py --out bench/results/gpu.json            # ~1.4B GPT, one GPU
    python bench/gpu_bench.py --quick --device cpu --out /tmp/x.json   # dry run of the code paths

Sections:
  peak          bf16 matmul TFLOP/s (8192^3) and device-to-host GB/s into pinned / pageable memory
  minimal       the reference: a minimal GPT of the same size written independently of ds3d
                (bench/minimal_gpt.py: pre-LN, SDPA, learned positions, fused AdamW), in the
                obvious PyTorch loop (fp32 weights, autocast bf16)
  minimal_unfused_adam, minimal_math_attention
                the same without fused AdamW / without flash attention (SDPA's math path):
                what each fused kernel gains
  minimal_compile  the same + torch.compile
  deepspeed     plain DeepSpeed: ds3d's PipelineModule through deepspeed.initialize/train_batch,
                ZeRO-1, bf16, without ds3d's loop (no reports, no per-step agreement, no faults)
  deepspeed_unfused  the same with DS3D_FUSED_KERNELS=0 (eager rotary and cross-entropy)
  deepspeed_compile  the same with train.compile = true
  deepspeed_stock_bf16, deepspeed_compile_stock_bf16
                the same with DeepSpeed's own BF16_Optimizer paths (DS3D_DEEPSPEED_BF16=stock;
                ds3d's replacements: trainer/bf16_fastpath.py)
  memory_<name> peak GPU memory of a few steps of one configuration (MEMORY_CONFIGS), against
                trainer/memory_model.py's prediction
  ds3d          ds3d's whole worker loop (Trainer.run): reports, fault checks, command polling
  ds3d_compile  the same with train.compile = true (DeepSpeed engine.compile())
  profile       where the step time goes: CUDA kernel time by category (torch.profiler)
  checkpoint    training-blocked time of a save: DeepSpeed's synchronous save_checkpoint vs ds3d's
                snapshot, against the floor = state bytes / measured pinned D2H bandwidth
  pinning       page-locking a snapshot-sized host buffer with CUDA at once against in 1 GiB
                pieces (host_memory.register_in_pieces), beside a matmul loop: how much GPU work
                each lets through; and node memory's arena (a /dev/shm file) in 1 GiB and 64 MiB
                pieces; `populated`: the pages faulted in first (host_memory.populate), as the
                snapshot arena does since 12-06
  restore       process start -> first step after a restart, split into its parts
  restore_process_memory  the same with the snapshot arena in process memory, not node memory
                (checkpoint.keep_in_node_memory = false): what the /dev/shm file's pinning,
                beside the engine build, costs the restore
  restore_profiled  the same restore with the worker's training thread under cProfile
                (DS3D_STARTUP_PROFILE): where its build, load and first step spend their time
  goodput       a job under ds3d's node agent with a NaN, a crash and a spike in turn every
                --goodput-every s over --goodput-window s, against a fault-free run of the same
                invocation (issue 19 goal 6)
  rollback      an in-process rollback (NaN/spike) to the newest save, read from its host copy
                (the pinned snapshot arena) 3 steps after the save, against the floor = state
                bytes / host-to-device GB/s measured in the same section, and against reading
                the same checkpoint back from the local tier; both loads must give bit-equal
                weights and optimizer state. Run it alone (`--sections rollback`): it keeps one
                checkpoint of its own on disk and deletes it at the end

The restore and goodput sections start ds3d's node agent (`python -m ds3d.daemon.agent`), so
the ds3d package must be importable with its daemon (and `setproctitle` installed), not only
the trainer and checkpoints.

MFU counts (6 N T + 12 L d s T) FLOPs per step (T tokens, s sequence length; attention's
score and value matmuls, forward and backward) against 989 TFLOP/s (H100/H200 dense bf16
datasheet) and against the matmul peak measured in the `peak` section.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ["peak", "minimal", "minimal_compile", "deepspeed", "deepspeed_compile", "ds3d",
            "ds3d_compile"]
OPTIONAL = ["minimal_unfused_adam", "minimal_math_attention", "deepspeed_unfused",
            "deepspeed_stock_bf16", "deepspeed_compile_stock_bf16", "profile",
            "checkpoint", "restore", "restore_process_memory", "restore_profiled", "rollback",
            "goodput", "pinning"]
# (name, --set overrides of the bench job): sizes, micro-batches, checkpointing and ZeRO stages
MEMORY_CONFIGS = {
    "gpt1b_mb8": ["train.micro_batch_size=8"],
    "gpt1b_mb8_ckpt": ["train.micro_batch_size=8", "parallel.activation_checkpoint_interval=1"],
    "gpt1b_mb4": ["train.micro_batch_size=4"],
    "gpt1b_mb4_zero2": ["train.micro_batch_size=4", "parallel.zero_stage=2"],
    "gpt125m_mb16": ["model.d_model=768", "model.n_layers=12", "model.n_heads=12",
                     "train.micro_batch_size=16"],
    "gpt2b_mb2_ckpt": ["model.d_model=2560", "model.n_layers=32", "model.n_heads=20",
                       "train.micro_batch_size=2", "parallel.activation_checkpoint_interval=1"],
}
DATASHEET_BF16_TFLOPS = 989.0


# -- shared set-up ---------------------------------------------------------------------------


def job_sets(args) -> list[str]:
    dev = args.device
    if args.quick:
        model = ["model.vocab_size=8192", "model.d_model=512", "model.n_layers=4",
                 "model.n_heads=4", "model.seq_len=256", "train.micro_batch_size=2"]
    else:  # the gpt1b preset: d 2048, 24 layers, 16 heads of 128, seq 2048
        model = ["train.micro_batch_size=8"]
    prec = "bf16" if dev == "cuda" else "fp32"
    return model + ["train.grad_accum_steps=1", "train.global_batch_size=" +
                    ("2" if args.quick else "8"), f"train.precision=\"{prec}\"",
                    "parallel.zero_stage=1", "parallel.activation_checkpoint_interval=0",
                    f"launch.device=\"{dev}\"", "train.steps=100000", "train.warmup_steps=10",
                    "checkpoint.interval=0"]


def build_cfg(args, extra: list[str] | None = None):
    from ds3d.trainer.config import build_job_config

    return build_job_config("gpt1b", job_sets(args) + (extra or []), name="bench")


def flops_per_step(cfg) -> float:
    m = cfg.model
    tokens = cfg.train.global_batch(1) * m.seq_len
    return 6 * m.n_params() * tokens + 12 * m.n_layers * m.d_model * m.seq_len * tokens


def single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(k, v)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def summarize_steps(times: list[float], cfg, peak: float | None) -> dict:
    med = statistics.median(times)
    tokens = cfg.train.global_batch(1) * cfg.model.seq_len
    out = {"step_s": med, "step_s_min": min(times), "step_s_max": max(times),
           "tokens_per_s": tokens / med, "steps_timed": len(times),
           "mfu_datasheet": flops_per_step(cfg) / med / (DATASHEET_BF16_TFLOPS * 1e12)}
    if peak:
        out["mfu_measured_peak"] = flops_per_step(cfg) / med / (peak * 1e12)
    return out


def engine_stack(args, extra=None):
    """dist + layout + DeepSpeed engine for one process (NCCL on GPU, gloo on CPU)."""
    from datetime import timedelta

    import torch

    from ds3d.trainer.engine import TrainStep
    from ds3d.trainer.layout import ParallelLayout, ProcessEnv, init_distributed, pick_device

    single_process_env()
    cfg = build_cfg(args, extra)
    device = pick_device(cfg, 0)
    init_distributed(device, timedelta(minutes=10))
    layout = ParallelLayout(cfg, ProcessEnv.from_env())
    torch.manual_seed(0)
    return cfg, device, layout, TrainStep


# -- sections --------------------------------------------------------------------------------


def sec_peak(args) -> dict:
    import torch

    if args.device != "cuda":
        return {"skipped": "no GPU"}
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    tflops = 2 * n**3 / statistics.median(times) / 1e12
    size = 4 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda").random_()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)
    bw = {}
    for name, dst in (("pinned", pinned), ("pageable", pageable)):
        dst.copy_(src)
        torch.cuda.synchronize()
        bw[name] = _copy_GBps(dst, src, non_blocking=(name == "pinned"))
    return {"gpu": torch.cuda.get_device_name(), "bf16_matmul_tflops": tflops,
            "d2h_pinned_GBps": bw["pinned"], "d2h_pageable_GBps": bw["pageable"]}


def sec_minimal(args, compile_: bool = False, fused_adam: bool = True,
                attention: str = "auto") -> dict:
    """The minimal GPT (bench/minimal_gpt.py) in the obvious loop: no DeepSpeed, no ds3d; fp32
    weights, autocast bf16. `fused_adam=False` and `attention="math"` (SDPA's unfused reference
    path instead of the flash / cuDNN kernels) measure what each fused kernel gains."""
    import contextlib

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from minimal_gpt import MinimalConfig, MinimalGPT, make_optimizer

    from ds3d.trainer.data import BatchPlan

    cfg = build_cfg(args)
    m = cfg.model
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = MinimalGPT(MinimalConfig(m.vocab_size, m.d_model, m.n_layers, m.n_heads,
                                         m.seq_len))
    opt = make_optimizer(model, 1e-4, fused=device.type == "cuda" and fused_adam)
    step_model = torch.compile(model) if compile_ else model
    if attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attn_ctx = lambda: sdpa_kernel([SDPBackend.MATH])  # noqa: E731
    else:
        attn_ctx = contextlib.nullcontext
    plan = BatchPlan(cfg, 1, 0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def one_step(step: int) -> float:
        for x, y in plan.step_iterator(step):
            x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"), \
                    attn_ctx():
                loss = step_model(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out = timed_steps(args, cfg, device, one_step)
    out["parameters"] = sum(p.numel() for p in model.parameters())
    return out


def timed_steps(args, cfg, device, one_step) -> dict:
    """Warm-up and timed steps of `one_step(step) -> loss`; then, with --profile-dir, two more
    steps under torch.profiler, whose kernel table goes to <profile-dir>/<section>.txt."""
    import torch

    times, first, loss = [], None, float("nan")
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = one_step(step)
        sync(device)
        dt = time.perf_counter() - t0
        first = dt if first is None else first
        if step >= args.warmup:
            times.append(dt)
        progress("step", step=step, seconds=dt)
    out = summarize_steps(times, cfg, args.peak)
    out.update(first_step_s=first, final_loss=float(loss))
    if device.type == "cuda":
        out["max_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    if args.profile_dir and device.type == "cuda":
        out["profile"] = profile_steps(args, device, one_step, args.warmup + args.steps)
    return out


def profile_steps(args, device, one_step, first_step: int, n: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        for step in range(first_step, first_step + n):
            one_step(step)
        sync(device)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=60,
                                      max_name_column_width=90)
    by_shape = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_device_time_total", row_limit=25, max_name_column_width=40,
        max_shapes_column_width=70)
    path = Path(args.profile_dir) / f"{args.section}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{args.section}: {n} steps\n{table}\n\n{idle_gaps(prof, n)}\n\n"
                    f"ops by input shape (self device time):\n{by_shape}\n")
    return kernel_categories(prof, n)


def idle_gaps(prof, n: int, top: int = 25) -> str:
    """Where the GPU waits: gaps between consecutive kernels longer than 0.1 ms, the largest
    with the innermost CPU ops running during them (what the host was doing meanwhile)."""
    events = list(prof.events())
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    gaps, end = [], None
    idle_before: dict[str, list[float]] = {}  # every gap, by the kernel that ended it
    for a, b, name in kernels:
        if end is not None and a > end:
            idle_before.setdefault(name[:70], []).append(a - end)
            if a - end > 100:
                gaps.append((a - end, end, a))
        end = b if end is None else max(end, b)
    if not kernels:
        return "no GPU kernels profiled"
    cpu = [e for e in events if e.device_type.name == "CPU"]
    all_idle = sum(sum(v) for v in idle_before.values())
    lines = [f"GPU idle in gaps > 0.1 ms: {sum(g[0] for g in gaps) / 1e3 / n:.1f} ms per step "
             f"({len(gaps) / n:.0f} gaps per step); kernels span "
             f"{(kernels[-1][1] - kernels[0][0]) / 1e3 / n:.1f} ms per step; GPU idle in all "
             f"gaps {all_idle / 1e3 / n:.1f} ms per step, by the kernel after the gap:"]
    for name, v in sorted(idle_before.items(), key=lambda kv: -sum(kv[1]))[:15]:
        lines.append(f"  {sum(v) / 1e3 / n:7.2f} ms in {len(v) / n:5.0f} gaps before {name}")
    lines.append("largest gaps:")
    for length, a, b in sorted(gaps, reverse=True)[:top]:
        during = sorted((e for e in cpu if e.time_range.start < b and e.time_range.end > a),
                        key=lambda e: e.time_range.end - e.time_range.start)[:4]
        lines.append(f"  {length / 1e3:7.2f} ms  during: " +
                     " < ".join(e.name[:60] for e in during))
    return "\n".join(lines)


def kernel_categories(prof, n: int) -> dict:
    """CUDA kernel time per step by category, and the top kernels."""
    cats: dict[str, float] = {}
    top: list[tuple[str, float]] = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if t <= 0 or ev.device_type.name != "CUDA":
            continue
        if getattr(ev, "is_user_annotation", False) or "#" in ev.key or \
                ev.key.startswith(("ProfilerStep", "Optimizer.")):
            continue  # annotations span kernels already counted: counting them is double
        name = ev.key.lower()
        cat = ("attention" if any(k in name for k in ("sdpa", "flash", "fmha", "attention"))
               else "matmul" if any(k in name for k in ("gemm", "cutlass", "xmma", "sm90", "nvjet"))
               else "communication" if "nccl" in name
               else "memcpy" if "memcpy" in name or "memset" in name
               else "optimizer" if "adam" in name or "multi_tensor" in name
               else "other (elementwise, norms, softmax, loss)")
        cats[cat] = cats.get(cat, 0.0) + t / 1e6 / n
        top.append((ev.key[:90], t / 1e6 / n))
    top.sort(key=lambda kv: -kv[1])
    return {"kernel_busy_s": sum(cats.values()),
            "by_category_s": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top_kernels_s": top[:12]}


def sec_memory(args, name: str) -> dict:
    """Peak GPU memory over a few steps of one configuration through ds3d's TrainStep,
    with the memory model's prediction for the same job beside it."""
    import torch

    sets = list(MEMORY_CONFIGS[name])
    mb = next(int(x.split("=")[1]) for x in sets if x.startswith("train.micro_batch_size"))
    sets.append(f"train.global_batch_size={mb}")
    cfg, device, layout, TrainStep = engine_stack(args, sets)
    step_fn = TrainStep(cfg, layout, device)
    sync(device)
    out = {"sets": sets, "parameters": cfg.model.n_params(),
           "allocated_after_build_GiB": torch.cuda.memory_allocated() / 2**30}
    for step in range(3):
        step_fn.run(step)
        sync(device)
        out.setdefault("allocated_between_steps_GiB", []).append(
            torch.cuda.memory_allocated() / 2**30)
    out.update(max_allocated_GiB=torch.cuda.max_memory_allocated() / 2**30,
               max_reserved_GiB=torch.cuda.max_memory_reserved() / 2**30)
    try:
        from ds3d.trainer.memory_model import estimate
    except ImportError:  # measured now, predicted later (bench/memory_table.py)
        return out
    rank0 = estimate(cfg).ranks[0]
    out.update(predicted_GiB=rank0.gpu_total / 2**30,
               predicted_parts_GiB={k: v / 2**30 for k, v in rank0.gpu_parts.items()})
    out["error_vs_reserved"] = out["predicted_GiB"] / out["max_reserved_GiB"] - 1
    return out


def sec_deepspeed(args, compile_: bool = False) -> dict:
    """ds3d's model through DeepSpeed's engine (TrainStep), without ds3d's worker loop."""
    cfg, device, layout, TrainStep = engine_stack(args, ["train.compile=true"] if compile_ else [])
    step_fn = TrainStep(cfg, layout, device)
    return timed_steps(args, cfg, device, lambda step: step_fn.run(step).loss)


def sec_ds3d(args, compile_: bool = False) -> dict:
    """ds3d's whole worker loop; the step time is the wall time between consecutive step
    reports, so everything the loop adds (reports, agreement all-reduce, polling) is in it."""
    import torch

    from ds3d.trainer.layout import ProcessEnv
    from ds3d.trainer.loop import Trainer
    from ds3d.trainer.report import read_rank_records

    extra = [f"train.steps={args.warmup + args.steps}"]
    extra += ["train.compile=true"] if compile_ else []
    cfg, device, layout, _ = engine_stack(args, extra)
    run_dir = Path(tempfile.mkdtemp(prefix="ds3d-bench-"))
    trainer = Trainer(cfg, run_dir, ProcessEnv.from_env(), layout, device)
    trainer.save = lambda: None  # the final save is measured in `checkpoint`, not here
    # the reports' times are rounded to the millisecond (0.4% of a 0.27 s step): the moments
    # they are written are taken here at full resolution
    emit, clock = trainer.reporter.emit, {"start": [], "step": []}

    def timed_emit(kind, **fields):
        if str(kind) in clock:
            clock[str(kind)].append(time.perf_counter())
        emit(kind, **fields)

    trainer.reporter.emit = timed_emit
    trainer.run()
    trainer.ckpt.release_node_memory()  # a clean end, as the worker's
    trainer.close()
    recs = read_rank_records(run_dir, 0)
    stamps, start = clock["step"], clock["start"][0]
    deltas = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][args.warmup - 1:]
    out = summarize_steps(deltas, cfg, args.peak)
    out["first_step_s"] = stamps[0] - start
    out["final_loss"] = next(r["loss"] for r in reversed(recs) if r["kind"] == "step")
    out["step_s_inside_engine"] = statistics.median(
        [r["step_time_s"] for r in recs if r["kind"] == "step"][args.warmup:])
    if device.type == "cuda":
        out["max_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def sec_profile(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cfg, device, layout, TrainStep = engine_stack(args)
    step_fn = TrainStep(cfg, layout, device)
    for step in range(args.warmup):
        step_fn.run(step)
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    n = 3
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for step in range(args.warmup, args.warmup + n):
            step_fn.run(step)
        sync(device)
    wall = (time.perf_counter() - t0) / n
    cats: dict[str, float] = {}
    top: list[tuple[str, float]] = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if device.type != "cuda" or t <= 0 or ev.device_type.name != "CUDA":
            continue
        if getattr(ev, "is_user_annotation", False) or "#" in ev.key or \
                ev.key.startswith(("ProfilerStep", "Optimizer.")):
            continue  # annotations span kernels already counted: counting them is double
        name = ev.key.lower()
        cat = ("attention" if any(k in name for k in ("sdpa", "flash", "fmha", "attention"))
               else "matmul" if any(k in name for k in ("gemm", "cutlass", "xmma", "sm90", "nvjet"))
               else "communication" if "nccl" in name
               else "memcpy" if "memcpy" in name or "memset" in name
               else "optimizer" if "adam" in name or "multi_tensor" in name
               else "other (elementwise, norms, softmax, loss)")
        cats[cat] = cats.get(cat, 0.0) + t / 1e6 / n
        top.append((ev.key[:90], t / 1e6 / n))
    busy = sum(cats.values())
    top.sort(key=lambda kv: -kv[1])
    return {"step_wall_s": wall, "kernel_busy_s": busy,
            "idle_or_host_s": max(0.0, wall - busy),
            "by_category_s": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top_kernels_s": top[:12]}


def _thp(name: str = "enabled") -> str:
    """The kernel's transparent huge page mode (checkpoints/host_memory.py asks for them), or
    `shmem_enabled`: its mode for tmpfs, where node memory's arenas live."""
    try:
        return Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
    except OSError:
        return "unknown"


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sec_checkpoint(args) -> dict:
    import shutil

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from ds3d.checkpoints.engine_io import CheckpointManager, Rank

    cfg, device, layout, TrainStep = engine_stack(args, ["checkpoint.keep_last=2"])
    step_fn = TrainStep(cfg, layout, device)
    engine = step_fn.engine
    progress("built")
    work = Path(args.work)
    run_dir = work / "ckpt-run"
    local_complete: list[dict] = []  # each save's write / hash / local-complete timings

    def on_record(kind: str, **fields) -> None:
        if kind == "checkpoint" and fields.get("phase") == "local_complete":
            local_complete.append({k: v for k, v in fields.items() if k != "phase"})

    ckpt = CheckpointManager(cfg.checkpoint_settings(), run_dir, Rank(0, 1, 0, 1, 1, 1), device,
                             on_record)
    out: dict = {"ds3d_blocked_s": [], "ds3d_host_copy_s": [], "ds3d_time_to_committed_s": [],
                 "local_complete": local_complete}
    step = 0
    for _ in range(2):
        step_fn.run(step)
        step += 1
    sync(device)
    t0, k = time.perf_counter(), 0
    for _ in range(4):
        step_fn.run(step)
        step, k = step + 1, k + 1
    sync(device)
    out["step_s_before_pinning"] = (time.perf_counter() - t0) / k
    progress("trained", step_s=out["step_s_before_pinning"])
    # what the trainer does after its restore: pin the snapshot memory while training goes on
    t0, k = time.perf_counter(), 0
    out["pinned_reserved_bytes"] = ckpt.prepare(engine)
    while not ckpt.snapshot.arena_ready() and k < 200:
        step_fn.run(step)
        step, k = step + 1, k + 1
    sync(device)
    out["pinning_s"] = time.perf_counter() - t0
    out["arena_pinned"] = ckpt.snapshot._arena is not None
    out["arena_in_node_memory"] = ckpt.node is not None and ckpt.node.arena_path.exists()
    out["transparent_hugepage"] = _thp()
    out["transparent_hugepage_shmem"] = _thp("shmem_enabled")  # node memory's /dev/shm
    out["steps_while_pinning"] = k
    out["step_s_while_pinning"] = out["pinning_s"] / max(k, 1)
    progress("pinned", seconds=out["pinning_s"], steps=k, ok=out["arena_pinned"])
    # baseline: DeepSpeed's own synchronous save (its default engine), to the same local disk
    engine.checkpoint_engine = TorchCheckpointEngine()
    sync_dir = work / "sync"
    t0 = time.perf_counter()
    engine.save_checkpoint(str(sync_dir), tag="s0", save_latest=False)
    sync(device)
    out["sync_blocked_s"] = time.perf_counter() - t0
    out["state_bytes"] = _dir_bytes(sync_dir / "s0")
    progress("sync save", seconds=out["sync_blocked_s"], bytes=out["state_bytes"])
    shutil.rmtree(sync_dir)  # the disk holds ~3 copies at most; keep it to 2
    for i in range(2):  # 0: first save (allocates the pinned buffers), 1: steady state
        step_fn.run(step)
        step += 1
        sync(device)
        t0 = time.perf_counter()
        blocked = ckpt.save(engine, step, {"iteration": step}, step, {"step": step})
        out["ds3d_blocked_s"].append(blocked)
        out["ds3d_host_copy_s"].append(ckpt.snapshot.copy_seconds)
        # training goes on while the checkpoint is written, hashed and committed
        t_train, k = time.perf_counter(), 0
        while ckpt.busy() and k < 200:
            step_fn.run(step)
            step += 1
            k += 1
        ckpt.wait_uploads(900)
        out["ds3d_time_to_committed_s"].append(time.perf_counter() - t0)
        out.setdefault("steps_trained_during_background_write", []).append(k)
        out.setdefault("step_s_during_background_write", []).append(
            (time.perf_counter() - t_train) / max(k, 1))
        progress(f"ds3d save {i}", blocked=blocked,
                 committed=out["ds3d_time_to_committed_s"][-1], steps=k)
        if i == 0:
            ckpt.catalog.delete(step - k, force=True)
    ckpt.release_node_memory()  # the restore section measures the restore from disk
    ckpt.close()
    if args.d2h_pinned:
        out["floor_s"] = out["state_bytes"] / (args.d2h_pinned * 1e9)
        out["ds3d_blocked_over_floor"] = out["ds3d_blocked_s"][-1] / out["floor_s"]
    out["ds3d_blocked_over_sync"] = out["ds3d_blocked_s"][-1] / out["sync_blocked_s"]
    out["note"] = ("index 0 = first save of the process (its buffers carved from the arena "
                   "pinned in the background), 1 = steady state")
    return out


def _launch_agent(run_dir: Path, env: dict, max_restarts: int, log: Path) -> subprocess.Popen:
    """The job as ds3dd runs it on a node: `python -m ds3d.daemon.agent`, torch elastic's
    LocalElasticAgent with a c10d rendezvous it hosts (as torchrun --standalone), its worker
    forked from a forkserver that imported torch, DeepSpeed and the trainer once, so a worker
    the agent restarts after a crash does not import them again. The agent's output (stdout
    and stderr, as ds3dd keeps it) goes to `log`, the workers' to RUN_DIR/logs/agent
    (`_worker_log`)."""
    from ds3d.daemon.launcher import AgentSpec
    from ds3d.daemon.ports import hold_port

    # the rendezvous port, drawn outside the kernel's ephemeral range so that no bind(0) on
    # the host can take it before the agent binds it (daemon/ports.py); released at once: no
    # other ds3d draws ports on the bench's host
    with hold_port() as rendezvous:
        port = rendezvous.port
    control = run_dir / "control"
    control.mkdir(parents=True, exist_ok=True)
    spec = control / "bench-agent.json"
    AgentSpec.standalone(run_dir, 1, port, max_restarts, "agent").write(spec)
    return subprocess.Popen([sys.executable, "-m", "ds3d.daemon.agent", "--spec", str(spec)],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _worker_log(run_dir: Path, agent_log: Path) -> str:
    """The agent's output and every worker's stdout/stderr of every attempt, in that order."""
    parts = [agent_log.read_text(errors="replace")] if agent_log.exists() else []
    parts += [f.read_text(errors="replace")
              for f in sorted((run_dir / "logs" / "agent").glob("**/std*.log"))]
    return "\n".join(parts)


def _kill_job(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILLs an agent and every process under it, and waits until they are gone: the
    elastic agent starts its workers in sessions of their own, so killing the agent's process
    group leaves a worker training on the GPU (it halved the next run's speed). The killed
    workers' arenas in node memory (the state's size, in RAM) go too."""
    def children() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        return out

    tree, todo, kids = [], [proc.pid], children()
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(kids.get(pid, []))
    for pid in tree:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(Path(f"/proc/{pid}").exists() and
                                         "Z" not in _proc_state(pid) for pid in tree[1:]):
        time.sleep(0.2)
    from ds3d.checkpoints.identity import local_job_id
    from ds3d.checkpoints.node_memory import remove_job_folder

    job_id = local_job_id(run_dir)
    if job_id:
        remove_job_folder(job_id)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _restore_phases(recs: list[dict], t0: float, log: str) -> dict:
    """Where a restarted worker's time went, from its process start (`t0`: the launch, or the
    crash) to its first step: the newest worker's report records and its log."""
    import re

    pid = [r for r in recs if r["kind"] == "start"][-1]["pid"]
    mine = [r for r in recs if r["pid"] == pid]

    def record(kind, **kw):
        return next(r for r in mine if r["kind"] == kind and
                    all(r.get(k) == v for k, v in kw.items()))

    def first(kind, **kw):
        return record(kind, **kw)["time"]

    started, loading = record("heartbeat", phase="init"), record("heartbeat", phase="load")
    init, build, load = started["time"], first("heartbeat", phase="build"), loading["time"]
    forked = record("start").get("process_started")
    group = re.findall(r"ds3d agent: starting the worker group at ([0-9.]+)", log)
    # the newest group start before this worker's fork (an earlier one's worker crashed)
    group_at = max((float(g) for g in group if forked is None or float(g) <= forked + 0.5),
                   default=None)
    loaded = first("checkpoint", phase="loaded")
    step1 = first("step")
    restoring = [r for r in mine if r["kind"] == "checkpoint" and r.get("phase") == "restoring"]
    verified = [line for line in log.splitlines() if "local_copy_verified" in line]
    read_s = re.search(r'"seconds": ([0-9.]+)', verified[-1]) if verified else None
    return {"total_s": step1 - t0,
            "parts_s": {"agent + rendezvous + python/torch/CUDA init": init - t0,
                        "choose checkpoint (records and sizes, no hashing)": build - init,
                        "model + engine build, overlapped with the parallel read + sha256 of "
                        "the local copy (joined at its end)": load - build,
                        "load into the engine, served from the verified host buffers":
                            loaded - load,
                        "first step": step1 - loaded},
            # the first part split: the agent's start and rendezvous (to its start of the
            # group), the wait for the forkserver's imports and the fork, the worker's own
            # start-up stages (seconds from its fork: config, CUDA device, process group,
            # layout), the trainer's set-up to its init heartbeat
            "init_parts_s": {
                "to the agent's start of the group (its start and rendezvous, or noticing "
                "the crash)": group_at - t0 if group_at else None,
                "forkserver + fork": forked - group_at if forked and group_at else None,
                "worker start-up stages, from its fork": started.get("startup_s"),
                "fork to init heartbeat": init - forked if forked else None},
            # the engine's build and the wait for the read after it (the load heartbeat)
            "build_parts_s": loading.get("build_s"),
            "snapshot_arenas": _arenas_reserved(log, t0),
            "read_and_verify_s (background, overlapped with the build)":
                float(read_s.group(1)) if read_s else None,
            # "node_memory": the crashed worker's newest save, no read (node_memory.py)
            "restored": {"step": restoring[-1]["step"], "source": restoring[-1].get("source")}
            if restoring else None}


def _arenas_reserved(log: str, t0: float) -> dict | None:
    """The newest worker's snapshot arena reservation after `t0` (its `snapshot_arenas_reserved`
    log line): bytes, slots, pinned, in node memory, its seconds, and when it ended (seconds
    after t0), to set beside the restore's parts it overlapped."""
    from datetime import datetime

    found = None
    for line in log.splitlines():
        if "snapshot_arenas_reserved" not in line or not line.lstrip().startswith("{"):
            continue
        try:
            rec = json.loads(line)
            ended = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError):
            continue
        if ended >= t0:
            found = {k: rec.get(k) for k in ("bytes", "slots", "pinned", "node_memory",
                                             "populate_s", "register_s", "seconds")}
            found["ended_after_s"] = round(ended - t0, 3)
    return found


def sec_restore(args, sets: tuple[str, ...] = (), profiled: bool = False) -> dict:
    """A fresh start of ds3d's node agent (c10d rendezvous, forkserver, worker) resuming the
    job `checkpoint` saved; `sets`: the job's settings changed for this start. `profiled`: the
    worker's training thread under cProfile (DS3D_STARTUP_PROFILE, trainer/startup_profile.py)
    from its build to its first step; its summaries are the result (no floor: profiling slows
    the Python parts)."""
    run_dir = Path(args.work) / "ckpt-run"
    cfg = build_cfg(args, ["checkpoint.keep_last=2", *sets])
    store = run_dir / "store" / "bench" / "ckpt"
    saved = sorted(int(p.name.split("-")[1]) for p in store.glob("step-*") if
                   (p / "MANIFEST.json").exists()) if store.is_dir() else []
    if not saved:
        return {"skipped": "no committed checkpoint from the checkpoint section"}
    steps = saved[-1] + 2
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": steps})})
    (run_dir / "job.json").write_text(cfg.dump_json())
    env = dict(os.environ, DS_ACCELERATOR=args.device if args.device == "cuda" else "cpu",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", NCCL_NVLS_ENABLE="0")
    profiles = run_dir / "startup-profile"
    if profiled:
        shutil.rmtree(profiles, ignore_errors=True)
        env["DS3D_STARTUP_PROFILE"] = str(profiles)
    reports, log = run_dir / "reports" / "rank-00000.jsonl", run_dir / "restore.log"
    seen = len(reports.read_text().splitlines()) if reports.exists() else 0
    t0 = time.time()
    # the first step is what is measured: the process group is killed then (its final save of
    # the whole state would only lengthen the device call)
    proc = _launch_agent(run_dir, env, 0, log)
    recs: list[dict] = []
    while time.time() - t0 < 400 and proc.poll() is None:
        time.sleep(0.5)
        recs = [json.loads(line) for line in reports.read_text().splitlines()[seen:]] \
            if reports.exists() else []
        if any(r["kind"] == "step" for r in recs):
            break
    _kill_job(proc, run_dir)
    if not any(r["kind"] == "step" for r in recs):
        return {"error": _worker_log(run_dir, log)[-3000:]}
    out = _restore_phases(recs, t0, _worker_log(run_dir, log))
    out["checkpoint_bytes"] = _dir_bytes(run_dir / "ckpt" / f"global_step{saved[-1]}")
    out["transparent_hugepage"] = _thp()
    out["transparent_hugepage_shmem"] = _thp("shmem_enabled")  # node memory's /dev/shm
    if profiled:
        out["startup_profile"] = {p.stem: p.read_text()[:20000]
                                  for p in sorted(profiles.glob("*.txt"))}
        return out
    # the bare floor, in the same run: one sequential read of the same files (page cache as the
    # restore found it) plus an engine build with no load
    files = sorted(p for p in (run_dir / "ckpt" / f"global_step{saved[-1]}").rglob("*")
                   if p.is_file())
    t1, nbytes = time.perf_counter(), 0
    buf = bytearray(64 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                nbytes += n
    out["floor_read_s"] = time.perf_counter() - t1
    out["floor_read_GBps"] = nbytes / out["floor_read_s"] / 1e9
    progress("floor read", seconds=out["floor_read_s"], GBps=out["floor_read_GBps"])
    t1 = time.perf_counter()
    bare = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--section",
                           "engine_build", "--device", args.device, "--work", args.work] +
                          (["--quick"] if args.quick else []), env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in bare.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        out["floor_error"] = bare.stderr[-2000:]
        return out
    out["floor_engine_build_s"] = json.loads(lines[-1][7:])["engine_build_s"]
    out["floor_s"] = out["floor_read_s"] + out["floor_engine_build_s"]
    out["total_over_floor"] = out["total_s"] / out["floor_s"]
    out["note"] = ("floor = one sequential read of the checkpoint's files + the same model's "
                   "engine build (TrainStep) with no load, both measured after the restore in "
                   "this section")
    if sets:  # the variants share the first restore's build profile
        return out
    # where the bare build's seconds go: the same build once more, in a fresh process, under
    # cProfile (its own time is not the floor: profiling slows the Python parts)
    profiled = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--section",
                               "engine_build_profile", "--device", args.device, "--work",
                               args.work] + (["--quick"] if args.quick else []), env=env,
                              capture_output=True, text=True, timeout=300)
    lines = [line for line in profiled.stdout.splitlines() if line.startswith("RESULT ")]
    out["floor_engine_build_profile"] = json.loads(lines[-1][7:]) if lines else \
        {"error": profiled.stderr[-2000:]}
    return out


# the goodput run (issue 19 goal 6): a fault every 2 minutes, NaN, crash and spike in turn
GOODPUT_KINDS = ["nan", "crash", "spike"]  # in turn, every --goodput-every s from half of it
GOODPUT_EVERY_S = 120.0
GOODPUT_WINDOW_S = 360.0  # training time measured in the faulty run
GOODPUT_REFERENCE_S = 60.0  # ... and in the fault-free run of the same invocation
GOODPUT_SETS = ["checkpoint.keep_last=1", "faults.spike_policy=\"rollback\"",
                "faults.spike_window=20", "faults.spike_mads=20"]
GOODPUT_INTERVAL = 120  # steps (~34 s of the gpt1b job; a save's write + commit took 20-24 s)
# memory-only snapshots between the saves (checkpoint.memory_interval): ~Young-Daly's interval
# for their cost, sqrt(2 x 0.4 s blocked x 120 s between faults) = 10 s, ~34 steps
GOODPUT_MEMORY_INTERVAL = 30
QUICK_SCALE = 6  # --quick: times / 6, a save every 3 steps (a CPU smoke test of the section)


def _goodput_run(args, name: str, window_s: float, faults: list[tuple[float, str]]) -> dict:
    """One job under ds3d's node agent (it restarts a crashed worker) for `window_s` of
    training after its first step, faults injected through control/inject.json at their times;
    then the process group is killed. Goodput = the step reached at the window's end (after any
    rollback) over the window."""
    import shutil

    run_dir = Path(args.work) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(Path(args.work) / "ckpt-run", ignore_errors=True)  # the disk holds ~3 states
    (run_dir / "control").mkdir(parents=True)
    interval = 3 if args.quick else GOODPUT_INTERVAL
    memory = args.goodput_memory_interval
    sets = [f"checkpoint.interval={interval}"]
    if memory == "auto":  # Young-Daly on the measured snapshot cost, the MTBF of the schedule
        # (no daemon counts the failures here: the prior an operator sets for the cluster)
        every = args.goodput_every / (QUICK_SCALE if args.quick else 1)
        sets += ['checkpoint.memory_interval="auto"',
                 f"checkpoint.auto_mtbf_prior_hours={every / 3600:.6f}"]
    else:
        sets.append(f"checkpoint.memory_interval={1 if args.quick else int(memory)}")
    cfg = build_cfg(args, GOODPUT_SETS + sets)
    (run_dir / "job.json").write_text(cfg.dump_json())
    env = dict(os.environ, DS_ACCELERATOR=args.device if args.device == "cuda" else "cpu",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", NCCL_NVLS_ENABLE="0",
               DS3D_LOG_FORMAT="json")
    reports, log = run_dir / "reports" / "rank-00000.jsonl", run_dir / "worker.log"
    t_launch = time.time()
    proc = _launch_agent(run_dir, env, 3, log)

    def recs() -> list[dict]:
        return [json.loads(line) for line in reports.read_text().splitlines()] \
            if reports.exists() else []

    def steps() -> list[dict]:
        return [r for r in recs() if r["kind"] == "step"]

    t_first = None
    pending = list(faults)
    injected: list[dict] = []
    while proc.poll() is None:
        time.sleep(0.5)
        now = time.time()
        if t_first is None:
            done = steps()
            if done:
                t_first = done[0]["time"]
                progress(f"{name}: first step", after_launch_s=t_first - t_launch)
            elif now - t_launch > 300:
                break
            continue
        if now - t_first >= window_s:
            break
        if pending and now - t_first >= pending[0][0]:
            at, kind = pending.pop(0)
            step = steps()[-1]["step"]
            i = len(injected) + 1
            (run_dir / "control" / "inject.json").write_text(
                json.dumps({"id": i, "kind": kind, "rank": 0, "at_step": step + 2}))
            injected.append({"id": i, "kind": kind, "planned_s": at, "written_s": now - t_first,
                             "at_step": step + 2})
            progress(f"{name}: inject", kind=kind, at_step=step + 2)
    _kill_job(proc, run_dir)
    all_recs = recs()
    if t_first is None:
        return {"error": _worker_log(run_dir, log)[-3000:]}
    # the next run needs the disk: a fault-free run's ~2 states left behind filled the 64 GB
    # disk in the 2026-12-06 long run, and every durable save of its faulty run after the first
    # failed for want of space (training went on, as it should)
    free_before = shutil.disk_usage(run_dir).free
    _drop_checkpoints(run_dir)
    t_end = t_first + window_s
    inside = [r for r in all_recs if r["kind"] == "step" and r["time"] <= t_end]
    first_step, last_step = inside[0]["step"], inside[-1]["step"]
    out = {"window_s": window_s, "first_step": first_step, "step_at_window_end": last_step,
           "steps_trained": len(inside), "useful_steps": last_step - first_step,
           "goodput_steps_per_s": (last_step - first_step) / window_s,
           # the rate once the start's transient is over (the arena's pinning beside the
           # first steps): the window's second half
           "second_half_steps_per_s": (last_step - max(
               (r["step"] for r in inside if r["time"] <= t_first + window_s / 2),
               default=first_step)) / (window_s / 2),
           "start_to_first_step_s": t_first - t_launch,
           "checkpoint_interval_steps": cfg.checkpoint.interval,
           "memory_interval_steps": cfg.checkpoint.memory_interval,
           "saves": [r for r in all_recs if r["kind"] == "checkpoint" and
                     r.get("phase") in ("saved", "local_complete", "committed",
                                        "held_in_memory", "memory_snapshots_off", "failed",
                                        "skipped")
                     and r["time"] <= t_end],
           "disk_free_at_end_GB": round(free_before / 1e9, 1)}
    failed = [r for r in out["saves"] if r["phase"] in ("failed", "skipped")]
    if failed:  # a save that could not be made changes what the run measures: said loudly
        out["saves_not_made"] = len(failed)
        progress(f"{name}: {len(failed)} save(s) not made", first=failed[0].get("detail"))
    out["saves"] = [{k: r[k] for k in ("phase", "step", "blocked_s", "seconds", "detail", "cause",
                                       "write_s", "hash_wait_s", "hash_s", "read_back_files",
                                       "local_complete_s") if k in r}
                    | {"at_s": round(r["time"] - t_first, 1)} for r in out["saves"]]
    for f in injected:
        done = run_dir / "control" / f"inject-done-{f['id']}"
        f["fired_s"] = done.stat().st_mtime - t_first if done.exists() else None
    out["faults"] = injected
    out["recoveries"] = [{k: r.get(k) for k in ("cause", "step", "recovered_to", "steps_lost",
                                                "seconds", "source", "time")}
                         for r in all_recs if r["kind"] == "recovery"]
    for r in out["recoveries"]:
        r["at_s"] = r.pop("time") - t_first
    starts = [r for r in all_recs if r["kind"] == "start"]
    out["worker_starts"] = len(starts)
    if len(starts) > 1:  # the crash: the restarted worker's start and first step after it
        pid = starts[-1]["pid"]
        first_after = next((r for r in all_recs if r["kind"] == "step" and r.get("pid") == pid),
                           None)
        crash = next((f for f in injected if f["kind"] == "crash"), None)
        out["crash_resumed_from_step"] = starts[-1].get("step")
        if first_after is not None and crash is not None and crash.get("fired_s") is not None:
            out["crash_to_first_step_s"] = first_after["time"] - t_first - crash["fired_s"]
            try:  # the restarted worker's restore, timed from the crash
                out["crash_restore"] = _restore_phases(all_recs, t_first + crash["fired_s"],
                                                      _worker_log(run_dir, log))
                out["transparent_hugepage"] = _thp()
            except StopIteration:
                out["crash_restore"] = {"error": "a phase record is missing"}
    return out


def _drop_checkpoints(run_dir: Path) -> None:
    """Removes a measured run's checkpoints (its local tier and file store, ~20 GB a state),
    keeping what the results are read from: job.json, reports, logs, control, worker.log."""
    keep = {"job.json", "reports", "logs", "control", "worker.log"}
    for entry in run_dir.iterdir():
        if entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def sec_goodput(args) -> dict:
    """Issue 19 goal 6: the bench job for --goodput-window s (default 6 minutes) with a fault every
    --goodput-every s (default 2 minutes: NaN, crash, spike in turn), against the same job
    without faults, both in this invocation."""
    k = QUICK_SCALE if args.quick else 1
    ref = _goodput_run(args, "goodput-fault-free", args.goodput_reference / k, [])
    progress("fault-free", goodput=ref.get("goodput_steps_per_s"))
    window = args.goodput_window / k
    every = args.goodput_every / k
    faults = [(every / 2 + i * every, kind) for i, kind in enumerate(GOODPUT_KINDS)]
    faulty = _goodput_run(args, "goodput-faults", window, [f for f in faults if f[0] < window])
    out = {"fault_free": ref, "faulty": faulty, "sets": GOODPUT_SETS,
           "fault_every_s": args.goodput_every,
           "memory_interval": args.goodput_memory_interval}
    if "goodput_steps_per_s" in ref and "goodput_steps_per_s" in faulty:
        out.update(goodput_against_fault_free(ref, faulty))
    return out


def goodput_against_fault_free(ref: dict, faulty: dict) -> dict:
    """The faulty run's useful steps over those a fault-free run makes in the same window. The
    fault-free run is shorter (both must fit one device call): its steps are carried on to the
    faulty run's window at its second half's rate. Both runs start with the same slow stretch
    (the snapshot arenas are pinned beside the first steps: ~8 s of steps with two 22 GB
    arenas), which a short reference's plain average would weigh six times more than the
    faulty window does (the 2026-12-05 evening run read 103.5% that way)."""
    rate = ref["second_half_steps_per_s"]
    fault_free_steps = ref["useful_steps"] + rate * (faulty["window_s"] - ref["window_s"])
    return {"fault_free_steps_in_window": fault_free_steps,
            "goodput_vs_fault_free": faulty["useful_steps"] / fault_free_steps,
            "lost_s": (fault_free_steps - faulty["useful_steps"]) / rate}


def _populate_and_register(address: int, nbytes: int, piece: int, populated: bool,
                           registered: list[int]) -> dict:
    """The arena's registration in `piece`s, its pages faulted in first when `populated`
    (host_memory.populate); the registered pieces go into `registered`."""
    from ds3d.checkpoints.host_memory import populate, register_in_pieces

    out: dict = {}
    if populated:
        t0 = time.perf_counter()
        out["populated"] = populate(address, nbytes)
        out["populate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    registered.extend(register_in_pieces(address, nbytes, piece) or [])
    out["register_only_s"] = time.perf_counter() - t0
    out["rc"] = 0 if registered else 1
    return out


def sec_pinning(args) -> dict:
    """How page-locking the snapshot arena holds up CUDA work beside it: one cudaHostRegister
    of the whole arena against registering it in pieces, on a fresh and on a prefaulted buffer,
    while a thread launches matmuls and times each (the longest gap is the stall a training
    step or an engine build would see); and whether a device-to-host copy into a range that
    spans two registered pieces still runs at pinned speed."""
    import ctypes
    import threading

    import torch

    from ds3d.checkpoints.host_memory import (
        PIN_PIECE_BYTES,
        anonymous_buffer,
        unregister_pieces,
    )

    if args.device != "cuda":
        return {"skipped": "no GPU"}
    nbytes = (2 << 30) if args.quick else (20 << 30)
    piece = PIN_PIECE_BYTES
    cudart = torch.cuda.cudart()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def probe(register) -> dict:
        ends: list[tuple[float, float]] = []  # (end time, seconds) of each matmul + sync
        stop = threading.Event()

        def work() -> None:
            t = time.perf_counter()
            while not stop.is_set():
                a @ a
                torch.cuda.synchronize()
                now = time.perf_counter()
                ends.append((now, now - t))
                t = now

        th = threading.Thread(target=work)
        th.start()
        time.sleep(1.0)
        base = statistics.median(g for _, g in ends)
        t0 = time.perf_counter()
        extra = register()
        t1 = time.perf_counter()
        time.sleep(0.5)
        stop.set()
        th.join()
        during = [g for end, g in ends if t0 < end <= t1 + 0.5]
        return {"register_s": t1 - t0, "iter_base_s": base,
                "max_gap_s": max(during, default=0.0),
                "work_done_during_vs_idle": len(during) * base / (t1 - t0 + 0.5),
                **(extra or {})}

    out: dict = {"bytes": nbytes, "piece_bytes": piece}

    def whole(prefault: bool) -> dict:
        buf = anonymous_buffer(nbytes)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        info: dict = {}
        if prefault:
            t0 = time.perf_counter()
            torch.frombuffer(buf, dtype=torch.uint8).fill_(1)
            info["prefault_s"] = time.perf_counter() - t0

        def reg() -> dict:
            rc = int(cudart.cudaHostRegister(addr, nbytes, 0))
            return {"rc": rc}
        r = probe(reg)
        r.update(info)
        cudart.cudaHostUnregister(addr)
        del buf
        return r

    def pieces(populated: bool = False) -> dict:
        buf = anonymous_buffer(nbytes)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        registered: list[int] = []

        def reg() -> dict:  # what the snapshot arena does (`populated`: since 12-06)
            return _populate_and_register(addr, nbytes, piece, populated, registered)
        r = probe(reg)
        # a 1 GiB copy into one piece. Not one spanning two pieces' boundary: that asynchronous
        # copy fails with cudaErrorInvalidValue (H100, 2026-12-05), hence the snapshot's copies
        # split at the pieces' edges (host_memory.piece_ranges)
        host = torch.frombuffer(buf, dtype=torch.uint8)
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        r["d2h_inside_GBps"] = _copy_GBps(host[2 * piece:2 * piece + (1 << 30)], src)
        unregister_pieces(registered)
        del host, buf
        return r

    def pieces_in_node_memory(size: int, populated: bool = False) -> dict:
        """Node memory's arena (checkpoints/node_memory.py `_allocate`: a /dev/shm file,
        posix_fallocate'd, mapped shared; tmpfs pages are 4 KiB unless the kernel's
        shmem_enabled says otherwise) registered in pieces of `size`."""
        import mmap

        folder = Path(tempfile.mkdtemp(prefix="ds3d-pin-", dir="/dev/shm"))
        path = folder / "arena"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.perf_counter()
            os.posix_fallocate(fd, 0, nbytes)
            allocate_s = time.perf_counter() - t0
            buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        registered: list[int] = []

        def reg() -> dict:
            return _populate_and_register(addr, nbytes, size, populated, registered)
        r = probe(reg)
        r.update(piece_bytes=size, fallocate_s=allocate_s)
        unregister_pieces(registered)
        del buf
        path.unlink()
        folder.rmdir()
        return r

    out["transparent_hugepage"] = _thp()
    out["transparent_hugepage_shmem"] = _thp("shmem_enabled")
    out["whole_fresh"] = whole(False)
    progress("whole fresh", **out["whole_fresh"])
    out["pieces_fresh"] = pieces()
    progress("pieces fresh", **out["pieces_fresh"])
    out["whole_prefaulted"] = whole(True)
    progress("whole prefaulted", **out["whole_prefaulted"])
    # what the arena does since 12-06: its pages faulted in first (host_memory.populate, on
    # threads, without the driver lock), then registered in pieces
    out["pieces_populated"] = pieces(populated=True)
    progress("pieces populated", **out["pieces_populated"])
    # the restore under ds3d's agent pins node memory's arena beside the engine build
    for name, size, populated in (("node_memory_pieces", piece, False),
                                  ("node_memory_small_pieces", 64 << 20, False),
                                  ("node_memory_populated", piece, True)):
        try:
            out[name] = pieces_in_node_memory(size, populated)
        except Exception as e:  # noqa: BLE001 - the probes above keep their results
            out[name] = {"error": repr(e)}
        progress(name, **out[name])
    return out


def sec_engine_build(args) -> dict:
    """The bare engine build (no checkpoint load) of the restore's floor."""
    cfg, device, layout, TrainStep = engine_stack(args, ["checkpoint.keep_last=2"])
    t0 = time.perf_counter()
    TrainStep(cfg, layout, device)
    sync(device)
    return {"engine_build_s": time.perf_counter() - t0}


def sec_engine_build_profile(args) -> dict:
    """The bare engine build under cProfile: the calls that hold it, by cumulative seconds."""
    import cProfile
    import io
    import pstats

    cfg, device, layout, TrainStep = engine_stack(args, ["checkpoint.keep_last=2"])
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    TrainStep(cfg, layout, device)
    sync(device)
    prof.disable()
    seconds = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    tottime = io.StringIO()
    pstats.Stats(prof, stream=tottime).sort_stats("tottime").print_stats(20)
    return {"profiled_build_s": seconds, "cumulative": text.getvalue()[-9000:],
            "tottime": tottime.getvalue()[-4000:]}


def _h2d_GBps(device) -> float:
    """Host-to-device GB/s from pinned memory (4 GiB, best of 3)."""
    import torch

    size = 4 << 30
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    dst.copy_(src)
    torch.cuda.synchronize()
    return _copy_GBps(dst, src)


def _copy_GBps(dst, src, non_blocking: bool = True, repeats: int = 3) -> float:
    """GB/s of `dst.copy_(src)` (then synchronised), best of `repeats`."""
    import torch

    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=non_blocking)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return src.numel() * src.element_size() / min(ts) / 1e9


def _fingerprint(engine) -> list[tuple[float, float]]:
    """(sum, sum of squares) in float64 of every tensor of the module's and the optimizer's
    state: equal lists after two loads mean the same weights, fp32 masters and moments."""
    import torch

    out: list[tuple[float, float]] = []

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and obj.numel():
                t = obj.detach().double()
                out.append((float(t.sum()), float((t * t).sum())))
                del t
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k])
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    walk(engine.module.state_dict())
    walk(engine.optimizer.state_dict())
    return out


def sec_rollback(args) -> dict:
    """What `Trainer._recover` does for a NaN 3 steps after a save: plan_memory_rollback, then
    CheckpointManager.load, timed to the end of the device copies."""
    import shutil

    from ds3d.checkpoints.engine_io import CheckpointManager, Rank, RestorePlan

    cfg, device, layout, TrainStep = engine_stack(args, ["checkpoint.keep_last=1"])
    step_fn = TrainStep(cfg, layout, device)
    engine = step_fn.engine
    run_dir = Path(args.work) / "rollback-run"
    ckpt = CheckpointManager(cfg.checkpoint_settings(), run_dir, Rank(0, 1, 0, 1, 1, 1), device,
                             lambda *a, **k: None)
    out: dict = {}
    if device.type == "cuda":
        out["h2d_pinned_GBps"] = _h2d_GBps(device)
    progress("built", h2d_GBps=out.get("h2d_pinned_GBps"))
    step = 0
    ckpt.prepare(engine)  # as the trainer does after its restore: pin while training
    while step < 3 or (not ckpt.snapshot.arena_ready() and step < 200):
        step_fn.run(step)
        step += 1
    sync(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step_fn.run(step)
        sync(device)
        times.append(time.perf_counter() - t0)
        step += 1
    out["step_s"] = statistics.median(times)
    saved = step
    out["blocked_s"] = ckpt.save(engine, saved, {"iteration": saved}, saved, {"step": saved})
    held = ckpt.snapshot.held()
    out["arena_pinned"] = ckpt.snapshot._arena is not None
    out["arena_in_node_memory"] = ckpt.node is not None and ckpt.node.arena_path.exists()
    out["transparent_hugepage"] = _thp()
    out["transparent_hugepage_shmem"] = _thp("shmem_enabled")  # node memory's /dev/shm
    out["state_bytes"] = sum(t.numel() * t.element_size() for snap in
                             (held.files.values() if held else []) for t in _tensors_of(snap))
    for _ in range(3):  # the NaN comes 3 steps after the save, its files still being written
        step_fn.run(step)
        step += 1
    sync(device)
    out["write_busy_at_rollback"] = ckpt.snapshot.busy()
    progress("saved", blocked=out["blocked_s"], bytes=out["state_bytes"],
             busy=out["write_busy_at_rollback"])
    t0 = time.perf_counter()
    plan = ckpt.plan_memory_rollback(newest=step - 1)
    if plan is None:
        return {**out, "error": "nothing held in host memory to roll back to"}
    ckpt.load(engine, plan)
    sync(device)
    out["memory_rollback_s"] = time.perf_counter() - t0
    out["source"] = plan.source
    progress("memory rollback", seconds=out["memory_rollback_s"])
    from_memory = _fingerprint(engine)
    for _ in range(2):  # train on, so the disk load has something to undo
        step_fn.run(step)
        step += 1
    ckpt.snapshot.wait()  # the local copy, complete (the store upload is not needed)
    t0 = time.perf_counter()
    ckpt.load(engine, RestorePlan(step=saved, tag=plan.tag, manifest=plan.manifest,
                                  universal=False, source="local"))
    sync(device)
    out["local_rollback_s"] = time.perf_counter() - t0  # read only, without the sha256 pass
    out["memory_equals_local"] = _fingerprint(engine) == from_memory
    progress("local rollback", seconds=out["local_rollback_s"],
             equal=out["memory_equals_local"])
    ckpt.release_node_memory()
    ckpt.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    out["memory_in_step_times"] = out["memory_rollback_s"] / out["step_s"]
    out["local_over_memory"] = out["local_rollback_s"] / out["memory_rollback_s"]
    if out.get("h2d_pinned_GBps"):
        out["floor_s"] = out["state_bytes"] / (out["h2d_pinned_GBps"] * 1e9)
        out["memory_over_floor"] = out["memory_rollback_s"] / out["floor_s"]
    out["note"] = ("floor = host copy's bytes / pinned H2D bandwidth; local_rollback_s reads "
                   "the files DeepSpeed wrote, after the write finished (no sha256, no wait "
                   "for the upload: the old rollback had both)")
    return out


def _tensors_of(obj) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_of(v)]
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return [t for v in obj for t in _tensors_of(v)]
    return []


# -- orchestration ---------------------------------------------------------------------------


def run_section(name: str, args) -> dict:
    if name.startswith("memory_"):
        return sec_memory(args, name[len("memory_"):])
    if name == "deepspeed_unfused":
        os.environ["DS3D_FUSED_KERNELS"] = "0"
    if name.endswith("_stock_bf16"):  # DeepSpeed's own BF16_Optimizer paths
        os.environ["DS3D_DEEPSPEED_BF16"] = "stock"
    fn = {"peak": sec_peak, "minimal": sec_minimal,
          "minimal_unfused_adam": lambda a: sec_minimal(a, fused_adam=False),
          "minimal_math_attention": lambda a: sec_minimal(a, attention="math"),
          "minimal_compile": lambda a: sec_minimal(a, compile_=True),
          "deepspeed": sec_deepspeed, "deepspeed_unfused": sec_deepspeed,
          "deepspeed_compile": lambda a: sec_deepspeed(a, compile_=True),
          "deepspeed_stock_bf16": sec_deepspeed,
          "deepspeed_compile_stock_bf16": lambda a: sec_deepspeed(a, compile_=True),
          "ds3d": sec_ds3d,
          "ds3d_compile": lambda a: sec_ds3d(a, compile_=True),
          "profile": sec_profile, "checkpoint": sec_checkpoint, "restore": sec_restore,
          "restore_process_memory": lambda a: sec_restore(
              a, ("checkpoint.keep_in_node_memory=false",)),
          "engine_build": sec_engine_build, "engine_build_profile": sec_engine_build_profile,
          "rollback": sec_rollback,
          "goodput": sec_goodput, "pinning": sec_pinning,
          "restore_profiled": lambda a: sec_restore(a, profiled=True)}[name]
    return fn(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated; also: " + ", ".join(OPTIONAL) + ", memory (all of "
                    + ", ".join("memory_" + k for k in MEMORY_CONFIGS) + ")")
    ap.add_argument("--profile-dir", default=None,
                    help="profile 2 steps after the timed ones; kernel tables written here")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--goodput-window", type=float, default=GOODPUT_WINDOW_S,
                    help="seconds of training measured in the goodput section's faulty run")
    ap.add_argument("--goodput-reference", type=float, default=GOODPUT_REFERENCE_S,
                    help="... and in its fault-free run")
    ap.add_argument("--goodput-every", type=float, default=GOODPUT_EVERY_S,
                    help="seconds between the faults (NaN, crash, spike), the first at half")
    ap.add_argument("--goodput-memory-interval", default=str(GOODPUT_MEMORY_INTERVAL),
                    type=lambda v: v if v == "auto" or v.isdigit() else
                    ap.error(f"--goodput-memory-interval: steps or auto, not {v!r}"),
                    help='the goodput runs\' checkpoint.memory_interval: steps, or "auto" '
                    "(Young-Daly, with an MTBF prior of --goodput-every)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--section-timeout", type=float, default=420.0,
                    help="seconds after which a section is killed (default 420)")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peak", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--d2h-pinned", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.section:  # child: one section, result as the last line
        result = run_section(args.section, args)
        print("RESULT " + json.dumps(result, default=float), flush=True)
        os._exit(0)  # skip teardown of NCCL/DeepSpeed state: the parent has what it needs

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ds3d-gpu-bench-")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick,
                    "command": " ".join(sys.argv), "sections": {}}
    try:
        import deepspeed
        import torch

        report.update(torch=torch.__version__, deepspeed=deepspeed.__version__,
                      gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    except Exception as e:  # recorded, not fatal: the sections report their own failures
        report["env_error"] = repr(e)
    names = [n for part in args.sections.split(",") for n in
             (["memory_" + k for k in MEMORY_CONFIGS] if part == "memory" else [part])]
    for name in names:
        peak = report["sections"].get("peak", {})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--device",
               args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--work", work, "--goodput-window", str(args.goodput_window),
               "--goodput-reference", str(args.goodput_reference),
               "--goodput-every", str(args.goodput_every),
               "--goodput-memory-interval", args.goodput_memory_interval] + \
            (["--quick"] if args.quick else []) + \
            (["--profile-dir", args.profile_dir] if args.profile_dir else [])
        if peak.get("bf16_matmul_tflops"):
            cmd += ["--peak", str(peak["bf16_matmul_tflops"]),
                    "--d2h-pinned", str(peak["d2h_pinned_GBps"])]
        t0 = time.perf_counter()
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                   NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1",
                   DS_ACCELERATOR="cuda" if args.device == "cuda" else "cpu")
        res = run_child(cmd, env, args.section_timeout)
        res["section_wall_s"] = round(time.perf_counter() - t0, 1)
        report["sections"][name] = res
        out_path.write_text(json.dumps(report, indent=2, default=float) + "\n")
        print(f"[{name}] {json.dumps(res, default=float)[:400]}", flush=True)
    print_table(report)


def run_child(cmd: list[str], env: dict, timeout_s: float) -> dict:
    """Runs one section; echoes its PROGRESS lines as they come (a section cut short by the
    device call's limit still says how far it got) and kills it after `timeout_s`."""
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    tail: list[str] = []

    def pump_stderr() -> None:
        for line in proc.stderr:
            if line.startswith("PROGRESS "):
                print("  " + line.rstrip(), flush=True)
            tail.append(line)
            del tail[:-60]

    reader = threading.Thread(target=pump_stderr, daemon=True)
    reader.start()
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    stdout = proc.stdout.read()
    proc.wait()
    timer.cancel()
    reader.join(timeout=5)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][7:])
    return {"error": f"exit {proc.returncode}" + (" (section timeout)" if proc.returncode == -9
                                                  else ""), "stderr": "".join(tail)[-4000:]}


def progress(what: str, **numbers) -> None:
    """A line the parent echoes while the section runs."""
    print("PROGRESS " + what + " " + json.dumps(numbers, default=float), file=sys.stderr,
          flush=True)


def print_table(report: dict) -> None:
    s = report["sections"]
    print("\nsetup                         s/step   tokens/s   MFU(989)  MFU(meas.)  first step s")
    for name in ("minimal", "minimal_unfused_adam", "minimal_math_attention", "minimal_compile",
                 "deepspeed_unfused", "deepspeed_stock_bf16", "deepspeed",
                 "deepspeed_compile_stock_bf16", "deepspeed_compile", "ds3d", "ds3d_compile"):
        r = s.get(name, {})
        if "step_s" in r:
            print(f"{name:28} {r['step_s']:7.4f} {r['tokens_per_s']:10.0f} "
                  f"{r['mfu_datasheet']:9.1%} {r.get('mfu_measured_peak', 0):10.1%} "
                  f"{r.get('first_step_s', 0):12.1f}")
    if "step_s" in s.get("ds3d", {}) and "step_s" in s.get("deepspeed", {}):
        ratio = s['ds3d']['step_s'] / s['deepspeed']['step_s']
        print(f"ds3d / plain DeepSpeed step time: {ratio:.4f}")
    mem = {k[len("memory_"):]: v for k, v in s.items() if k.startswith("memory_")}
    if mem:
        print("\nmemory config      predicted GiB  max allocated  max reserved  error vs reserved")
    for k, r in mem.items():
        if "predicted_GiB" in r:
            print(f"{k:18} {r['predicted_GiB']:13.2f} {r['max_allocated_GiB']:14.2f} "
                  f"{r['max_reserved_GiB']:13.2f} {r['error_vs_reserved']:+17.1%}")
    c = s.get("checkpoint", {})
    if "ds3d_blocked_s" in c:
        print(f"checkpoint: sync {c['sync_blocked_s']} s, ds3d blocked {c['ds3d_blocked_s']} s, "
              f"floor {c.get('floor_s')} s, bytes {c.get('state_bytes')}")
    r = s.get("rollback", {})
    if "memory_rollback_s" in r:
        print(f"rollback: from memory {r['memory_rollback_s']:.3f} s "
              f"({r['memory_in_step_times']:.1f} step-times), floor {r.get('floor_s')} s, "
              f"local tier {r['local_rollback_s']:.2f} s, equal {r['memory_equals_local']}")


if __name__ == "__main__":
    main()
