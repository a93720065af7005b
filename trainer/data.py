"""Training data whose order is a pure function of (seed, batch index, DP rank).

Why pure: a job resumed at step N, or reshaped from DP 4 to DP 2, must consume exactly the samples
an uninterrupted job would. Nothing here has state that a checkpoint must carry except the step,
and NaN recovery can skip a window of batches by listing it in `data.skip_batches`.

Global batch b holds samples [b*G, (b+1)*G) (G = global batch size). DP rank r takes the
contiguous slice [r*G/dp, (r+1)*G/dp), split into micro-batches in order, so the union over ranks
and micro-batches is the same set for every DP degree: the loss averaged by DeepSpeed is the same.

Sources:
  * a flat token file (nanoGPT-style `.bin`: uint16 or uint32 tokens, memory-mapped); sample i is
    the window starting at a pseudo-random offset drawn from (seed, i);
  * "synthetic": learnable sequences (a random motif repeated with a random period), so the loss
    of a small model visibly falls without any download.

`python -m ds3d.trainer.data encode IN.txt OUT.bin` makes a byte-level token file from text.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator

import numpy as np

from .config import DataConfig, JobConfig


def batch_index(step: int, skip_batches: list[tuple[int, int]]) -> int:
    """The data batch used by optimizer step `step` (0-based), skipping the listed windows."""
    b = step
    for start, end in sorted(skip_batches):
        if start <= b:
            b += end - start
    return b


class TokenSource:
    """Returns sample i (seq_len + 1 tokens) as int64, deterministically."""

    def __init__(self, data: DataConfig, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len, self.vocab, self.seed = seq_len, vocab_size, seed
        self.tokens: np.ndarray | None = None
        if data.source != "synthetic":
            path = Path(data.source)
            if not path.is_file():
                from .errors import ConfigError
                raise ConfigError(f"data.source={data.source!r} does not exist on this node")
            self.tokens = np.memmap(path, dtype=np.dtype(data.dtype), mode="r")
            if len(self.tokens) <= seq_len + 1:
                from .errors import ConfigError
                raise ConfigError(f"{path} holds {len(self.tokens)} tokens, fewer than one "
                                  f"sample of seq_len + 1 = {seq_len + 1}")

    def samples(self, first: int, count: int) -> np.ndarray:
        return np.stack([self._sample(i) for i in range(first, first + count)])

    def _sample(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        n = self.seq_len + 1
        if self.tokens is not None:
            start = int(rng.integers(0, len(self.tokens) - n))
            out = np.asarray(self.tokens[start:start + n], dtype=np.int64)
            if out.max(initial=0) >= self.vocab:
                from .errors import ConfigError
                raise ConfigError(f"token id {int(out.max())} in the data file is >= "
                                  f"model.vocab_size={self.vocab}; fix vocab_size or data.dtype")
            return out
        period = int(rng.integers(2, 9))
        motif = rng.integers(0, self.vocab, size=period)
        return np.resize(motif, n).astype(np.int64)


class BatchPlan:
    """Which samples each (step, micro-batch) of one DP rank trains on."""

    def __init__(self, cfg: JobConfig, dp: int, dp_rank: int) -> None:
        self.cfg, self.dp, self.dp_rank = cfg, dp, dp_rank
        self.micro = cfg.train.micro_batch_size
        self.gas = cfg.train.grad_accum(dp)
        self.global_batch = self.micro * self.gas * dp
        self.source = TokenSource(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                                  cfg.train.seed)

    def micro_batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        b = batch_index(step, self.cfg.data.skip_batches)
        first = b * self.global_batch + self.dp_rank * self.micro * self.gas + micro * self.micro
        s = self.source.samples(first, self.micro)
        return s[:, :-1], s[:, 1:]

    def step_iterator(self, step: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m in range(self.gas):
            yield self.micro_batch(step, m)


def encode_text(text_path: str | Path, out_path: str | Path) -> int:
    """Byte-level tokens (vocab 256) of a UTF-8 text, as uint16."""
    data = np.frombuffer(Path(text_path).read_bytes(), dtype=np.uint8).astype(np.uint16)
    data.tofile(out_path)
    return len(data)


def _main() -> None:
    ap = argparse.ArgumentParser(prog="python -m ds3d.trainer.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    enc = sub.add_parser("encode", help="text file -> byte-level uint16 token file")
    enc.add_argument("text")
    enc.add_argument("out")
    args = ap.parse_args()
    n = encode_text(args.text, args.out)
    print(f"wrote {n} tokens to {args.out} (use data.source={args.out!r}, model.vocab_size=256)")


if __name__ == "__main__":
    _main()
