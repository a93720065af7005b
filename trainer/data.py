"""Training data whose order is a pure function of (seed, batch index, DP rank).

Why pure: a job resumed at step N, or reshaped from DP 4 to DP 2, must consume exactly the samples
an uninterrupted job would. Nothing here has state that a checkpoint must carry except the step,
and NaN recovery can skip a window of batches by listing it in `data.skip_batches`.

Global batch b holds samples [b*G, (b+1)*G) (G = global batch size). DP rank r takes the
contiguous slice [r*G/dp, (r+1)*G/dp), split into micro-batches in order, so the union over ranks
and micro-batches is the same set for every DP degree: the loss averaged by DeepSpeed is the same.

Sources (`data.source`, see docs/data.md):
  * "indexed": Megatron indexed datasets (PREFIX.bin + PREFIX.idx, as Megatron-LM,
    Megatron-DeepSpeed and GPT-NeoX preprocessing write them; indexed_dataset.py), one or a
    weighted blend (`data.blend`). Sample i comes from the dataset the blend assigns to i (a
    low-discrepancy sequence, so every prefix of the order follows the weights closely), at a
    pseudo-random position drawn from (seed, dataset, i): anywhere in the concatenated documents
    ("cross", Megatron's GPTDataset), or at a document start ("start");
  * a flat token file (nanoGPT-style `.bin`: uint16 or uint32 tokens, memory-mapped); sample i is
    the window starting at a pseudo-random offset drawn from (seed, i);
  * "synthetic": learnable sequences (a random motif repeated with a random period), so the loss
    of a small model visibly falls without any download.

`python -m ds3d.trainer.data encode` writes an indexed dataset from text with a real tokenizer
(text_tokenizer.py), or a byte-level flat file (see `encode --help`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from .config import DataConfig, JobConfig
from .errors import ConfigError, Ds3dError

# 1/golden ratio: i * PHI_INV mod 1 is the most evenly spread sequence in [0, 1)
PHI_INV = (math.sqrt(5.0) - 1.0) / 2.0


def batch_index(step: int, skip_batches: list[tuple[int, int]]) -> int:
    """The data batch used by optimizer step `step` (0-based), skipping the listed windows."""
    b = step
    for start, end in sorted(skip_batches):
        if start <= b:
            b += end - start
    return b


class SampleSource(Protocol):
    def sample(self, i: int) -> np.ndarray:
        """Sample i: seq_len + 1 token ids as int64, the same on every call and every rank."""
        ...


class SyntheticSource:
    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len, self.vocab, self.seed = seq_len, vocab_size, seed

    def sample(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        period = int(rng.integers(2, 9))
        motif = rng.integers(0, self.vocab, size=period)
        return np.resize(motif, self.seq_len + 1).astype(np.int64)


class FlatTokenFile:
    def __init__(self, path: Path, dtype: str, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len, self.vocab, self.seed = seq_len, vocab_size, seed
        if not path.is_file():
            raise ConfigError(f"data.source={str(path)!r} does not exist on this node")
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        if len(self.tokens) <= seq_len + 1:
            raise ConfigError(f"{path} holds {len(self.tokens)} tokens, fewer than one "
                              f"sample of seq_len + 1 = {seq_len + 1}")

    def sample(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        n = self.seq_len + 1
        start = int(rng.integers(0, len(self.tokens) - n))
        return _checked(self.tokens[start:start + n], self.vocab, "the data file")


class IndexedBlend:
    """Megatron indexed datasets, blended by weight; see the module docstring for the order."""

    def __init__(self, data: DataConfig, seq_len: int, vocab_size: int, seed: int) -> None:
        from .indexed_dataset import IndexedDataset

        self.seq_len, self.vocab, self.seed = seq_len, vocab_size, seed
        self.align = data.document_boundaries == "start"
        self.datasets = [IndexedDataset(entry.prefix) for entry in data.blend]
        weights = np.array([entry.weight for entry in data.blend], dtype=np.float64)
        self.cumulative = np.cumsum(weights / weights.sum())
        self.cumulative[-1] = 1.0
        # per dataset: how many positions a sample may start at (windows, or document starts)
        n = seq_len + 1
        self.starts = []
        for ds in self.datasets:
            if self.align:
                count = int(np.searchsorted(ds.doc_starts, ds.num_tokens - n, side="right"))
            else:
                count = ds.num_tokens - n + 1
            if count <= 0:
                raise ConfigError(f"{ds.prefix}: {ds.num_tokens} tokens hold no sample of "
                                  f"seq_len + 1 = {n} tokens"
                                  + (" starting at a document start" if self.align else ""))
            self.starts.append(count)

    def dataset_of(self, i: int) -> int:
        """The blend's choice for sample i: the point (i + seed) * PHI_INV mod 1 falls into one
        dataset's share of [0, 1). Over any n consecutive samples each dataset's count is within
        O(log n) of n * weight (Megatron's BlendedDataset is exact but needs the whole prefix)."""
        if len(self.datasets) == 1:
            return 0
        u = math.fmod((i + self.seed) * PHI_INV, 1.0)
        return int(np.searchsorted(self.cumulative, u, side="right"))

    def sample(self, i: int) -> np.ndarray:
        d = self.dataset_of(i)
        ds = self.datasets[d]
        k = int(np.random.default_rng([self.seed, d, i]).integers(0, self.starts[d]))
        start = int(ds.doc_starts[k]) if self.align else k
        return _checked(ds.tokens[start:start + self.seq_len + 1], self.vocab, ds.prefix)


def _checked(window: np.ndarray, vocab: int, where: str) -> np.ndarray:
    out = np.asarray(window, dtype=np.int64)
    if out.size and (out.max() >= vocab or out.min() < 0):
        bad = int(out.max()) if out.max() >= vocab else int(out.min())
        raise ConfigError(f"token id {bad} in {where} is outside model.vocab_size={vocab}; fix "
                          "model.vocab_size (at least the tokenizer's vocabulary) or data.dtype")
    return out


def open_source(data: DataConfig, seq_len: int, vocab_size: int, seed: int) -> SampleSource:
    if data.source == "synthetic":
        return SyntheticSource(seq_len, vocab_size, seed)
    if data.source == "indexed":
        return IndexedBlend(data, seq_len, vocab_size, seed)
    return FlatTokenFile(Path(data.source), data.dtype, seq_len, vocab_size, seed)


class TokenSource:
    """Returns sample i (seq_len + 1 tokens) as int64, deterministically."""

    def __init__(self, data: DataConfig, seq_len: int, vocab_size: int, seed: int) -> None:
        self.source = open_source(data, seq_len, vocab_size, seed)

    def samples(self, first: int, count: int) -> np.ndarray:
        return np.stack([self.source.sample(i) for i in range(first, first + count)])


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


def data_problems(cfg: JobConfig) -> list[str]:
    """What is wrong with the job's [data] section, each with what to do (validate_job). Indexed
    datasets are opened (headers, sizes, document index; not every token), so the files must be
    readable where the job is validated (as on every worker). The tokenizer, which no worker
    reads, is checked apart (tokenizer_problems: where the job is built and submitted)."""
    d, problems = cfg.data, []
    if d.source != "indexed":
        if d.blend:
            problems.append(f"data.blend is read only with data.source=\"indexed\" (source is "
                            f"{d.source!r}); set data.source=\"indexed\" or remove data.blend")
        if d.document_boundaries is not None:
            problems.append("data.document_boundaries applies to indexed datasets only; set "
                            "data.source=\"indexed\" or remove it")
    elif not d.blend:
        problems.append('data.source="indexed" needs data.blend, e.g. blend = [{prefix = '
                        '"/data/corpus_text_document", weight = 1.0}] (prefix without .bin/.idx)')
    seen: set[str] = set()
    for k, entry in enumerate(d.blend if d.source == "indexed" else []):
        where = f"data.blend[{k}].prefix={entry.prefix!r}"
        if entry.prefix.endswith((".bin", ".idx")):
            problems.append(f"{where}: give the prefix without .bin/.idx, e.g. "
                            f"{entry.prefix[:-4]!r}")
        elif not Path(entry.prefix).is_absolute():
            problems.append(f"{where}: use an absolute path (workers run in the job's run "
                            "directory)")
        elif entry.prefix in seen:
            problems.append(f"{where} is listed twice; list it once with the summed weight")
        else:
            seen.add(entry.prefix)
            try:
                from .indexed_dataset import IndexedDataset

                ds = IndexedDataset(entry.prefix)
            except ConfigError as e:
                problems.append(f"{where}: {e}")
            else:
                if ds.num_tokens < cfg.model.seq_len + 1:
                    problems.append(f"{where}: {ds.num_tokens} tokens, fewer than one sample "
                                    f"(model.seq_len + 1 = {cfg.model.seq_len + 1})")
    return problems


def tokenizer_problems(cfg: JobConfig) -> list[str]:
    """What is wrong with data.tokenizer (loaded: its vocabulary must fit model.vocab_size)."""
    if cfg.data.tokenizer is None:
        return []
    return _tokenizer_problems(cfg.data.tokenizer, cfg.model.vocab_size)


def _tokenizer_problems(spec: str, vocab_size: int) -> list[str]:
    from .text_tokenizer import TextTokenizer

    if Path(spec).exists() and not Path(spec).is_absolute():
        return [(f"data.tokenizer={spec!r}: use an absolute path (workers run in the job's run "
                 "directory)")]
    try:
        tok = TextTokenizer(spec)
    except ConfigError as e:
        return [f"data.tokenizer={spec!r}: {e}"]
    if tok.vocab_size > vocab_size:
        return [(f"data.tokenizer={spec!r} has {tok.vocab_size} tokens, more than "
                 f"model.vocab_size={vocab_size}; set model.vocab_size to at least "
                 f"{tok.vocab_size} (padded, e.g. {-(-tok.vocab_size // 128) * 128})")]
    return []


# -- encode ----------------------------------------------------------------------------------


def encode_text(text_path: str | Path, out_path: str | Path) -> int:
    """Byte-level tokens (vocab 256) of a UTF-8 text, as a flat uint16 file."""
    data = np.frombuffer(Path(text_path).read_bytes(), dtype=np.uint8).astype(np.uint16)
    data.tofile(out_path)
    return len(data)


def read_documents(path: Path, json_key: str) -> Iterator[str]:
    """The documents of one input: a JSON-lines file (.jsonl/.json: one object per line, the
    text under `json_key`, as Megatron's preprocess_data.py reads), else the whole file."""
    if path.suffix not in (".jsonl", ".json"):
        yield path.read_text(encoding="utf-8")
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not a JSON object ({e.msg}); JSON-lines input "
                                  "has one object per line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(json_key), str):
                raise ConfigError(f"{path}:{n}: no string field {json_key!r}; pick the field "
                                  "with --json-key")
            yield obj[json_key]


def encode_indexed(inputs: list[Path], prefix: str, tokenizer: str, json_key: str = "text",
                   append_eod: bool = True, eod_token: str | None = None) -> dict[str, int]:
    """Tokenizes every document of `inputs` into PREFIX.bin/PREFIX.idx (one sequence per
    document, the end-of-document token appended, as Megatron's `--append-eod`)."""
    from .indexed_dataset import IndexedDatasetWriter, token_dtype
    from .text_tokenizer import TextTokenizer

    tok = TextTokenizer(tokenizer, eod_token, download=True)
    if append_eod and tok.eod_id is None:
        raise ConfigError(f"tokenizer {tokenizer!r} has no end-of-document token that ds3d "
                          "recognises; name one with --eod-token, or pass --no-eod")
    for p in inputs:
        if not p.is_file():
            raise ConfigError(f"input {p} does not exist")
    docs = tokens = 0
    with IndexedDatasetWriter(prefix, token_dtype(tok.vocab_size)) as out:
        for p in inputs:
            for text in read_documents(p, json_key):
                ids = tok.encode(text) + ([tok.eod_id] if append_eod else [])
                out.add_document(ids)
                docs, tokens = docs + 1, tokens + len(ids)
    return {"documents": docs, "tokens": tokens, "vocab_size": tok.vocab_size}


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds3d.trainer.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    enc = sub.add_parser(
        "encode", help="text -> Megatron indexed dataset (with --tokenizer) or flat byte file",
        description="With --tokenizer: writes OUT.bin + OUT.idx (Megatron's indexed format, one "
        "document per input file or per JSON line). Without: one text file -> a byte-level "
        "uint16 token file OUT ending in .bin (vocab 256).")
    enc.add_argument("paths", nargs="+", metavar="INPUT... OUT",
                     help="input text or .jsonl files, then the output prefix (or .bin file)")
    enc.add_argument("--tokenizer", help="tokenizer.json, a tokenizer folder (tokenizer.json or "
                     "GPT-2's vocab.json + merges.txt), a Hugging Face name, or \"bytes\"")
    enc.add_argument("--json-key", default="text", help="text field of .jsonl inputs")
    enc.add_argument("--eod-token", help="end-of-document token (default: the tokenizer's, "
                     "e.g. <|endoftext|>)")
    enc.add_argument("--no-eod", action="store_true", help="do not append end-of-document tokens")
    args = ap.parse_args(argv)
    if len(args.paths) < 2:
        ap.error("encode needs at least one input and the output")
    *inputs, out = args.paths
    try:
        if args.tokenizer is None:
            if len(inputs) != 1 or not out.endswith(".bin"):
                raise ConfigError("without --tokenizer, encode writes one text file as a flat "
                                  "byte-level OUT.bin; give --tokenizer TOKENIZER to write an "
                                  "indexed dataset (OUT.bin + OUT.idx) from several inputs")
            n = encode_text(inputs[0], out)
            print(f"wrote {n} tokens to {out} (use data.source={out!r}, model.vocab_size=256)")
            return 0
        if out.endswith((".bin", ".idx")):
            raise ConfigError(f"{out}: give the output prefix without .bin/.idx (both are "
                              "written)")
        info = encode_indexed([Path(p) for p in inputs], out, args.tokenizer, args.json_key,
                              not args.no_eod, args.eod_token)
    except Ds3dError as e:
        print(f"encode: {e}", file=sys.stderr)
        return 2
    prefix = str(Path(out).resolve())
    print(f"wrote {info['documents']} documents, {info['tokens']} tokens to {out}.bin/.idx "
          f"(vocabulary {info['vocab_size']}). In the job:\n  [data]\n  source = \"indexed\"\n"
          f"  blend = [{{prefix = \"{prefix}\", weight = 1.0}}]"
          + (f"\n  tokenizer = \"{Path(args.tokenizer).resolve()}\""
             if Path(args.tokenizer).exists() else "")
          + f"\n  (model.vocab_size >= {info['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
