"""Entry point of one training process (one rank), started by torch.distributed.elastic.

    torchrun --nproc-per-node 4 -m ds3d.trainer.worker --run-dir RUN_DIR

RUN_DIR/job.json holds the JobConfig (ds3dd writes it; `--config`/`--preset` write it for a run
without the daemon). The rank, world size and restart count come from the elastic agent's
environment (RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_RESTART_COUNT).

Exit codes (trainer/exit_codes.py): 0 = the job ended as asked (completed, paused, stopped);
EXIT_CONFIG (2) = configuration refused, by ds3d or by DeepSpeed (restarting would not help);
12 = out of memory (an `oom` fault record with the evidence was written first, trainer/oom.py);
anything else is a crash the agent may restart.

`main` is wrapped in torch elastic's `@record`: an exception, and a refusal, is written as JSON to
the error file the agent names (TORCHELASTIC_ERROR_FILE), so the agent reads the worker's error
from there instead of scraping its stderr.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from .config import JobConfig, build_job_config
from .errors import Ds3dError
from .exit_codes import EXIT_CONFIG
from .process_age import StartupTimeline

if TYPE_CHECKING:
    from .loop import Trainer


def config_refusal(e: BaseException) -> bool:
    """True for errors that a restart cannot fix: ds3d's own refusals (not those it marks
    retryable: a store outage, a checkpoint conversion that failed) and DeepSpeed refusing
    its configuration (DeepSpeedConfigError, or a pydantic ValidationError of its config
    models, e.g. an unknown key under `zero_optimization`)."""
    if isinstance(e, Ds3dError):
        return not e.retryable
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        return True
    return type(e).__name__ == "DeepSpeedConfigError" and \
        type(e).__module__.startswith("deepspeed.")


def _load_config(args: argparse.Namespace, rank: int) -> tuple[JobConfig, Path]:
    """With --config every rank builds the same config itself (no rank reads a file another is
    still writing); rank 0 records it as RUN_DIR/job.json. Otherwise job.json is the source."""
    run_dir = Path(args.run_dir)
    job_file = run_dir / "job.json"
    if not args.config:
        return JobConfig.load_json(job_file), run_dir
    cfg = build_job_config(args.config, args.set or [])
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = job_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(cfg.dump_json())
        os.replace(tmp, job_file)
    return cfg, run_dir


@record
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ds3d-worker", description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, help="job run directory (holds job.json)")
    ap.add_argument("--config", help="preset or TOML; written to RUN_DIR/job.json first")
    ap.add_argument("--set", action="append", help="override KEY=VALUE (with --config)")
    ap.add_argument("--stop-at-step", type=int, help="end this run at step N with a checkpoint, "
                    "as a pause would (a later run resumes from it)")
    args = ap.parse_args(argv)

    # Stacks of every thread on SIGUSR1 (the hang detector asks for them before killing).
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    from .layout import ProcessEnv

    startup = StartupTimeline()
    startup.mark("imported")  # exec'd: python and torch's import; forked: ~0
    env = ProcessEnv.from_env()
    from ds3d.checkpoints.logs import configure_logging, tolerate_full_disk_on_std_streams

    tolerate_full_disk_on_std_streams()
    log = configure_logging(rank=env.rank, restart=env.restart_count)
    try:
        cfg, run_dir = _load_config(args, env.rank)
        startup.mark("config")
        return _train(cfg, run_dir, env, args.stop_at_step, startup)
    except Exception as e:  # noqa: BLE001 - a refusal exits EXIT_CONFIG, the rest re-raised
        if not config_refusal(e):
            raise  # @record writes the error file; the agent may restart the group
        ErrorHandler().record_exception(e)  # the agent's structured error, as @record would
        log.error("refused", error=str(e))
        print(f"ds3d-worker: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _run_to_end(trainer: Trainer) -> None:
    """Trains to the end, its last checkpoint durable. This rank's node memory files go on a
    clean exit and on a refusal (EXIT_CONFIG: the group is not restarted, so nothing reads
    them; under plain torchrun they stayed in /dev/shm); any other error keeps them for the
    restart."""
    try:
        trainer.wait_for_store(trainer.run())
    except Exception as e:
        if config_refusal(e):
            trainer.ckpt.release_node_memory()
        raise
    else:
        trainer.ckpt.release_node_memory()
    finally:
        trainer.close()


def _train(cfg: JobConfig, run_dir: Path, env, stop_at_step: int | None,
           startup: StartupTimeline) -> int:
    import torch

    from .layout import ParallelLayout, check_precision, init_distributed, pick_device
    from .loop import Trainer
    from .oom import exit_now, is_oom, oom_evidence, report_oom
    from .report import Reporter
    from .startup_profile import StartupProfile

    torch.manual_seed(cfg.train.seed)
    device = pick_device(cfg, env.local_rank)
    startup.mark("device")
    init_distributed(device, timeout=timedelta(seconds=float(os.environ.get(
        "DS3D_COLLECTIVE_TIMEOUT_S", 300))))
    startup.mark("process_group")
    check_precision(cfg, device)  # DeepSpeed's accelerator is the device's from here on
    cfg = cfg.at_world_size(env.world_size)  # an elastic job after losing or regaining nodes
    layout = ParallelLayout(cfg, env)
    startup.mark("layout")
    trainer: Trainer | None = None
    profile = StartupProfile.from_env(env.rank, env.restart_count)  # DS3D_STARTUP_PROFILE
    try:
        trainer = Trainer(cfg, run_dir, env, layout, device, stop_at_step, startup.seconds)
        if profile is not None:
            profile.part("build_and_load")
            trainer.after_first_step = lambda: profile.stop("first_step")
        _run_to_end(trainer)
    except (RuntimeError, MemoryError) as e:
        if not is_oom(e):
            raise
        last = trainer.step if trainer is not None else None  # None: still building
        evidence = oom_evidence(e, cfg, device, last, layout)
        evidence["run_id"] = env.run_id  # one incident per group incarnation (daemon/oom.py)
    else:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return 0
    # outside the except block: the failed step's frames (and their tensors) are released
    reporter = Reporter(run_dir, env.rank, env.restart_count)
    code = report_oom(evidence, reporter.emit, env.rank)
    reporter.close()
    exit_now(code)  # no teardown: the other ranks wait in a collective with this one
    return code


if __name__ == "__main__":
    sys.exit(main())
