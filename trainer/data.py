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
import gzip
import json
import math
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

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
        return _checked(self.tokens[start:start + n], self.vocab, "the data file",
                        "or data.dtype (the file's token type)")


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
        return _checked(ds.tokens[start:start + self.seq_len + 1], self.vocab, ds.prefix,
                        "or encode the dataset again with a tokenizer that fits it")


def _checked(window: np.ndarray, vocab: int, where: str, other_fix: str) -> np.ndarray:
    """The window as int64, refused when an id is outside the vocabulary; `other_fix` is the
    fix besides model.vocab_size that fits the source (an indexed dataset's dtype is its
    index's, not data.dtype)."""
    out = np.asarray(window, dtype=np.int64)
    if out.size and (out.max() >= vocab or out.min() < 0):
        bad = int(out.max()) if out.max() >= vocab else int(out.min())
        raise ConfigError(f"token id {bad} in {where} is outside model.vocab_size={vocab}; fix "
                          f"model.vocab_size (at least the tokenizer's vocabulary) {other_fix}")
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
    if d.source not in ("indexed", "synthetic") and (why := _indexed_as_flat(d.source)):
        problems.append(why)
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


def _indexed_as_flat(source: str) -> str | None:
    """A Megatron `.bin` (its `.idx` beside it) named as a flat token file: read with
    data.dtype instead of the dtype its index records, it trained on garbage without a word."""
    from .indexed_dataset import MAGIC

    path = Path(source)
    idx = path.with_suffix(".idx")
    try:
        with open(idx, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
    except OSError:
        return None
    prefix = str(path.with_suffix(""))
    return (f"data.source={source!r} is a Megatron indexed dataset ({idx} is its index), not a "
            f"flat token file: set data.source = \"indexed\" and [[data.blend]] prefix = "
            f"\"{prefix}\" (the token type is read from the index)")


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

# read as JSON lines whatever the case, also under .gz (Megatron reads .json; jq/pandas write
# .ndjson); any other file is one document
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")
# compressions that are refused with advice (gzip is read as is)
_COMPRESSED = ((b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"))
_ICONV = "e.g. iconv -f latin1 -t utf-8 IN > OUT"


def is_json_lines(path: Path) -> bool:
    name = path.name.lower().removesuffix(".gz")
    return name.endswith(JSON_LINES_SUFFIXES)


def _open_input(path: Path) -> BinaryIO:
    """The input's bytes, gunzipped when it is gzip (by its magic, whatever its name)."""
    if path.is_dir():
        raise ConfigError(f"input {path} is a folder; give the files in it (e.g. {path}/*.jsonl)")
    if not path.exists():
        raise ConfigError(f"input {path} does not exist")
    try:
        with open(path, "rb") as f:
            head = f.read(6)
        if head.startswith(b"\x1f\x8b"):
            return gzip.open(path, "rb")
        for magic, name in _COMPRESSED:
            if head.startswith(magic):
                raise ConfigError(f"input {path} is {name}-compressed; decompress it first "
                                  "(gzip is read as is)")
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as e:
        raise ConfigError(f"input {path} cannot be read ({e.strerror or e})") from None


def _reading(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of an input, read errors (a damaged gzip) as ConfigError."""
    f = _open_input(path)
    try:
        with f:
            yield from enumerate(f, 1)
    except (OSError, EOFError, zlib.error) as e:
        raise ConfigError(f"input {path} cannot be read ({e}); a .gz file must be complete "
                          "gzip data") from None


def _decoded(path: Path, line_no: int, raw: bytes) -> str:
    """One line as text; a UTF-8 byte-order mark at the start of the file is dropped (as
    Python's utf-8-sig), in JSON lines and text alike."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}:{line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                          f"{e.start + 1} of the line); re-encode the file as UTF-8 "
                          f"({_ICONV})") from None
    return text.removeprefix("\ufeff") if line_no == 1 else text


def read_text(path: Path, newlines: bool = True) -> str:
    """A whole input as one UTF-8 text (gzip read as is, a leading byte-order mark dropped);
    `newlines`: \r\n and \r read as \n, as Python's text files (and Megatron) read them."""
    text = "".join(_decoded(path, n, raw) for n, raw in _reading(path))
    return text.replace("\r\n", "\n").replace("\r", "\n") if newlines else text


def read_documents(path: Path, json_key: str) -> Iterator[str]:
    """The documents of one input: JSON lines (.jsonl/.ndjson/.json in any case, also .gz: one
    object per line, the text under `json_key`, as Megatron's preprocess_data.py reads), else
    the whole file."""
    if not is_json_lines(path):
        yield read_text(path)
        return
    for n, raw in _reading(path):
        line = _decoded(path, n, raw)
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
        text = obj[json_key]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to lone surrogates
            raise ConfigError(f"{path}:{n}: field {json_key!r} holds a lone surrogate "
                              f"(\\u{ord(text[e.start]):04x}), which is no character and no "
                              "tokenizer encodes; fix or remove that line") from None
        yield text


def encode_text(text_path: str | Path, out_path: str | Path) -> int:
    """Byte-level tokens (vocab 256) of a UTF-8 text, as a flat uint16 file."""
    text_path, out_path = Path(text_path), Path(out_path)
    if is_json_lines(text_path):
        raise ConfigError(f"input {text_path} is JSON lines; a flat byte-level file is made from "
                          "plain text: give --tokenizer (e.g. --tokenizer bytes --no-eod) to "
                          "encode its documents")
    raw = read_text(text_path, newlines=False).encode("utf-8")
    data = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
    if not data.size:
        raise ConfigError(f"input {text_path} holds no text; nothing was written")
    _check_output(out_path)
    try:
        data.tofile(out_path)
    except OSError as e:
        raise ConfigError(f"cannot write {out_path} ({e.strerror or e}); give an output in a "
                          "folder you can write") from None
    return len(data)


def _check_output(out: str | Path) -> None:
    """The output's folder exists and is a folder (else a traceback at the first write)."""
    path = Path(out)
    folder = path.parent
    if str(out).endswith("/") or path.is_dir():
        raise ConfigError(f"output {str(out)!r} is a folder; give a file name in it, e.g. "
                          f"{path / 'corpus_text_document'}")
    if not folder.exists():
        raise ConfigError(f"the output's folder {folder} does not exist; create it "
                          f"(mkdir -p {folder}) or give another output")
    if not folder.is_dir():
        raise ConfigError(f"output {path}: {folder} is a file, not a folder; give an output in "
                          "a folder")


def encode_indexed(inputs: list[Path], prefix: str, tokenizer: str, json_key: str = "text",
                   append_eod: bool = True, eod_token: str | None = None) -> dict[str, int]:
    """Tokenizes every document of `inputs` into PREFIX.bin/PREFIX.idx (one sequence per
    document, the end-of-document token appended, as Megatron's `--append-eod`). A document
    without tokens (an empty text) is left out, as Megatron appends no end-of-document token to
    it; inputs without any document are refused (nothing is written)."""
    from .indexed_dataset import IndexedDatasetWriter, token_dtype
    from .text_tokenizer import BYTES, TextTokenizer

    tok = TextTokenizer(tokenizer, eod_token, download=True)
    if append_eod and tok.eod_id is None:
        if tokenizer == BYTES:
            raise ConfigError("the byte-level tokenizer (bytes) has no end-of-document token "
                              "(its 256 ids are the bytes); pass --no-eod, or use a tokenizer "
                              "that has one")
        raise ConfigError(f"tokenizer {tokenizer!r} has no end-of-document token that ds3d "
                          "recognises; name one with --eod-token, or pass --no-eod")
    for p in inputs:
        _open_input(p).close()
    _check_output(prefix)
    docs = tokens = empty = 0
    try:
        with IndexedDatasetWriter(prefix, token_dtype(tok.vocab_size)) as out:
            for p in inputs:
                for text in read_documents(p, json_key):
                    ids = tok.encode(text)
                    if not ids:
                        empty += 1
                        continue
                    ids += [tok.eod_id] if append_eod and tok.eod_id is not None else []
                    out.add_document(ids)
                    docs, tokens = docs + 1, tokens + len(ids)
            if not docs:
                raise ConfigError(f"no document with text in {', '.join(map(str, inputs))} "
                                  f"({empty} empty ones); nothing was written")
    except OSError as e:
        raise ConfigError(f"cannot write {prefix}.bin and .idx ({e.strerror or e}); give an "
                          "output prefix in a folder you can write") from None
    return {"documents": docs, "tokens": tokens, "vocab_size": tok.vocab_size, "empty": empty}


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds3d.trainer.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    enc = sub.add_parser(
        "encode", help="text -> Megatron indexed dataset (with --tokenizer) or flat byte file",
        description="With --tokenizer: writes OUT.bin + OUT.idx (Megatron's indexed format, one "
        "document per JSON line of .jsonl/.ndjson/.json inputs, any case, .gz read as is; one "
        "per other input file). Without: one UTF-8 text file -> a byte-level uint16 token file "
        "OUT ending in .bin (vocab 256).")
    enc.add_argument("paths", nargs="+", metavar="INPUT... OUT",
                     help="input text or JSON-lines files, then the output prefix (or .bin file)")
    enc.add_argument("--tokenizer", help="tokenizer.json, a tokenizer folder (tokenizer.json or "
                     "GPT-2's vocab.json + merges.txt), a Hugging Face name, or \"bytes\"")
    enc.add_argument("--json-key", default="text", help="text field of JSON-lines inputs")
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
            print(f"wrote {n} tokens to {out} (use data.source={str(Path(out).resolve())!r}, "
                  "model.vocab_size=256)")
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
    skipped = f" ({info['empty']} empty ones left out)" if info["empty"] else ""
    print(f"wrote {info['documents']} documents{skipped}, {info['tokens']} tokens to "
          f"{out}.bin/.idx (vocabulary {info['vocab_size']}). In the job:\n  [data]\n"
          f"  source = \"indexed\"\n  blend = [{{prefix = \"{prefix}\", weight = 1.0}}]"
          + (f"\n  tokenizer = \"{Path(args.tokenizer).resolve()}\""
             if Path(args.tokenizer).exists() else "")
          + f"\n  (model.vocab_size >= {info['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
