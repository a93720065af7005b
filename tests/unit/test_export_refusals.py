"""Export's refusals come before a checkpoint is downloaded and say what to give instead; an HF
export's tokenizer settings are the tokenizer's own, none invented. The stores here hold fake
checkpoints (random bytes, committed): every case is decided before their files are read."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.upload import commit_checkpoint, upload_rank_files
from ds3d.daemon import cli
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import CheckpointError
from ds3d.trainer.export import export
from ds3d.trainer.export import main as export_main
from ds3d.trainer.hf_export import write_hf
from ds3d.trainer.model import GPTSequential
from ds3d.trainer.tensor_parallel import TPGroup
from ds3d.trainer.text_tokenizer import TextTokenizer

from fixtures.ckpt import meta_for, write_fake_checkpoint
from support import byte_level_bpe

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(tmp_path) -> str:
    """A store root holding job "tiny" with committed steps 10 and 20; its job prefix's URL."""
    storage, local = FileStorage(tmp_path / "root" / "tiny"), tmp_path / "local"
    for step in (10, 20):
        files = write_fake_checkpoint(local, step)
        upload_rank_files(storage, step, 0, local, files[0])
        commit_checkpoint(storage, step, 1, meta_for(step), timeout=5, poll_interval=0.01)
    return f"file://{tmp_path}/root/tiny"


def test_a_missing_step_names_the_committed_ones(tmp_path, store):
    with pytest.raises(CheckpointError, match="step 7 .*its committed steps are 10, 20: give one "
                       "of them as --step"):
        export(store, tmp_path / "out", step=7)
    with pytest.raises(CheckpointError, match="a store's root holding the job folder.s. tiny; "
                       f"give the job's prefix, e.g. --store {store}$"):
        export(store.rsplit("/", 1)[0], tmp_path / "out")


def test_a_folder_holding_files_is_refused_before_the_download(tmp_path, store):
    """Was: an old export's tokenizer.json stayed beside the new model (generate() failed with
    an IndexError), and the printed list named only the files new to the folder."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"--out '.*old' is not empty \(it holds "
                       r"tokenizer.json\); give a new or empty folder"):
        export(store, old, step=20)
    assert sorted(p.name for p in old.iterdir()) == ["tokenizer.json"]


def test_out_that_is_no_local_folder_and_a_negative_step_are_refused(tmp_path, store, capsys):
    with pytest.raises(CheckpointError, match="is not a local folder"):
        export(store, "s3://bucket/exports", step=20)
    assert not Path("s3:").exists()
    with pytest.raises(SystemExit) as e:  # as ds3dctl refuses it
        export_main(["--store", store, "--step", "-1", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "'-1' is not a whole number from 0" in capsys.readouterr().err


def _cli_args(**kw):
    base = dict(job="tiny", step=None, store=None, format="hf", tokenizer=None, out="")
    return argparse.Namespace(**{**base, **kw})


class NoDaemon:
    def call(self, method, request):
        raise AssertionError(f"{method} asked of ds3dd")


def test_ds3dctl_export_with_store_does_not_ask_the_daemon(tmp_path, store):
    with pytest.raises(CheckpointError, match="its committed steps are 10, 20"):
        cli._export(NoDaemon(), _cli_args(store=store, step=7, out=str(tmp_path / "o")), None)


def test_ds3dctl_export_checks_an_out_url_before_the_download(tmp_path, store):
    dest = tmp_path / "dest"
    (dest / "old").mkdir(parents=True)
    (dest / "old" / "config.json").write_text("{}")
    for out, expected in ((f"file://{dest}", r"is not empty \(it holds old/config.json\)"),
                          ("gs://bucket/x", "--out gs://bucket/x: store 'gs://bucket/x'")):
        with pytest.raises(cli.UsageError, match=expected):
            cli._export(NoDaemon(), _cli_args(store=store, out=out, step=7), None)


def test_a_moved_data_tokenizer_is_named_as_the_jobs(tmp_path, store):
    """Was: '--tokenizer: tokenizer ... does not exist' when no --tokenizer had been given."""
    tok = byte_level_bpe(tmp_path / "tokenizer.json", vocab_size=300)
    cfg = build_job_config("tiny", ["model.vocab_size=512", f'data.tokenizer="{tok}"'])
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(cfg.dump_json())
    tok.unlink()
    daemon = SimpleNamespace(call=lambda m, r: SimpleNamespace(job=SimpleNamespace(
        run_dir=str(run))))
    with pytest.raises(CheckpointError) as e:
        cli._export(daemon, _cli_args(out=str(tmp_path / "o")), None)
    assert str(e.value).startswith(f"the job's data.tokenizer='{tok}': tokenizer")
    assert "give --tokenizer with the tokenizer the data was made with" in str(e.value)


def _bpe_with_unk(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    t = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<unk>", "</s>"])
    t.save(str(path))
    return path


def _tiny_weights():
    job = build_job_config("tiny", ["model.vocab_size=512"])
    return job.model, GPTSequential(job, TPGroup(None, 0, 1)).state_dict()


def test_hf_tokenizer_settings_keep_the_folders_and_invent_nothing(tmp_path):
    transformers = pytest.importorskip("transformers")
    m, weights = _tiny_weights()
    folder = tmp_path / "tok"
    folder.mkdir()
    byte_level_bpe(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>",
         "padding_side": "left", "eos_token": "<|endoftext|>"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    out = tmp_path / "hf"
    written = write_hf(out, weights, m, str(folder), {})
    assert written["files"] == sorted(p.name for p in out.iterdir())  # every file, listed
    settings = json.loads((out / "tokenizer_config.json").read_text())
    assert settings["padding_side"] == "left" and settings["pad_token"] == "<|endoftext|>"
    assert settings["model_max_length"] == m.seq_len and "unk_token" not in settings
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.padding_side == "left" and loaded.unk_token is None

    bare = byte_level_bpe(tmp_path / "bare.json")  # alone: GPT-2's byte-level BPE has no <unk>
    settings = _settings(TextTokenizer(str(bare)), tmp_path / "b", 64)
    assert settings["eos_token"] == "<|endoftext|>" and "unk_token" not in settings
    assert settings["model_max_length"] == 64
    unk = _bpe_with_unk(tmp_path / "unk.json")  # a real <unk> is the tokenizer's, not the EOD
    settings = _settings(TextTokenizer(str(unk)), tmp_path / "u", 64)
    assert settings["unk_token"] == "<unk>" and settings["eos_token"] == "</s>"


def _settings(tok, out, length):
    tok.save_for_transformers(out, model_max_length=length)
    return json.loads((out / "tokenizer_config.json").read_text())


def test_the_weights_are_as_readable_as_the_config_beside_them(tmp_path):
    """safetensors creates its file 0600: an export's config.json was 0644 and its weights
    unreadable to the group that serves the model."""
    m, weights = _tiny_weights()
    write_hf(tmp_path / "hf", weights, m, None, {})
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
