"""Every invalid job is refused before any process starts, with a message naming the field, the
value and what to do instead."""

import json
import re
from pathlib import Path

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
    "layers not divisible": (["parallel.pp=3"],
                             ["n_layers=4", "pp=3", "partition_method=[2, 1, 1]"]),
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
    "data not a .bin": (["data.source=\"corpus.txt\""], [".bin", "docs/data.md"]),
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


def test_a_folder_given_as_the_job_file_is_named_a_folder(tmp_path):
    """Was: `ds3dctl check ops/` said the folder "does not exist"."""
    with pytest.raises(ConfigError) as err:
        build_job_config(str(tmp_path))
    assert "is a folder, not a file" in str(err.value) and "exist" not in str(err.value)


def test_toml_file_with_preset_base_and_overrides(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('preset = "tiny"\nname = "exp-1"\n[parallel]\npp = 2\n[train]\nsteps = 7\n')
    cfg = build_job_config(str(f), ["train.lr=1e-4"])
    assert (cfg.name, cfg.preset, cfg.parallel.pp, cfg.train.steps, cfg.train.lr) == (
        "exp-1", "tiny", 2, 7, 1e-4)
    assert cfg.model.d_model == 64  # from the preset


def test_a_table_override_merges_into_the_section_like_a_toml_file(tmp_path):
    """Was: `--set 'train={steps=3}'` replaced the whole [train] table, so the job file's
    micro and global batch (and every other train.* it set) were silently dropped."""
    f = tmp_path / "job.toml"
    f.write_text('preset = "tiny"\n[train]\nmicro_batch_size = 2\nglobal_batch_size = 8\n')
    cfg = build_job_config(str(f), ["train={steps=3}"])
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.global_batch_size) == (3, 2, 8)
    assert build_job_config(str(f), ["train={}"]) == build_job_config(str(f))


def test_a_table_override_is_explicit_against_a_deepspeed_json(tmp_path):
    """Was: a value set inside a table override (`--set 'train={micro_batch_size=2}'`) was not
    counted as written by the user, and the DeepSpeed JSON's different batch size won quietly."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", [f"train.deepspeed_config={json.dumps(str(ds))}",
                                  "train={micro_batch_size=2}"])
    assert "train.micro_batch_size=4, but --set train={micro_batch_size=2}" in str(err.value)


def test_broken_toml_is_reported(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_job_config(str(f))


@pytest.mark.parametrize("content, phrase", [
    (b'preset = ["tiny"]\n', "unknown preset ['tiny']; choose one of tiny"),
    (b"preset = 5\n", "unknown preset 5; choose one of tiny"),
    (b'preset = "tiny"\nname = "caf\xe9"\n', "cannot be read as a UTF-8 TOML file"),
])
def test_a_toml_file_of_odd_values_is_refused_not_a_traceback(tmp_path, content, phrase):
    """Was: TypeError (unhashable list) and UnicodeDecodeError tracebacks in ds3dctl."""
    f = tmp_path / "job.toml"
    f.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        build_job_config(str(f))
    assert phrase in str(err.value), str(err.value)


def test_a_name_taken_from_the_file_name_says_where_it_came_from_and_what_to_write(tmp_path):
    """Was: a job file without `name` (and without a preset) named "My Job.toml" was refused as
    `name='My Job': must be ...`, a name the user never wrote, with no word of how to give one."""
    f = tmp_path / "My Job.toml"
    f.write_text("[model]\nvocab_size = 256\nd_model = 64\nn_layers = 4\nn_heads = 4\n"
                 "seq_len = 64\n")
    with pytest.raises(ConfigError) as err:
        build_job_config(str(f))
    message = str(err.value)
    assert "from the file name" in message and "--name" in message, message
    assert '"my-job"' in message, message
    assert build_job_config(str(f), name="my-job").name == "my-job"


def test_a_preset_override_that_is_no_name_is_refused_as_a_preset():
    """Was: `--set preset=[1]` was reported as `name=[1]` (the name is taken from the preset)."""
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", ["preset=[1]"])
    assert "preset=[1]" in str(err.value) and "name=" not in str(err.value)


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
    f.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000},
                             "gradient_clipping": 0.5}))
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


# ---- issue 17: one strict validation at the boundary ---------------------------------------

NON_FINITE = ["inf", "-inf", "nan"]
FLOAT_FIELDS = ["train.lr", "train.weight_decay", "model.rope_theta", "train.grad_clip",
                "train.eps", "model.norm_eps", "model.init_std", "train.min_lr_ratio",
                "faults.spike_mads", "faults.spike_min_rise", "faults.lr_factor",
                "parallel.partition_threshold"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", NON_FINITE)
def test_issue17_1_non_finite_numbers_are_refused(field, value):
    """Issue 17 item 1: `--set train.lr=inf` (or NaN anywhere) was stored and bricked ds3dd."""
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", [f"{field}={value}"])
    assert f"{field}=" in str(err.value) and "must be a finite number" in str(err.value)
    assert "allowed:" in str(err.value) or field == "parallel.partition_threshold"


@pytest.mark.parametrize("betas", ["[0.9, nan]", "[inf, 0.95]", "[0.9, 1.0]", "[-0.1, 0.9]"])
def test_issue17_1_betas_are_finite_and_below_one(betas):
    with pytest.raises(ConfigError, match=r"train\.betas\.[01]="):
        build_job_config("tiny", [f"train.betas={betas}"])


@pytest.mark.parametrize("text", ['"lr": Infinity', '"lr": NaN', '"lr": -Infinity', '"lr": 1e999'])
def test_issue17_1_non_finite_json_is_refused(text):
    """A raw StartJob request: JSON's Infinity/NaN extensions and an overflowing literal."""
    data = build_job_config("tiny").dump_json().replace('"lr": 0.003', text)
    assert text in data
    with pytest.raises(ConfigError, match="train.lr=.*must be a finite number"):
        JobConfig.parse_json(data, "request")


