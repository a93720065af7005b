"""`python -m ds3d.trainer.data encode` on the inputs users have: other encodings, gzip, other
JSON-lines names, byte-order marks, empty documents, outputs that cannot be written. Each is read
as the user means it or refused in one line naming the file (exit 2), never a traceback; and a
flat data.source that is really a Megatron `.bin` is refused before it trains on garbage."""

import gzip
import json

import numpy as np
import pytest

from ds3d.trainer.config import build_job_config
from ds3d.trainer.data import IndexedBlend, data_problems
from ds3d.trainer.data import _main as data_main
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.indexed_dataset import IndexedDataset, IndexedDatasetWriter

from support import byte_level_bpe

pytestmark = pytest.mark.timeout(120)

DOCS = [{"text": "The first document, about the sea."}, {"text": "A second one."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return str(byte_level_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", vocab_size=300))


def jsonl(path, docs=DOCS, prefix=b""):
    path.write_bytes(prefix + "".join(json.dumps(d) + "\n" for d in docs).encode())
    return path


def encode(capsys, *args):
    """(exit code, stdout, stderr) of the encode command."""
    code = data_main(["encode", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def documents(prefix):
    ds = IndexedDataset(prefix)
    return [ds.document(k).tolist() for k in range(len(ds.doc_starts))]


def test_text_that_is_not_utf8_is_refused_naming_file_and_line(tmp_path, tok, capsys):
    (tmp_path / "l.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    code, _, err = encode(capsys, tmp_path / "l.jsonl", tmp_path / "o", "--tokenizer", tok)
    assert code == 2 and err.count("\n") == 1
    assert f"{tmp_path / 'l.jsonl'}:2: not UTF-8 (byte 0xe9" in err and "re-encode" in err
    (tmp_path / "l.txt").write_bytes(b"line one\ncaf\xe9\n")
    for flat in ([], ["--tokenizer", tok]):  # the flat byte file too: its docstring says UTF-8
        out = tmp_path / ("f.bin" if not flat else "g")
        code, _, err = encode(capsys, tmp_path / "l.txt", out, *flat)
        assert code == 2 and f"{tmp_path / 'l.txt'}:2: not UTF-8" in err, err
    assert not list(tmp_path.glob("*.bin*")) and not list(tmp_path.glob("*.idx*"))


def test_gzip_input_is_read_as_the_plain_file(tmp_path, tok, capsys):
    plain = jsonl(tmp_path / "d.jsonl")
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert encode(capsys, plain, tmp_path / "p", "--tokenizer", tok)[0] == 0
    assert encode(capsys, tmp_path / "d.jsonl.gz", tmp_path / "z", "--tokenizer", tok)[0] == 0
    assert documents(tmp_path / "z") == documents(tmp_path / "p") and len(documents(
        tmp_path / "p")) == 2
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes())[:-12])
    code, _, err = encode(capsys, tmp_path / "cut.jsonl.gz", tmp_path / "c", "--tokenizer", tok)
    assert code == 2 and "cut.jsonl.gz cannot be read" in err
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 20)
    code, _, err = encode(capsys, tmp_path / "d.jsonl.zst", tmp_path / "s", "--tokenizer", tok)
    assert code == 2 and "zstd-compressed; decompress it first" in err


@pytest.mark.parametrize("name", ["d.ndjson", "d.JSONL", "d.Json", "d.NDJSON.gz"])
def test_every_json_lines_name_is_read_as_json_lines(tmp_path, tok, capsys, name):
    """Was: .ndjson and upper-case .JSONL were tokenized as raw text, JSON syntax and all."""
    assert encode(capsys, jsonl(tmp_path / "d.jsonl"), tmp_path / "ref", "--tokenizer", tok)[0] == 0
    data = (tmp_path / "d.jsonl").read_bytes()
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert encode(capsys, tmp_path / name, tmp_path / "x", "--tokenizer", tok)[0] == 0
    assert documents(tmp_path / "x") == documents(tmp_path / "ref")


def test_a_lone_surrogate_is_refused_naming_the_line(tmp_path, tok, capsys):
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n')
    for t in (tok, "bytes"):
        code, _, err = encode(capsys, tmp_path / "s.jsonl", tmp_path / "o", "--tokenizer", t,
                              "--no-eod")
        assert code == 2 and f"{tmp_path / 's.jsonl'}:2: field 'text' holds a lone surrogate " \
            "(\\ud800)" in err, err


def test_outputs_that_cannot_be_written_are_refused(tmp_path, tok, capsys):
    docs = jsonl(tmp_path / "d.jsonl")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "t.txt").write_text("some text")
    cases = [((docs, tmp_path / "nope" / "o", "--tokenizer", tok), "nope does not exist; create"),
             ((docs, tmp_path / "afile" / "o", "--tokenizer", tok), "afile is a file, not a "
              "folder"),
             ((docs, "/proc/ds3d-o", "--tokenizer", tok), "cannot write /proc/ds3d-o.bin"),
             ((docs, tmp_path, "--tokenizer", tok), "is a folder; give a file name in it"),
             ((tmp_path / "t.txt", tmp_path / "nope" / "f.bin"), "nope does not exist; create"),
             ((tmp_path / "missing.txt", tmp_path / "f.bin"), "missing.txt does not exist"),
             ((tmp_path / "missing.txt", tmp_path / "o", "--tokenizer", tok),
              "missing.txt does not exist"),
             ((tmp_path, tmp_path / "o", "--tokenizer", tok), f"input {tmp_path} is a folder; "
              "give the files in it")]
    for args, expected in cases:
        code, _, err = encode(capsys, *args)
        assert code == 2 and expected in err and err.startswith("encode: "), (args, err)


def test_empty_documents_are_left_out_and_empty_inputs_refused(tmp_path, tok, capsys):
    """Megatron's preprocess_data appends the end-of-document token to non-empty documents
    only; a lone EOD was written for "" before. No document at all exited 0 with a dataset that
    validation refuses."""
    docs = jsonl(tmp_path / "d.jsonl", [{"text": ""}, {"text": "x"}, {"text": ""}])
    code, out, _ = encode(capsys, docs, tmp_path / "o", "--tokenizer", tok)
    assert code == 0 and "wrote 1 documents (2 empty ones left out)" in out
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(tok)
    assert documents(tmp_path / "o") == [ref.encode("x").ids + [ref.token_to_id("<|endoftext|>")]]
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('\n{"text": ""}\n')
    for empty in ("e.jsonl", "blank.jsonl"):
        code, _, err = encode(capsys, tmp_path / empty, tmp_path / "none", "--tokenizer", tok)
        assert code == 2 and "no document with text" in err and "nothing was written" in err
    (tmp_path / "e.txt").write_text("")
    code, _, err = encode(capsys, tmp_path / "e.txt", tmp_path / "none.bin")
    assert code == 2 and "holds no text" in err
    assert not list(tmp_path.glob("none*"))


def test_a_byte_order_mark_is_dropped_in_text_and_json_lines(tmp_path, tok, capsys):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "b.txt").write_bytes(bom + b"plain text")
    (tmp_path / "p.txt").write_bytes(b"plain text")
    jsonl(tmp_path / "b.jsonl", prefix=bom)
    jsonl(tmp_path / "p.jsonl")
    for name in ("b.txt", "p.txt", "b.jsonl", "p.jsonl"):
        assert encode(capsys, tmp_path / name, tmp_path / name[0:3], "--tokenizer", tok)[0] == 0
    assert documents(tmp_path / "b.t") == documents(tmp_path / "p.t")
    assert documents(tmp_path / "b.j") == documents(tmp_path / "p.j")
    assert encode(capsys, tmp_path / "b.txt", tmp_path / "flat.bin")[0] == 0
    assert np.fromfile(tmp_path / "flat.bin", np.uint16).tobytes().decode("utf-16-le") \
        == "plain text"


def test_advice_that_the_user_can_follow(tmp_path, capsys, monkeypatch):
    (tmp_path / "t.txt").write_text("some text")
    monkeypatch.chdir(tmp_path)
    code, out, _ = encode(capsys, "t.txt", "flat.bin")
    assert code == 0 and f"data.source='{tmp_path / 'flat.bin'}'" in out  # absolute: validated
    code, _, err = encode(capsys, "t.txt", "o", "--tokenizer", "bytes")
    assert code == 2 and "pass --no-eod" in err and "--eod-token" not in err
    code, _, err = encode(capsys, jsonl(tmp_path / "d.jsonl"), "f.bin")
    assert code == 2 and "is JSON lines" in err and "--tokenizer bytes --no-eod" in err


def _megatron_pair(tmp_path, docs, dtype=np.uint16):
    with IndexedDatasetWriter(tmp_path / "corpus", np.dtype(dtype)) as w:
        for d in docs:
            w.add_document(d)
    return tmp_path / "corpus"


def test_a_megatron_bin_given_as_a_flat_file_is_refused(tmp_path):
    """Was: read with data.dtype rather than its index's dtype, an int32 dataset trained on
    garbage (each id split in two) without a word."""
    prefix = _megatron_pair(tmp_path, [list(range(100))] * 3, np.int32)
    with pytest.raises(ConfigError, match="is a Megatron indexed dataset") as e:
        build_job_config("tiny", [f'data.source="{prefix}.bin"'])
    assert 'data.source = "indexed"' in str(e.value) and f'prefix = "{prefix}"' in str(e.value)
    flat = tmp_path / "flat.bin"
    np.arange(200, dtype=np.uint16).tofile(flat)
    (tmp_path / "flat.idx").write_text("notes, not an index")
    assert data_problems(build_job_config("tiny", [f'data.source="{flat}"'])) == []


def test_an_out_of_vocabulary_id_of_an_indexed_dataset_names_fixes_that_fit_it(tmp_path):
    """The dtype of an indexed dataset is its index's: "or data.dtype" was no fix. (The dataset
    is changed after the job was built, whose validation scans the ids up front.)"""
    prefix = _megatron_pair(tmp_path, [[3] * 100])
    cfg = build_job_config("tiny", ['data.source="indexed"',
                                    f'data.blend=[{{prefix = "{prefix}"}}]'])
    _megatron_pair(tmp_path, [[300] * 100])
    with pytest.raises(ConfigError, match="token id 300 in .* outside model.vocab_size=256") as e:
        IndexedBlend(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, 0).sample(0)
    assert "data.dtype" not in str(e.value) and "encode the dataset again" in str(e.value)
