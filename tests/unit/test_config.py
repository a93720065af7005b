"""Every invalid job is refused before any process starts, with a message naming the field, the
value and what to do instead."""

import json

import pytest

from ds3d.trainer.config import JobConfig, build_job_config, parse_override, validate_job
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.presets import PRESETS


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid(name):
    cfg = build_job_config(name)
    assert cfg.preset == name and cfg.name == name


def test_gpt10b_is_about_ten_billion_parameters_on_the_seed_cluster():
    cfg = build_job_config("gpt10b")
    assert 9.5e9 < cfg.model.n_params() < 10.5e9
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.zero_stage) == (4, 2, 2, 1)
    assert cfg.launch.nnodes * cfg.launch.nproc_per_node == p.world_size == 16
    assert cfg.train.precision == "bf16"


BAD = {
    "zero3 with pipeline": (["parallel.zero_stage=3", "parallel.pp=2"],
                            ["zero_stage=3", "pp=2", "ZeRO-0/1", "zero_stage=1 with pp>1"]),
    "zero2 with pipeline": (["parallel.zero_stage=2", "parallel.pp=4"], ["pipeline engine"]),
    "layers not divisible": (["parallel.pp=3"], ["n_layers=4", "pp=3", "partition_method=[2, 1, 1]"]),
    "explicit partition wrong sum": (["parallel.pp=2", "parallel.partition_method=[1, 2]"],
                                     ["summing to model.n_layers=4"]),
    "heads not divisible by tp": (["parallel.tp=8"], ["n_heads=4", "tp=8", "(1, 2, 4)"]),
    "vocab not divisible by tp": (["model.vocab_size=257", "parallel.tp=2"],
                                  ["vocab_size=257", "e.g. 258"]),
    "batch mismatch": (["train.global_batch_size=10", "train.grad_accum_steps=2"],
                       ["global_batch_size=10", "= 4", "set global_batch_size=4"]),
    "batch not divisible": (["train.global_batch_size=9"], ["not divisible", "multiple of 2"]),
    "world size": (["launch.nproc_per_node=3"], ["= 3 processes", "tp x pp x dp"]),
    "bad store url": (["checkpoint.store=\"http://x\""], ["file:///", "s3://"]),
    "negative steps": (["train.steps=-5"], ["train.steps=-5", "greater than 0"]),
    "unknown key": (["train.learning_rate=1"], ["train.learning_rate", "unknown setting"]),
    "bad precision": (["train.precision=\"fp8\""], ["train.precision", "fp32"]),
    "path traversal name": (["name=\"../etc\""], ["name=", "no '/', '..'"]),
    "odd head size": (["model.d_model=68", "model.n_heads=4"], ["rotary"]),
    "data not a .bin": (["data.source=\"corpus.txt\""], [".bin", "ds3d.trainer.data"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_configuration_is_refused_with_an_actionable_message(case):
    sets, phrases = BAD[case]
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", sets)
    for phrase in phrases:
        assert phrase in str(err.value), (phrase, str(err.value))


def test_world_size_must_be_product_of_degrees():
    cfg = build_job_config("tiny", ["parallel.tp=2", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="6 processes but tp x pp x dp = 2 x 2 x 1 = 4"):
        validate_job(cfg, world_size=6)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'gpt3'.*tiny, gpt125m, gpt1b, gpt10b"):
        build_job_config("gpt3")


def test_missing_toml_file():
    with pytest.raises(ConfigError, match="does not exist"):
        build_job_config("/nope/job.toml")


def test_toml_file_with_preset_base_and_overrides(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('preset = "tiny"\nname = "exp-1"\n[parallel]\npp = 2\n[train]\nsteps = 7\n')
    cfg = build_job_config(str(f), ["train.lr=1e-4"])
    assert (cfg.name, cfg.preset, cfg.parallel.pp, cfg.train.steps, cfg.train.lr) == (
        "exp-1", "tiny", 2, 7, 1e-4)
    assert cfg.model.d_model == 64  # from the preset


def test_broken_toml_is_reported(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_job_config(str(f))


def test_override_syntax():
    assert parse_override("train.lr=1e-4") == (["train", "lr"], 1e-4)
    assert parse_override("parallel.partition_method=[3,4,5]")[1] == [3, 4, 5]
    assert parse_override("data.source=synthetic")[1] == "synthetic"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("train.lr")
    with pytest.raises(ConfigError, match="not a dotted setting name"):
        parse_override("Train-LR=1")


def test_grad_accumulation_is_derived_and_follows_dp():
    cfg = build_job_config("tiny", ["parallel.dp=2"])
    assert cfg.train.grad_accum(2) == 2 and cfg.train.global_batch(2) == 8
    assert cfg.train.grad_accum(1) == 4  # an elastic shrink keeps the global batch


def test_job_json_round_trip(tmp_path):
    cfg = build_job_config("tiny", ["parallel.partition_method=[2, 2]", "parallel.pp=2"])
    path = tmp_path / "job.json"
    path.write_text(cfg.dump_json())
    assert JobConfig.load_json(path) == cfg
    assert json.loads(cfg.dump_json())["parallel"]["partition_method"] == [2, 2]


def test_model_hash_tracks_architecture_only():
    a = build_job_config("tiny")
    assert a.model_hash() == build_job_config("tiny", ["train.lr=1", "parallel.pp=2"]).model_hash()
    assert a.model_hash() != build_job_config("tiny", ["model.n_layers=8"]).model_hash()


def test_user_deepspeed_json_is_merged(tmp_path):
    from ds3d.trainer.engine import deepspeed_config

    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 0.5}))
    cfg = build_job_config("tiny", [f"train.deepspeed_config=\"{f}\""])
    ds = deepspeed_config(cfg, 1)
    assert ds["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert ds["gradient_clipping"] == 0.5
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 4


def test_checkpoint_s3_fields_are_the_daemon_environment_settings():
    """Every `[checkpoint.s3]` field reaches S3Storage (a field missing from the table would be
    silently ignored), under the name of its DS3D_S3_* variable."""
    from ds3d.checkpoints.s3_storage import ENV_OPTIONS, options_from_settings
    from ds3d.trainer.config import S3TransferConfig

    names = {var.removeprefix("DS3D_S3_").lower() for var in ENV_OPTIONS}
    assert names == set(S3TransferConfig.model_fields)
    cfg = S3TransferConfig(multipart_chunksize_mib=8, max_bandwidth_mib=0, outage_retries=2)
    assert options_from_settings(cfg.model_dump()) == {
        "multipart_chunksize": 8 << 20, "max_bandwidth": None, "outage_retries": 2}
