"""Training on Megatron indexed datasets made with a real tokenizer: a byte-level BPE (GPT-2's
algorithm) trained on the shipped public-domain text, `python -m ds3d.trainer.data encode` into
two .bin/.idx pairs, blended 3:1, trained by a TP1 x PP2 torchrun job; the loss falls from
about ln(vocabulary) and every step's batch is the one the pure data order says."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from ds3d.trainer.config import build_job_config
from ds3d.trainer.data import BatchPlan
from ds3d.trainer.indexed_dataset import IndexedDataset

from support import REPO, byte_level_bpe, losses, torchrun, worker_env

TEXT = REPO / "trainer" / "assets" / "public_domain.txt"


def encode(inputs, prefix, tokenizer):
    """The documented command line, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "ds3d.trainer.data", "encode", *map(str, inputs),
                           str(prefix), "--tokenizer", str(tokenizer)],
                          env=worker_env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert 'source = "indexed"' in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tiny_learns_an_indexed_blend_made_with_a_bpe_tokenizer(tmp_path):
    tokenizer = byte_level_bpe(tmp_path / "tokenizer.json")
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if p.strip()]
    half = len(paragraphs) // 2
    for name, part in (("first", paragraphs[:half]), ("second", paragraphs[half:])):
        lines = "".join(json.dumps({"text": p}) + "\n" for p in part)
        (tmp_path / f"{name}.jsonl").write_text(lines)
        encode([tmp_path / f"{name}.jsonl"], tmp_path / name, tokenizer)
    first = IndexedDataset(tmp_path / "first")
    assert first.num_documents == half and first.dtype == np.uint16
    assert first.num_tokens < sum(len(p.encode()) for p in paragraphs[:half]) / 2  # BPE merges

    blend = (f'data.blend=[{{prefix = "{tmp_path / "first"}", weight = 3.0}}, '
             f'{{prefix = "{tmp_path / "second"}", weight = 1.0}}]')
    sets = ['data.source="indexed"', blend, f'data.tokenizer="{tokenizer}"',
            "model.vocab_size=512", "train.steps=80", "train.lr=1e-3", "parallel.pp=2"]
    run = tmp_path / "run"
    torchrun(run, 2, sets=sets)
    got = losses(run)
    assert sorted(got) == list(range(1, 81))
    start, end = sum(got[s] for s in range(1, 4)) / 3, sum(got[s] for s in range(76, 81)) / 5
    assert abs(start - math.log(512)) < 0.5, start  # untrained: uniform over the vocabulary
    assert end < start - 1.5, (start, end)

    # the batches were drawn from both datasets by weight, and the job recorded its data
    job = build_job_config("tiny", sets)
    plan = BatchPlan(job, dp=1, dp_rank=0)
    chosen = [plan.source.source.dataset_of(i) for i in range(80 * plan.global_batch)]
    assert abs(chosen.count(0) / len(chosen) - 0.75) < 0.02
    recorded = json.loads((run / "job.json").read_text())["data"]
    assert recorded["source"] == "indexed" and len(recorded["blend"]) == 2
