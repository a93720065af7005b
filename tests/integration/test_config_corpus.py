"""The config corpus: real DeepSpeed/NeoX configs of public GPT projects (tests/data/ds_configs,
sources in SOURCES). Each either trains 3 steps of the tiny model under torchrun on CPU, with
job.json showing what the config asked for, or is refused before launch naming the key; and
DeepSpeed's own parser gives the verdict recorded beside ds3d's.

The expected verdicts are read from the table in docs/deepspeed-configs.md (one place)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from support import REPO, records, torchrun

CORPUS = REPO / "tests" / "data" / "ds_configs"
TABLE = REPO / "docs" / "deepspeed-configs.md"
# A NeoX YAML describes its own (large) model: shrunk to the tiny preset's shape to run on CPU.
SHRINK = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64",
          "model.vocab_size=256", 'launch.device="cpu"']


def corpus_table() -> list[dict[str, str]]:
    text = TABLE.read_text()
    body = text.split("<!-- corpus-table-start -->")[1].split("<!-- corpus-table-end -->")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append({"file": cells[0].strip("`"), "deepspeed": cells[1], "ds3d": cells[2],
                     "key": cells[3].strip("`")})
    return rows


ROWS = corpus_table()


def job_source(name: str) -> tuple[str, list[str]]:
    """(source, overrides) as `ds3dctl start` would build them for this file."""
    from ds3d.daemon.check import source_with_files

    path = str(CORPUS / name)
    if name.endswith(".yml"):
        return source_with_files(None, None, path, SHRINK + ["train.steps=3"])
    return source_with_files("tiny", path, None, ["train.steps=3"])


def test_table_covers_the_corpus_and_its_sources():
    listed = {r["file"] for r in ROWS}
    stored = {p.name for p in CORPUS.iterdir() if p.name != "SOURCES"}
    assert listed == stored and len(listed) >= 8
    sources = [ln.split("\t") for ln in (CORPUS / "SOURCES").read_text().splitlines()
               if ln and not ln.startswith("#")]
    assert {s[0] for s in sources} == stored
    assert all(re.fullmatch(r"[0-9a-f]{40}", s[3]) for s in sources)


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_deepspeed_parser_verdict_on_the_raw_file(row):
    from ds3d.trainer.ds_config import deepspeed_file_verdict

    verdict = deepspeed_file_verdict(str(CORPUS / row["file"]), 1)
    if row["deepspeed"] == "accepts":
        assert verdict is None
    else:
        m = re.fullmatch(r"refuses: (\w+)(?: \((\w+)\))?", row["deepspeed"])
        assert m, row["deepspeed"]
        assert verdict is not None and verdict.startswith(m.group(1) + ":"), verdict
        assert m.group(2) is None or m.group(2) in verdict, verdict


REFUSED = [r for r in ROWS if r["ds3d"] == "refused"]
RUNS = [r for r in ROWS if r["ds3d"] == "runs"]


@pytest.mark.parametrize("row", REFUSED, ids=[r["file"] for r in REFUSED])
def test_refused_before_launch_naming_the_key(row):
    from ds3d.daemon.check import validated_job
    from ds3d.trainer.errors import ConfigError

    source, overrides = job_source(row["file"])
    with pytest.raises(ConfigError) as err:
        validated_job(source, overrides)
    assert row["key"] and row["key"] in str(err.value)
    assert "Traceback" not in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("row", RUNS, ids=[r["file"] for r in RUNS])
def test_runs_three_steps_as_the_config_says(row, tmp_path):
    from ds3d.daemon.check import validated_job

    source, overrides = job_source(row["file"])
    expected = validated_job(source, overrides)  # what ds3dctl check shows
    if expected.train.precision == "fp16" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        # a CPU without oneDNN fp16 kernels (AMD EPYC; Intel before Sapphire Rapids): DeepSpeed
        # cannot run fp16 here, and the workers refuse the job at once, saying what to do
        with pytest.raises(AssertionError, match="agent exited"):
            torchrun(tmp_path, 1, config=source, sets=overrides)
        said = (tmp_path / "torchrun.log").read_text()
        assert 'train.precision = "fp16" cannot run on this cpu device' in said, said[-3000:]
        assert 'Set train.precision = "bf16" or "fp32"' in said
        assert not records(tmp_path, 0, "step")
        return
    torchrun(tmp_path, 1, config=source, sets=overrides)
    steps = records(tmp_path, 0, "step")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in steps)
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["train"]["precision"] == expected.train.precision
    assert job["parallel"]["zero_stage"] == expected.parallel.zero_stage
    assert job["train"]["micro_batch_size"] == expected.train.micro_batch_size
    # each step trained the global batch the config names, in the precision it names
    tokens = expected.train.global_batch(1) * expected.model.seq_len
    assert steps[-1]["tokens_seen"] == 3 * tokens
    if expected.train.precision == "fp16":
        assert steps[0]["loss_scale"] == 2.0 ** expected.train.initial_scale_power
