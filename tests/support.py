"""Helpers for tests that start real training processes through torchrun (the elastic agent)."""

from __future__ import annotations

import json
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
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs one job to its end under torchrun --standalone (c10d rendezvous on a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "ds3d.trainer.worker", "--run-dir", str(run_dir),
           "--config", config]
    for s in sets or []:
        cmd += ["--set", s]
    cmd += extra or []
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=worker_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    (run_dir / "torchrun.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def records(run_dir: Path, rank: int = 0, kind: str | None = None) -> list[dict[str, Any]]:
    path = run_dir / "reports" / f"rank-{rank:05d}.jsonl"
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if kind is None or r["kind"] == kind]


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
