"""Token ids checked against model.vocab_size before a job starts.

Why: a token id >= model.vocab_size (a corpus encoded with another tokenizer, a negative id in
a signed file) is found by the workers only when a sample holding it is drawn
(data._checked): a job accepted, trained and checkpointed, then FAILED minutes or days later.
Where the job is built and submitted (ds3dctl, ds3dd's StartJob, a plain torchrun worker), the
first SCAN_TOKENS tokens of every dataset are scanned (numpy min/max over the memory map,
~0.1 s per dataset from the page cache): a tokenizer/vocabulary mismatch shows in any prefix,
and a dataset of up to SCAN_TOKENS tokens is checked whole. Beyond that, the samples are still
checked as they are drawn. A dtype whose every value fits the vocabulary is not scanned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import JobConfig

SCAN_TOKENS = 64 << 20  # per dataset
_CHUNK = 8 << 20


def token_id_problems(cfg: JobConfig, scan_tokens: int = SCAN_TOKENS) -> list[str]:
    """One problem per dataset holding an id outside [0, model.vocab_size), naming the file,
    the id, where it is and what to change. Files that do not open are left to data_problems,
    which names what is wrong with them."""
    from .errors import ConfigError
    from .indexed_dataset import IndexedDataset

    d, vocab = cfg.data, cfg.model.vocab_size
    found: list[tuple[str, np.ndarray, str]] = []
    if d.source == "indexed":
        for k, entry in enumerate(d.blend):
            try:
                ds = IndexedDataset(entry.prefix)
            except (ConfigError, ValueError, OSError):
                continue
            found.append((f"data.blend[{k}].prefix={entry.prefix!r}", ds.tokens,
                          "the dataset was encoded with a tokenizer larger than the model's "
                          "vocabulary: raise model.vocab_size to cover it, or encode the corpus "
                          "again with the job's tokenizer"))
    elif d.source.endswith(".bin") and Path(d.source).is_file():
        try:
            tokens = np.memmap(d.source, dtype=np.dtype(d.dtype), mode="r")
        except (ValueError, OSError):
            return []
        found.append((f"data.source={d.source!r}", tokens,
                      f"check data.dtype (now {d.dtype}: the file's token type), or raise "
                      "model.vocab_size to cover the tokenizer the file was encoded with"))
    return [p for where, tokens, fix in found
            if (p := _out_of_range(where, tokens, vocab, scan_tokens, fix)) is not None]


def _out_of_range(where: str, tokens: np.ndarray, vocab: int, scan_tokens: int,
                  fix: str) -> str | None:
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab:
        return None  # every value of the type is a valid id
    n = min(len(tokens), scan_tokens)
    for start in range(0, n, _CHUNK):
        chunk = np.asarray(tokens[start:min(start + _CHUNK, n)])
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo >= 0 and hi < vocab:
            continue
        at = start + int(np.argmax((chunk < 0) | (chunk >= vocab)))
        bad = int(tokens[at])
        whole = "" if n == len(tokens) else f" (of the first {n:,} tokens scanned)"
        if bad < 0:
            fix = ("no tokenizer gives a negative id: the file is damaged or not a token "
                   "dataset; encode the corpus again")
        return (f"{where}: token id {bad} at token {at:,}{whole} is outside "
                f"model.vocab_size={vocab} (ids 0..{vocab - 1}); {fix}")
    return None
