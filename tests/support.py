"""Helpers for tests that start real training processes through torchrun (the elastic agent)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
               DS3D_LOG_FORMAT="json", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun(run_dir: Path, nproc: int, config: str = "tiny", sets: list[str] | None = None,
             extra: list[str] | None = None, timeout: float = 300,
             env: dict[str, str] | None = None,
             max_restarts: int = 0) -> subprocess.CompletedProcess:
    """Runs one job to its end under ds3d's node agent without a daemon: `python -m
    ds3d.daemon.agent` is torch elastic's LocalElasticAgent, here with a c10d rendezvous it
    hosts itself (as torchrun --standalone), its workers forked from a forkserver that imported
    the trainer once (a 4-rank start is a fork, not ~16 CPU-s of imports). The agent restarts
    a failed group up to `max_restarts` times, as `torchrun --max-restarts`. The agent's output
    and every worker's stdout/stderr are gathered in RUN_DIR/torchrun.log."""
    from ds3d.daemon.launcher import AgentSpec
    from ds3d.daemon.ports import hold_port

    args = ["--config", config] + [a for s in sets or [] for a in ("--set", s)] + (extra or [])
    control = run_dir / "control"
    control.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs" / "torchrun"
    spec_file = control / "torchrun-agent.json"
    # the rendezvous port, held by this process until the agent is done: outside the ephemeral
    # range and held, so neither a bind(0) nor a parallel test can take it before the agent's
    # c10d store binds it (daemon/ports.py); the agent holds the workers' MASTER_PORT alike
    with hold_port() as rendezvous:
        AgentSpec.standalone(run_dir, nproc, rendezvous.port, max_restarts, "torchrun",
                             worker_args=args,
                             # the job's own op build folder, seeded from the warm cache (as
                             # ds3dd does): a worker killed in one test while it loads an op
                             # leaves no lock for others
                             extensions_dir=str(run_dir / "torch_extensions"),
                             warm_extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR")).write(spec_file)
        # the agent's output to files, not pipes: the forkserver and multiprocessing's
        # resource tracker inherit them and hold a pipe open ~0.7 s after the agent exited,
        # which a pipe's reader waits out (at every run of every test)
        out, err = control / "torchrun-agent.stdout", control / "torchrun-agent.stderr"
        with open(out, "w") as out_fh, open(err, "w") as err_fh:
            proc = subprocess.run([sys.executable, "-m", "ds3d.daemon.agent", "--spec",
                                   str(spec_file)],
                                  env=worker_env(DS3D_RUN_DIR=str(run_dir), **(env or {})),
                                  stdout=out_fh, stderr=err_fh, text=True, timeout=timeout)
        proc.stdout, proc.stderr = (f.read_text(errors="replace") for f in (out, err))
    logs_by_rank = {f.relative_to(logs).as_posix(): f.read_text(errors="replace")
                    for f in sorted(logs.glob("**/std*.log"))}
    (run_dir / "torchrun.log").write_text(proc.stdout + proc.stderr +
                                          "".join(logs_by_rank.values()))
    if proc.returncode != 0:
        raise AssertionError(f"agent exited {proc.returncode}:\n{proc.stderr[-3000:]}\n"
                             + "".join(_failure_excerpt(name, text)
                                       for name, text in logs_by_rank.items()))
    return proc


def _failure_excerpt(name: str, text: str) -> str:
    """A worker log's last lines and, when it holds one, its last traceback whole: the rank
    that failed first is the one to read, and its error is rarely in the last 2000 chars."""
    cut = text.rfind("Traceback (most recent call last)")
    tail = text[-2000:]
    if cut >= 0 and cut < len(text) - 2000:
        tail = text[cut:cut + 4000] + "\n[...]\n" + tail
    return f"\n--- {name} ---\n{tail}"


def records(run_dir: Path, rank: int = 0, kind: str | None = None) -> list[dict[str, Any]]:
    """A rank's records on disk, every segment of its reports in order (trainer/report.py)."""
    from ds3d.trainer.report import read_rank_records

    return [r for r in read_rank_records(run_dir, rank) if kind is None or r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, as reported by rank 0 (the last report wins for re-run steps)."""
    return {r["step"]: r["loss"] for r in records(run_dir, 0, "step")}


def byte_level_bpe(path: Path, vocab_size: int = 512) -> Path:
    """A real byte-level BPE tokenizer (GPT-2's algorithm and pre-tokenizer, `<|endoftext|>` as
    its end-of-document token) trained on the public-domain text in trainer/assets and saved as
    a tokenizer.json: GPT-2's own files are not shipped by any package and cannot be downloaded
    here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(REPO / "trainer" / "assets" / "public_domain.txt")], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path