@pytest.mark.parametrize("value", [2**63, 10**30, 10**12, 10**9 + 1])
def test_issue17_2_huge_step_counts_are_refused(value):
    """Issue 17 item 2: steps = 2**63 or 10**30 was accepted and broke ListJobs for everyone."""
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", [f"train.steps={value}"])
    assert f"train.steps={value}" in str(err.value)
    assert "allowed: 0 < train.steps <= 1000000000" in str(err.value)
    data = json.loads(build_job_config("tiny").dump_json())
    data["train"]["steps"] = value
    with pytest.raises(ConfigError, match="less than or equal to 1000000000"):
        JobConfig.parse_json(json.dumps(data), "request")


@pytest.mark.parametrize("name", ["nl\n", "nl\r\n", "a\x00b", "a/b", "..", ".hidden", "-x", "A",
                                  "a b", " a", "a" * 64, "", "é", "nl\u2028"])
def test_issue17_3_job_names_must_match_the_whole_pattern(name):
    """Issue 17 item 3: "nl\\n" passed `re.match(...$)` and shared the store prefix of "nl"."""
    from ds3d.trainer.config import valid_job_name

    assert not valid_job_name(name)
    with pytest.raises(ConfigError, match="name="):
        build_job_config("tiny", name=name)
    data = json.loads(build_job_config("tiny").dump_json())
    data["name"] = name
    with pytest.raises(ConfigError, match="name="):
        JobConfig.parse_json(json.dumps(data), "request")


def test_issue17_3_valid_names_and_the_documented_pattern():
    from ds3d.trainer.config import JOB_NAME_PATTERN, JOB_NAME_RE, valid_job_name

    for name in ("nl", "a", "0", "exp-1.run_2", "a" * 63):
        assert valid_job_name(name) and build_job_config("tiny", name=name).name == name
    assert JOB_NAME_RE.match("nl\n") is None  # even callers that use .match are safe
    assert JOB_NAME_PATTERN in (Path(__file__).parents[2] / "docs/configuration.md").read_text()


LOOSE = {
    "bool into an int": ("parallel.tp=true", "true/false is not converted"),
    "string into an int": ('train.steps="10"', "a string is not converted"),
    "string into a float": ('train.lr="1e-3"', "a string is not converted"),
    "float into an int": ("train.micro_batch_size=2.0", "expected a whole number"),
    "string into a bool": ('train.compile="true"', "a string is not converted"),
    "int into a bool": ("checkpoint.load=1", "expected true or false"),
}


@pytest.mark.parametrize("case", list(LOOSE))
def test_issue17_4_no_type_is_coerced(case):
    """Issue 17 item 4: `parallel.tp=true` and `train.steps="10"` were silently coerced."""
    override, phrase = LOOSE[case]
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", [override])
    assert phrase in str(err.value), str(err.value)


BOUNDS = {
    "steps 10**12": ("train.steps=1000000000000", "train.steps <= 1000000000"),
    "micro-batch 10**9": ("train.micro_batch_size=1000000000", "train.micro_batch_size <= 65536"),
    "seq_len 10**9": ("model.seq_len=1000000000", "model.seq_len <= 1048576"),
    "tp 1000": ("parallel.tp=1000", "parallel.tp <= 64"),
    "dp 10**6": ("parallel.dp=1000000", "parallel.dp <= 65536"),
    "pp 0": ("parallel.pp=0", "1 <= parallel.pp <= 1024"),
    "layers 10**4": ("model.n_layers=10000", "model.n_layers <= 1024"),
    "d_model 10**6": ("model.d_model=1000000", "model.d_model <= 65536"),
    "vocab 2**31": ("model.vocab_size=2147483648", "model.vocab_size <= 4194304"),
    "seed 2**40": ("train.seed=1099511627776", "train.seed <= 4294967295"),
    "nnodes 10**5": ("launch.nnodes=100000", "launch.nnodes <= 4096"),
    "lr 100": ("train.lr=100.0", "0 < train.lr <= 10"),
    "keep_last 0": ("checkpoint.keep_last=0", "1 <= checkpoint.keep_last <= 10000"),
}


