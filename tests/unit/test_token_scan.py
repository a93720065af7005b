"""Token ids are checked against model.vocab_size where a job is built and submitted
(trainer/token_scan.py), so a corpus encoded with another tokenizer is refused before any
worker starts instead of failing the job when a sample holding the id is drawn (a probe's job
trained and checkpointed to step 5, then FAILED). And `ds3dctl check` prints a job with a
data.blend (a list of tables) instead of a TypeError traceback."""

import io
import tomllib

import numpy as np
import pytest

from ds3d.daemon import cli
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.indexed_dataset import IndexedDatasetWriter
from ds3d.trainer.token_scan import token_id_problems

pytestmark = pytest.mark.timeout(60)


def dataset(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def indexed_job(*prefixes, vocab=256):
    blend = ", ".join(f'{{prefix = "{p}", weight = 1.0}}' for p in prefixes)
    return ["data.source=\"indexed\"", f"data.blend=[{blend}]", f"model.vocab_size={vocab}"]


def test_one_rare_id_beyond_the_vocabulary_is_refused_naming_file_id_and_place(tmp_path):
    docs = [np.arange(100) % 256 for _ in range(80)]
    docs[40] = np.full(100, 7)
    docs[40][13] = 300
    good = dataset(tmp_path / "good", [np.arange(100) % 256] * 3)
    bad = dataset(tmp_path / "rare", docs)
    with pytest.raises(ConfigError) as e:
        build_job_config("tiny", indexed_job(good, bad))
    msg = str(e.value)
    assert f"data.blend[1].prefix='{bad}': token id 300 at token 4,013 is outside " \
           "model.vocab_size=256 (ids 0..255)" in msg
    assert "raise model.vocab_size" in msg and "blend[0]" not in msg
    assert build_job_config("tiny", indexed_job(good, bad, vocab=512)).model.vocab_size == 512


def test_a_negative_id_is_called_damage_not_a_larger_tokenizer(tmp_path):
    bad = dataset(tmp_path / "neg", [np.array([1, 2, -5] + [3] * 100)], dtype=np.int16)
    with pytest.raises(ConfigError, match=r"token id -5 at token 2 .* no tokenizer gives a "
                                          r"negative id"):
        build_job_config("tiny", indexed_job(bad))


def test_a_flat_file_names_its_dtype_setting(tmp_path):
    path = tmp_path / "flat.bin"
    (np.arange(1000) % 300).astype(np.uint16).tofile(path)
    with pytest.raises(ConfigError, match=r"data.source='.*flat.bin': token id 256 at token "
                                          r"256 .* check data.dtype \(now uint16"):
        build_job_config("tiny", [f'data.source="{path}"'])


def test_the_scan_covers_a_prefix_of_a_large_dataset_and_says_so(tmp_path):
    """Beyond the scanned prefix the samples are still checked as they are drawn; inside it
    the message says how much was scanned."""
    docs = [np.full(1000, 5) for _ in range(10)]
    docs[8][500] = 999  # token 8,500
    late = dataset(tmp_path / "late", docs)
    cfg = build_job_config("tiny", indexed_job(late, vocab=1024))
    cfg.model.vocab_size = 256
    assert token_id_problems(cfg, scan_tokens=8000) == []
    docs[2][0] = 999
    early = dataset(tmp_path / "early", docs)
    cfg.data.blend[0].prefix = early
    (problem,) = token_id_problems(cfg, scan_tokens=8000)
    assert "token id 999 at token 2,000 (of the first 8,000 tokens scanned)" in problem


def test_a_type_whose_every_value_is_an_id_needs_no_scan(tmp_path):
    ok = dataset(tmp_path / "u8", [np.arange(256)] * 2, dtype=np.uint8)
    assert build_job_config("tiny", indexed_job(ok)).data.blend[0].prefix == ok


def test_check_prints_a_blend_as_toml_that_reads_back(tmp_path):
    a = dataset(tmp_path / "a", [np.arange(100) % 256] * 3)
    b = dataset(tmp_path / "b d\u00e9j\u00e0", [np.arange(100) % 256] * 3)
    out = io.StringIO()
    args = cli.build_parser().parse_args(
        ["check", "tiny", *sum((["--set", s] for s in indexed_job(a, b)), [])])
    assert cli.run(args, out=out) == 0
    job = out.getvalue().split("# ---- ")[1].split("\n", 1)[1]
    assert tomllib.loads(job)["data"]["blend"] == [{"prefix": a, "weight": 1.0},
                                                   {"prefix": b, "weight": 1.0}]
