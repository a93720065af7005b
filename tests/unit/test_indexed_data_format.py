"""Megatron's indexed dataset (.bin/.idx), blends and `encode` with a real tokenizer.

The byte layout is written here by hand from the documented format (Megatron-LM
megatron/core/datasets/indexed_dataset.py, `_IndexWriter.write`), independently of ds3d's
writer, so reader and writer are each checked against the spec, not against each other."""

import json
import struct

import numpy as np
import pytest

from ds3d.trainer.config import build_job_config
from ds3d.trainer.data import BatchPlan, IndexedBlend, encode_indexed
from ds3d.trainer.data import _main as data_main
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.indexed_dataset import IndexedDataset, IndexedDatasetWriter

from support import REPO, byte_level_bpe

TEXT = REPO / "trainer" / "assets" / "public_domain.txt"


def spec_bytes(docs: list[list[int]], code: int = 8, np_dtype=np.uint16) -> tuple[bytes, bytes]:
    """(.idx, .bin) of `docs`, one sequence per document, following the format field by field."""
    lengths = [len(d) for d in docs]
    itemsize = np.dtype(np_dtype).itemsize
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1)
    idx += b"".join(struct.pack("<i", n) for n in lengths)
    idx += b"".join(struct.pack("<q", p) for p in pointers)
    idx += b"".join(struct.pack("<q", k) for k in range(len(docs) + 1))
    binary = b"".join(np.asarray(d, dtype=np_dtype).tobytes() for d in docs)
    return idx, binary


def write_spec(prefix, docs, **kw) -> str:
    idx, binary = spec_bytes(docs, **kw)
    (prefix.parent / (prefix.name + ".idx")).write_bytes(idx)
    (prefix.parent / (prefix.name + ".bin")).write_bytes(binary)
    return str(prefix)


DOCS = [[5, 6, 7, 1], [8, 9, 1], list(range(10, 40)) + [1], [41, 42, 1]]


def test_reader_follows_the_documented_layout(tmp_path):
    prefix = write_spec(tmp_path / "a", DOCS)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and ds.num_documents == 4 and ds.num_tokens == 41
    for k, doc in enumerate(DOCS):
        assert ds.document(k).tolist() == doc
    assert list(ds.doc_starts) == [0, 4, 7, 38]

    wide = write_spec(tmp_path / "w", [[70000, 1], [2]], code=4, np_dtype=np.int32)
    assert IndexedDataset(wide).document(0).tolist() == [70000, 1]


def test_document_with_several_sequences(tmp_path):
    """Megatron's index may split a document into sequences (sentences): the document index
    then counts sequences, not documents."""
    lengths, docs = [2, 3, 4], [0, 2, 3]
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 3, 3)
    idx += np.array(lengths, np.int32).tobytes() + np.array([0, 4, 10], np.int64).tobytes()
    idx += np.array(docs, np.int64).tobytes()
    (tmp_path / "s.idx").write_bytes(idx)
    (tmp_path / "s.bin").write_bytes(np.arange(9, dtype=np.uint16).tobytes())
    ds = IndexedDataset(tmp_path / "s")
    assert ds.document(0).tolist() == [0, 1, 2, 3, 4] and ds.document(1).tolist() == [5, 6, 7, 8]