@pytest.mark.parametrize("case", list(BOUNDS))
def test_issue17_4_integers_have_documented_bounds(case):
    override, phrase = BOUNDS[case]
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", [override])
    assert phrase in str(err.value), str(err.value)


def test_issue17_4_every_bound_is_documented():
    """docs/configuration.md states the upper bound of every bounded number in its field's row
    (the same number as the schema)."""
    from ds3d.trainer import config as c

    rows = (Path(__file__).parents[2] / "docs/configuration.md").read_text().splitlines()
    missing = []
    for section in (c.ModelConfig, c.ParallelConfig, c.TrainConfig, c.CheckpointConfig,
                    c.S3TransferConfig, c.FaultsConfig, c.LaunchConfig):
        for name, info in section.model_fields.items():
            for m in info.metadata:
                high = getattr(m, "le", None) if getattr(m, "le", None) is not None else \
                    getattr(m, "lt", None)
                if high is None:
                    continue
                spelled = {str(int(high)), f"{high:g}".replace("e+", "e")}
                if not any(r.startswith(f"| `{name}` |") and any(x in r for x in spelled)
                           for r in rows):
                    missing.append(f"{section.__name__}.{name} <= {high}")
    assert not missing, missing


def test_issue17_4_duplicate_hosts_are_refused():
    sets = ["launch.nnodes=2", "parallel.dp=2", "launch.hosts=['10.0.0.1:7531', '10.0.0.1:7531']"]
    with pytest.raises(ConfigError, match="10.0.0.1:7531 listed more than once"):
        build_job_config("tiny", sets)


@pytest.mark.parametrize("field", ["data.source", "checkpoint.store", "checkpoint.local_dir",
                                   "data.tokenizer", "launch.hosts"])
def test_issue17_4_control_characters_in_paths_are_refused(field):
    value = '["/tmp/x\\n.bin"]' if field == "launch.hosts" else '"/tmp/x\\n.bin"'
    with pytest.raises(ConfigError, match="control character U\\+000A"):
        build_job_config("tiny", [f"{field}={value}"])


@pytest.mark.parametrize("field, value", [
    ("data.source", "tokens.bin"), ("data.source", "./data/tokens.bin"),
    ("checkpoint.local_dir", "ckpt"), ("train.deepspeed_config", "ds.json")])
def test_a_relative_path_in_a_ds3dd_job_is_refused(tmp_path, monkeypatch, field, value):
    """Was: accepted, and read from three places: ds3dctl's folder (validation, the DeepSpeed
    JSON's translation), ds3dd's (its store and data checks, the local tier it watches and
    uploads from) and the run directory (the workers' cwd). Under plain torchrun (one folder
    for all) it stays allowed, and a worker does not check it again."""
    from ds3d.daemon.check import validated_job
    from ds3d.daemon.service import parse_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("tokens.bin", "data/tokens.bin"):
        (tmp_path / name).write_bytes(bytes(4096))
    (tmp_path / "ds.json").write_text("{}")
    torchrun = build_job_config("tiny", [f'{field}="{value}"'])
    validate_job(torchrun, world_size=1)  # a worker's check: fine
    for check in (lambda: validated_job("tiny", [f'{field}="{value}"']),  # ds3dctl
                  lambda: parse_config(torchrun.dump_json())):  # ds3dd, a raw request
        with pytest.raises(ConfigError) as err:
            check()
        assert f"{field}={value!r}: use an absolute path" in str(err.value), str(err.value)
        assert "run directory" in str(err.value)
    validated_job("tiny", [f'{field}="{tmp_path / value}"'])


def test_a_deepspeed_json_removed_after_submission_does_not_stop_the_job(tmp_path):
    """Was: every worker start checked that train.deepspeed_config still existed, so a job
    whose JSON was moved or deleted after submission failed at its next restart (crash
    recovery, resume), and a multi-node share was refused on a node without the file. Its
    meaning is in the job's fields; the file is read where the job is built and submitted."""
    from ds3d.daemon.service import parse_config

    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"bf16": {"enabled": True}}))
    submitted = build_job_config("tiny", [f'train.deepspeed_config="{f}"']).dump_json()
    assert parse_config(submitted).train.precision == "bf16"
    f.unlink()
    stored = JobConfig.parse_json(submitted, "stored job")
    validate_job(stored, world_size=1)  # a worker (re)start
    assert parse_config(submitted, from_head=True).train.precision == "bf16"  # StartShare
    with pytest.raises(ConfigError, match="train.deepspeed_config=.*cannot be read"):
        parse_config(submitted)  # a new StartJob must be able to read it


