"""Megatron's indexed dataset (the `.bin`/`.idx` pair written by Megatron-LM, Megatron-DeepSpeed
and GPT-NeoX preprocessing), read with a numpy memory map and written by `encode`.

Why our own reader: Megatron's class imports Megatron's package (and torch); the format is small
and fixed, so ds3d reads the bytes itself and checks every field it relies on, turning a
truncated or foreign file into an error that names the file and what is wrong.

The `.idx` file, all integers little-endian (megatron/core/datasets/indexed_dataset.py,
`_IndexWriter`):

    offset  size        field
    0       9           magic b"MMIDIDX\\x00\\x00"
    9       8   <Q      version, always 1
    17      1   <B      dtype code of the tokens in .bin: 1 uint8, 2 int8, 3 int16, 4 int32,
                        5 int64, 6 float64, 7 float32, 8 uint16
    18      8   <Q      S = sequence count
    26      8   <Q      D = document-index count (documents + 1)
    34      4*S int32   sequence lengths, in tokens
    ..      8*S int64   sequence pointers, byte offsets into .bin
    ..      8*D int64   document indices: document k is sequences [doc[k], doc[k+1]); doc[0]
                        is 0 and doc[-1] is S
   (..      1*S int8    sequence modes, multimodal datasets only: not supported here)

The `.bin` file is the tokens of every sequence, back to back, in the dtype above. GPT
preprocessing writes one sequence per document (with `--append-eod`, the document ends with the
tokenizer's end-of-document token).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Self

import numpy as np

from .errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16)}
CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}
TOKEN_CODES = (1, 3, 4, 5, 8)  # integer dtypes: token ids


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocessing picks: uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    sequence_count: int
    document_count: int  # entries of the document index (documents + 1)


def read_header(idx: Path) -> IndexHeader:
    """The fixed header of an `.idx` file; ConfigError naming the file when it is not one."""
    try:
        with open(idx, "rb") as f:
            head = f.read(HEADER_SIZE)
    except OSError as e:
        raise ConfigError(f"cannot read {idx}: {e.strerror}") from None
    if len(head) < HEADER_SIZE or head[:9] != MAGIC:
        raise ConfigError(f"{idx} is not a Megatron indexed-dataset index (it does not start "
                          "with MMIDIDX); give the prefix of a .bin/.idx pair written by "
                          "Megatron/GPT-NeoX preprocessing or `python -m ds3d.trainer.data encode`")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:HEADER_SIZE])
    if version != VERSION:
        raise ConfigError(f"{idx}: index version {version}; only version {VERSION} is known")
    if code not in TOKEN_CODES:
        what = DTYPE_CODES[code].name if code in DTYPE_CODES else "unknown"
        raise ConfigError(f"{idx}: dtype code {code} ({what}) is not an integer token type; "
                          "token datasets use uint16 (8) or int32 (4)")
    return IndexHeader(DTYPE_CODES[code], seqs, docs)


class IndexedDataset:
    """One `.bin`/`.idx` pair, memory-mapped, checked on open.

    `tokens` is the whole `.bin` as one flat array; `doc_starts[k]` and `doc_ends[k]` are the
    token offsets of document k in it (sequences of one document are contiguous)."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        idx, bin_ = index_path(prefix), data_path(prefix)
        for p in (idx, bin_):
            if not p.is_file():
                raise ConfigError(f"{p} does not exist on this node; an indexed dataset is a "
                                  "prefix P with P.bin and P.idx next to each other")
        h = read_header(idx)
        self.dtype = h.dtype
        S, D = h.sequence_count, h.document_count
        want = HEADER_SIZE + 4 * S + 8 * S + 8 * D
        size = idx.stat().st_size
        if size < want:
            raise ConfigError(f"{idx} is truncated: {size} bytes, its header promises {want} "
                              f"({S} sequences, {D} document indices)")
        if size != want and size != want + S:  # + S: the multimodal modes array
            raise ConfigError(f"{idx}: {size} bytes where {want} were expected; not a file of "
                              "this format")
        if size == want + S and S:
            raise ConfigError(f"{idx} holds per-sequence modes (a multimodal dataset); ds3d "
                              "trains text models only")
        raw = np.memmap(idx, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(raw, np.int32, S, off)
        self.sequence_pointers = np.frombuffer(raw, np.int64, S, off + 4 * S)
        self.document_indices = np.frombuffer(raw, np.int64, D, off + 12 * S)
        self._check(idx, bin_)
        itemsize = self.dtype.itemsize
        self.tokens = (np.memmap(bin_, mode="r", dtype=self.dtype) if bin_.stat().st_size
                       else np.zeros(0, self.dtype))
        # token offset where each sequence starts, plus the end: documents index into it
        bounds = np.append(self.sequence_pointers // itemsize, len(self.tokens))
        docs = self.document_indices
        self.doc_starts, self.doc_ends = bounds[docs[:-1]], bounds[docs[1:]]

    def _check(self, idx: Path, bin_: Path) -> None:
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        docs = self.document_indices
        S, itemsize = len(lengths), self.dtype.itemsize
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != S or np.any(np.diff(docs) < 0):
            raise ConfigError(f"{idx}: document indices must rise from 0 to the sequence count "
                              f"({S}); the index is damaged")
        if S and np.any(lengths < 0):
            raise ConfigError(f"{idx}: negative sequence lengths; the index is damaged")
        expected = np.concatenate(([0], np.cumsum(lengths.astype(np.int64))[:-1])) * itemsize
        if S and not np.array_equal(pointers, expected):
            k = int(np.nonzero(pointers != expected)[0][0])
            raise ConfigError(f"{idx}: sequence {k} starts at byte {int(pointers[k])}, not right "
                              f"after the previous one ({int(expected[k])}); only back-to-back "
                              ".bin files (as Megatron's preprocessing writes them) are supported")
        total = int(lengths.astype(np.int64).sum()) * itemsize
        size = bin_.stat().st_size
        if size != total:
            raise ConfigError(f"{bin_} is {size} bytes, its index {idx.name} describes {total} "
                              f"({total // itemsize} {self.dtype.name} tokens); the pair does not "
                              "belong together or one of them is truncated")

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def document(self, k: int) -> np.ndarray:
        return np.asarray(self.tokens[self.doc_starts[k]:self.doc_ends[k]])


class IndexedDatasetWriter:
    """Writes a `.bin`/`.idx` pair, one sequence per document (what GPT preprocessing does).
    The `.idx` is written on `close`, both files through a temporary name, so a crash never
    leaves a pair that looks complete."""

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        if CODE_OF_DTYPE.get(np.dtype(dtype)) not in TOKEN_CODES:
            raise ValueError(f"token dtype {dtype} is not one of Megatron's integer codes")
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._bin: BinaryIO = open(self._bin_tmp, "wb")  # noqa: SIM115 - open until close()
        self._lengths: list[int] = []

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        arr = np.asarray(tokens)
        info = np.iinfo(self.dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"token ids out of range for {self.dtype.name}")
        self._bin.write(arr.astype(self.dtype).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def close(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.concatenate(([0], np.cumsum(lengths.astype(np.int64))[:-1])) \
            * self.dtype.itemsize if len(lengths) else np.zeros(0, np.int64)
        docs = np.arange(len(lengths) + 1, dtype=np.int64)
        idx_tmp = Path(f"{self.prefix}.idx.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype], len(lengths),
                                len(docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(np.asarray(pointers, dtype=np.int64).tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
        self._bin_tmp.replace(data_path(self.prefix))
        idx_tmp.replace(index_path(self.prefix))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._bin.close()
            self._bin_tmp.unlink(missing_ok=True)