def test_writer_writes_the_documented_bytes(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as w:
        for d in DOCS:
            w.add_document(d)
    idx, binary = spec_bytes(DOCS)
    assert (tmp_path / "ours.idx").read_bytes() == idx
    assert (tmp_path / "ours.bin").read_bytes() == binary


@pytest.mark.parametrize("damage, message", [
    (lambda idx, b: (b"NOTANIDX" + idx[8:], b), "does not start with MMIDIDX"),
    (lambda idx, b: (idx[:9] + struct.pack("<Q", 2) + idx[17:], b), "index version 2"),
    (lambda idx, b: (idx[:17] + struct.pack("<B", 7) + idx[18:], b), "not an integer token type"),
    (lambda idx, b: (idx[:-8], b), "truncated"),
    (lambda idx, b: (idx, b[:-2]), "does not belong together or one of them is truncated"),
])
def test_damaged_files_are_named_errors(tmp_path, damage, message):
    idx, binary = damage(*spec_bytes(DOCS))
    (tmp_path / "d.idx").write_bytes(idx)
    (tmp_path / "d.bin").write_bytes(binary)
    with pytest.raises(ConfigError, match=message):
        IndexedDataset(tmp_path / "d")


def _job(*sets):
    return build_job_config("tiny", ["model.seq_len=8", *sets])


def _blend(prefixes, weights=None, boundaries=None, vocab=None):
    weights = weights or [1.0] * len(prefixes)
    pairs = zip(prefixes, weights, strict=True)
    items = ", ".join(f'{{prefix = "{p}", weight = {w}}}' for p, w in pairs)
    sets = ['data.source="indexed"', f"data.blend=[{items}]"]
    if vocab:
        sets.append(f"model.vocab_size={vocab}")
    if boundaries:
        sets.append(f'data.document_boundaries="{boundaries}"')
    return _job(*sets)


def test_indexed_samples_are_a_pure_function_of_seed_and_index(tmp_path):
    prefix = write_spec(tmp_path / "a", [list(range(2, 200))])
    cfg = _blend([prefix])
    x1, y1 = BatchPlan(cfg, 1, 0).micro_batch(3, 0)
    x2, _ = BatchPlan(cfg, 1, 0).micro_batch(3, 0)
    assert np.array_equal(x1, x2) and np.array_equal(x1[:, 1:], y1[:, :-1])
    assert all(np.array_equal(np.diff(row), np.ones(7)) for row in x1)  # windows of the stream
    # the same global batch whatever the DP degree
    one = np.concatenate([x for x, _ in BatchPlan(cfg, 1, 0).step_iterator(2)])
    two = np.concatenate([x for r in range(2) for x, _ in BatchPlan(cfg, 2, r).step_iterator(2)])
    assert np.array_equal(np.sort(one, axis=0), np.sort(two, axis=0))
    skipped = _blend([prefix])
    skipped.data.skip_batches = [(2, 3)]
    assert np.array_equal(BatchPlan(skipped, 1, 0).micro_batch(2, 0)[0],
                          BatchPlan(cfg, 1, 0).micro_batch(3, 0)[0])


def test_blend_follows_the_weights_and_document_starts(tmp_path):
    a = write_spec(tmp_path / "a", [[2] * 20 + [1]] * 10)  # all twos
    b = write_spec(tmp_path / "b", [[3] * 12 + [1]] * 10)  # all threes
    blend = IndexedBlend(_blend([a, b], [3.0, 1.0]).data, 8, 256, 1234)
    chosen = [blend.dataset_of(i) for i in range(4000)]
    assert abs(chosen.count(0) / 4000 - 0.75) < 0.005
    assert abs(chosen[:40].count(0) - 30) <= 2  # even short prefixes follow the weights
    for i in range(50):
        assert set(blend.sample(i)) <= ({2, 1} if chosen[i] == 0 else {3, 1})

    starts = IndexedBlend(_blend([a], boundaries="start").data, 8, 256, 1234)
    doc_starts = set(IndexedDataset(a).doc_starts.tolist())
    for i in range(50):
        k = np.random.default_rng([1234, 0, i]).integers(0, starts.starts[0])
        assert int(starts.datasets[0].doc_starts[k]) in doc_starts
        assert starts.sample(i)[0] == 2  # a document's first token, never the EOD


def test_data_section_is_validated_before_launch(tmp_path):
    good = write_spec(tmp_path / "a", [list(range(2, 100))])
    with pytest.raises(ConfigError) as e:
        _job('data.source="indexed"')
    assert "needs data.blend" in str(e.value)
    with pytest.raises(ConfigError, match="without .bin/.idx"):
        _blend([good + ".bin"])
    with pytest.raises(ConfigError, match="absolute path"):
        _blend(["relative/prefix"])
    with pytest.raises(ConfigError, match="does not exist on this node"):
        _blend([str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="data.blend is read only with"):
        _job(f'data.blend=[{{prefix = "{good}"}}]')
    with pytest.raises(ConfigError, match="weight"):
        _blend([good], [0.0])
    with pytest.raises(ConfigError, match="document_boundaries applies to indexed"):
        _job('data.document_boundaries="start"')
    tiny = write_spec(tmp_path / "t", [[1, 2, 3]])
    with pytest.raises(ConfigError, match="fewer than one sample"):
        _blend([tiny])


def test_out_of_vocabulary_tokens_name_the_dataset(tmp_path):
    prefix = write_spec(tmp_path / "big", [[300] * 50])
    with pytest.raises(ConfigError, match="big': token id 300 at token 0 is outside model"):
        _blend([prefix])  # token_scan.py, where the job is built
    cfg = _blend([prefix], vocab=512)
    cfg.model.vocab_size = 256  # beyond the scanned prefix: checked as each sample is drawn
    with pytest.raises(ConfigError, match="token id 300 in .*big is outside model.vocab_size=256"):
        BatchPlan(cfg, 1, 0).micro_batch(0, 0)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A real byte-level BPE saved both as tokenizer.json and as GPT-2's vocab.json + merges.txt
    pair."""
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("bpe")
    byte_level_bpe(out / "tokenizer.json", vocab_size=500)
    (out / "gpt2").mkdir()
    Tokenizer.from_file(str(out / "tokenizer.json")).model.save(str(out / "gpt2"))
    return out


def test_encode_with_a_bpe_tokenizer_writes_megatron_format(tmp_path, bpe):
    from tokenizers import Tokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "The first document."}) + "\n\n"
                    + json.dumps({"text": "A second one, about the sea."}) + "\n")
    info = encode_indexed([docs, TEXT], str(tmp_path / "c"), str(bpe / "tokenizer.json"))
    assert info["documents"] == 3 and info["vocab_size"] == 500
    ds = IndexedDataset(tmp_path / "c")
    ref = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    eod = ref.token_to_id("<|endoftext|>")
    assert ds.document(0).tolist() == ref.encode("The first document.").ids + [eod]
    assert ds.document(2).tolist() == ref.encode(TEXT.read_text()).ids + [eod]
    assert ds.num_tokens < len(TEXT.read_bytes()) / 2  # real merges, not bytes
    # GPT-2's own file pair gives the same tokens
    encode_indexed([docs], str(tmp_path / "p"), str(bpe / "gpt2"))
    assert IndexedDataset(tmp_path / "p").document(1).tolist() == ds.document(1).tolist()


def test_encode_command_line(tmp_path, bpe, capsys):
    assert data_main(["encode", str(TEXT), str(tmp_path / "x"), "--tokenizer",
                      str(bpe / "tokenizer.json")]) == 0
    assert 'source = "indexed"' in capsys.readouterr().out
    assert data_main(["encode", str(TEXT), str(tmp_path / "y.bin"), "--tokenizer",
                      str(bpe / "tokenizer.json")]) == 2
    assert "without .bin/.idx" in capsys.readouterr().err
    assert data_main(["encode", str(TEXT), str(tmp_path / "z"), "--tokenizer",
                      str(bpe / "tokenizer.json"), "--eod-token", "<nope>"]) == 2
    assert "'<nope>' is not in the vocabulary" in capsys.readouterr().err
    assert data_main(["encode", str(TEXT), str(tmp_path / "old.bin")]) == 0  # byte-level, as before
    assert (tmp_path / "old.bin").stat().st_size == 2 * len(TEXT.read_bytes())


def test_tokenizer_setting_must_fit_the_model(tmp_path, bpe):
    prefix = write_spec(tmp_path / "a", [list(range(2, 100))])
    with pytest.raises(ConfigError, match="has 500 tokens, more than model.vocab_size=256"):
        build_job_config("tiny", ['data.source="indexed"', f'data.blend=[{{prefix = "{prefix}"}}]',
                                  f'data.tokenizer="{bpe / "tokenizer.json"}"'])
    with pytest.raises(ConfigError, match="could not be loaded by name from the local Hugging "
                       "Face cache"):  # never a download: the job uses what made its data
        build_job_config("tiny", ['data.tokenizer="ds3d-test/no-such-tokenizer"'])
    cfg = build_job_config("tiny", ["model.vocab_size=512", 'data.source="indexed"',
                                    f'data.blend=[{{prefix = "{prefix}"}}]',
                                    f'data.tokenizer="{bpe / "tokenizer.json"}"'])
    assert cfg.data.tokenizer.endswith("tokenizer.json")


def test_a_tokenizer_moved_after_submission_does_not_stop_the_job(tmp_path, bpe):
    """Was: every worker start under ds3dd loaded data.tokenizer (validate_job), though no
    worker reads it: a tokenizer moved after submission failed the job at its next restart,
    and a node without it refused its share. It is checked where the job is built and when
    ds3dd accepts it."""
    import shutil

    from ds3d.daemon.service import parse_config
    from ds3d.trainer.config import JobConfig, validate_job

    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    shutil.copy(bpe / "tokenizer.json", tok)
    submitted = build_job_config("tiny", ["model.vocab_size=512", f'data.tokenizer="{tok}"'])
    parse_config(submitted.dump_json())
    tok.unlink()
    validate_job(JobConfig.parse_json(submitted.dump_json(), "stored job"), world_size=1)
    parse_config(submitted.dump_json(), from_head=True)  # StartShare on another node
    with pytest.raises(ConfigError, match="data.tokenizer="):
        parse_config(submitted.dump_json())  # a new submission must load it