def test_issue17_4_an_unreadable_path_is_a_refusal_not_a_crash():
    """A name too long for the filesystem made Path.is_file raise (INTERNAL in ds3dd)."""
    from ds3d.daemon.service import parse_config

    data = json.loads(build_job_config("tiny").dump_json())
    data["train"]["deepspeed_config"] = f"/{'a' * 300}.json"
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_config(json.dumps(data))


def test_issue17_4_unknown_preset_in_a_request_is_refused():
    data = json.loads(build_job_config("tiny").dump_json())
    data["preset"] = "gpt-nope"
    with pytest.raises(ConfigError, match="preset='gpt-nope': is not a preset"):
        JobConfig.parse_json(json.dumps(data), "request")


def test_issue17_refusals_stay_small_whatever_the_request_held():
    """A refusal becomes a gRPC status message: values are shortened, problems capped."""
    data = json.loads(build_job_config("tiny").dump_json())
    data["data"]["source"] = "x" * 100_000
    data["train"].update({f"bogus{i}": i for i in range(500)})
    with pytest.raises(ConfigError) as err:
        JobConfig.parse_json(json.dumps(data), "request")
    assert len(str(err.value)) < 4000 and "more problems" in str(err.value)


@pytest.mark.parametrize("sets, phrase", [
    (["launch.hosts=['10.0.0.2:7531']"], None),  # one host for one node: the head itself
    (["launch.hosts=['10.0.0.1:7531', '10.0.0.2:7531']"],
     "launch.nnodes=1 needs launch.hosts with one daemon address per node, this (head) node "
     "first; got 2: set launch.nnodes to the number of hosts"),
    (["launch.nnodes=2", "parallel.dp=2", "checkpoint.store='file:///tmp/s'"],
     "launch.nnodes=2 needs launch.hosts"),
    (["launch.nnodes=2", "parallel.dp=2", "launch.hosts=['10.0.0.1:7531', '10.0.0.2:7531']"],
     "launch.nnodes=2 needs checkpoint.store"),
])
def test_daemon_jobs_name_one_host_per_node_in_check_and_in_ds3dd(sets, phrase):
    """Was: hosts beside nnodes=1 were silently ignored by ds3dd (a one-node job ran), and
    `ds3dctl check` passed multi-node jobs ds3dd then refused (its checks were its own)."""
    from ds3d.daemon.check import validated_job
    from ds3d.daemon.service import parse_config

    if phrase is None:
        validated_job("tiny", sets)
        return
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        validated_job("tiny", sets)
    raw = build_job_config("tiny", sets)  # a worker under torchrun takes it as it is
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        parse_config(raw.dump_json())


@pytest.mark.parametrize("url, phrase", [
    ("file://data/ckpt", "three slashes"), ("file://", "three slashes"),
    ("file:///", "other than /"), ("s3://", "needs a bucket"), ("S3://b/p", "use file:///"),
    ("http://x", "use file:///"),
])
def test_a_store_url_ds3dd_cannot_open_is_refused_by_check(url, phrase):
    """Was: `ds3dctl check` passed `file://data/ckpt` (host "data", path "/ckpt") and `s3://`,
    which only ds3dd's store check refused; `file://` would have been the folder /<name>."""
    from ds3d.daemon.check import validated_job

    with pytest.raises(ConfigError) as err:
        validated_job("tiny", [f'checkpoint.store="{url}"'])
    assert f"checkpoint.store={url!r}: " in str(err.value) and phrase in str(err.value)


def test_store_urls_ds3dd_opens_are_accepted():
    for url in ("file:///data/ckpt", "file://localhost/data/ckpt", "s3://bucket",
                "s3://bucket/a/b"):
        assert build_job_config("tiny", [f'checkpoint.store="{url}"']).checkpoint.store == url


@pytest.mark.parametrize("replace, phrase", [
    (('"name": "dj"', '"name": "dj", "name": "other"'), "name is given twice"),
    (('"lr": 0.003', '"lr": 0.003, "lr": 0.1'), "train.lr is given twice"),
    (('"launch": {', '"train": {"steps": 7}, "launch": {'), "train is given twice"),
])
def test_a_request_that_gives_a_setting_twice_is_refused(replace, phrase):
    """Was: the JSON parser kept the last (a job named 'other', or a second [train] section
    replacing the first whole, every other train setting back at its default)."""
    text = build_job_config("tiny", name="dj").dump_json()
    assert replace[0] in text
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        JobConfig.parse_json(text.replace(replace[0], replace[1], 1), "request")
    assert JobConfig.parse_json(text, "request").name == "dj"
