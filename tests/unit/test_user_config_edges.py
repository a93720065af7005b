"""What real users' configs met at the edges (a probe with 15 public DeepSpeed JSONs, 2026-12-06):
every problem of a file in one answer named by the user's own key, Hugging Face's "auto" values
accounted for, DeepSpeed's deprecated and default-valued keys read as DeepSpeed reads them,
nesting deeper than a parser recurses refused with a message instead of a traceback, two
DeepSpeed configs for one job refused, and a schedule that never warms up said so."""

from __future__ import annotations

import io
import json

import pytest

from ds3d.daemon import cli
from ds3d.daemon.check import source_with_files, validated_job
from ds3d.trainer.config import build_job_config, job_warnings
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.memory_model import estimate


def ds_file(tmp_path, content, name="ds.json"):
    f = tmp_path / name
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    return f


def job(f, sets=()):
    src, overrides = source_with_files("tiny", str(f), None, list(sets))
    return validated_job(src, overrides)


def refusal(f, sets=()):
    with pytest.raises(ConfigError) as err:
        job(f, sets)
    return str(err.value)


def test_every_problem_of_the_file_in_one_answer_named_by_its_json_key(tmp_path):
    """Hugging Face's ds_config_zero3.json: the refused keys (offload, WarmupLR) and a mapped
    value the schema refuses (reduce_bucket_size 0) come in one answer; before, the second
    only after the user fixed the first three."""
    f = ds_file(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                 "reduce_bucket_size": 0,
                                                 "sub_group_size": 1e14},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    msg = refusal(f)
    assert "zero_optimization.offload_param" in msg and "scheduler.type" in msg
    assert "zero_optimization.reduce_bucket_size (the DeepSpeed JSON) -> " \
        "parallel.zero_options.reduce_bucket_size=0" in msg
    assert "sub_group_size" not in msg  # 1e14 (one sub-group) is a legal DeepSpeed value
    assert "Traceback" not in msg


def test_a_refused_value_the_user_wrote_in_toml_keeps_its_own_name(tmp_path):
    f = ds_file(tmp_path, {"gradient_clipping": -1.0})
    msg = refusal(f)
    assert "gradient_clipping (the DeepSpeed JSON) -> train.grad_clip=-1.0" in msg
    with pytest.raises(ConfigError) as err:  # not from the JSON: no JSON key named
        build_job_config("tiny", ["train.grad_clip=-1.0"])
    assert "DeepSpeed JSON" not in str(err.value) and "train.grad_clip=-1.0" in str(err.value)


def test_huge_sub_group_size_maps_onto_the_job(tmp_path):
    cfg = job(ds_file(tmp_path, {"zero_optimization": {"stage": 1, "sub_group_size": 1e14}}))
    assert cfg.parallel.zero_options.sub_group_size == 10**14


def test_every_auto_value_is_accounted_for_in_the_notes(tmp_path):
    from ds3d.trainer.ds_config_import import translate

    ds = {"optimizer": {"type": "AdamW", "params": {k: "auto" for k in
                                                    ("lr", "betas", "eps", "weight_decay")}},
          "gradient_clipping": "auto", "steps_per_print": "auto",
          "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
          "zero_optimization": {"stage": "auto"}}
    notes = "\n".join(translate(ds, 1).notes)
    for key, field in [("optimizer.params.lr", "train.lr"), ("optimizer.params.betas",
                                                             "train.betas"),
                       ("optimizer.params.eps", "train.eps"),
                       ("optimizer.params.weight_decay", "train.weight_decay"),
                       ("gradient_clipping", "train.grad_clip"),
                       ("steps_per_print", "train.steps_per_print"),
                       ("fp16.loss_scale_window", "train.loss_scale_window"),
                       ("zero_optimization.stage", "parallel.zero_stage")]:
        assert f'{key}="auto": {field} decides' in notes
    cfg = job(ds_file(tmp_path, ds))
    assert cfg.train.lr == build_job_config("tiny").train.lr  # ds3d's value, as said


def test_null_is_refused_not_dropped(tmp_path):
    msg = refusal(ds_file(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": None}}}))
    assert "optimizer.params.lr: null is not a number" in msg


@pytest.mark.parametrize("value, stage", [(True, 1), (False, 0)])
def test_deprecated_boolean_zero_optimization_is_read_as_deepspeed_reads_it(tmp_path, value,
                                                                             stage):
    """DeepSpeedExamples' Megatron-LM/scripts/ds_config.json writes "zero_optimization": true
    (DeepSpeed: read_zero_config_deprecated -> stage 1)."""
    cfg = job(ds_file(tmp_path, {"train_batch_size": 16, "zero_optimization": value}))
    assert cfg.parallel.zero_stage == stage


def test_zero_keys_at_deepspeeds_default_are_accepted_and_others_refused(tmp_path):
    from ds3d.trainer.ds_config_import import translate

    defaults = {"load_from_fp32_weights": True, "ignore_unused_parameters": True,
                "zero_hpz_partition_size": 1}
    tr = translate({"zero_optimization": {"stage": 1, **defaults}}, 1)
    assert not tr.problems
    assert all(any(n.startswith(f"zero_optimization.{k}=") for n in tr.notes) for k in defaults)
    tr = translate({"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 8,
                                          "zero_quantized_gradients": True}}, 1)
    assert len(tr.problems) == 2 and all("remove the key or set it to" in p
                                         for p in tr.problems)


def test_nesting_deeper_than_a_parser_recurses_is_refused_in_every_input(tmp_path):
    deep_json = ds_file(tmp_path, '{"a":' * 5000 + "1" + "}" * 5000)
    assert "nests objects or lists too deeply" in refusal(deep_json)
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("x = " + "[" * 3000 + "]" * 3000 + "\n")
    deep_yaml = tmp_path / "deep.yml"
    deep_yaml.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    for source, sets in [(str(deep_toml), []), (str(deep_yaml), []),
                         ("tiny", ["train.lr=" + "[" * 3000 + "]" * 3000])]:
        with pytest.raises(ConfigError) as err:
            build_job_config(source, sets)
        assert "nests objects or lists too deeply" in str(err.value)


def test_two_deepspeed_configs_for_one_job_are_refused(tmp_path):
    a = ds_file(tmp_path, {"train_batch_size": 16}, "a.json")
    b = ds_file(tmp_path, {"train_batch_size": 32}, "b.json")
    parser = cli.build_parser()
    with pytest.raises(cli.UsageError, match="--deepspeed given twice"):
        parser.parse_args(["check", "tiny", "--deepspeed", str(a), "--deepspeed", str(b)])
    assert parser.parse_args(["check", "tiny", "--deepspeed", str(a), "--deepspeed",
                              str(a)]).deepspeed == str(a)  # the same file twice is one file
    assert "two DeepSpeed configs" in refusal(a, [f"train.deepspeed_config={json.dumps(str(b))}"])
    toml = tmp_path / "job.toml"
    toml.write_text(f'preset = "tiny"\n[train]\ndeepspeed_config = {json.dumps(str(a))}\n')
    src, overrides = source_with_files(str(toml), str(b), None, [])
    with pytest.raises(ConfigError, match="two DeepSpeed configs"):
        validated_job(src, overrides)


def test_a_warmup_longer_than_the_job_is_warned_about_not_refused(tmp_path):
    cfg = build_job_config("tiny", ["train.steps=10", "train.warmup_steps=100"])
    (warning,) = job_warnings(cfg)
    assert "rises only to 10% of train.lr" in warning
    assert job_warnings(build_job_config("tiny", ["train.steps=10"])) == []
    out = io.StringIO()
    args = cli.build_parser().parse_args(["--addr", "127.0.0.1:1", "check", "tiny", "--set",
                                          "train.steps=10", "--set", "train.warmup_steps=100"])
    assert cli.run(args, out) == 0
    assert out.getvalue().rstrip().endswith(warning)  # the last lines a terminal shows


@pytest.mark.parametrize("sets, words", [
    (["train.betas=0.9"], "train.betas=0.9: expected a list, e.g. [0.9, 0.95]"),
    (["train=1"], "train=1: expected a section"),
])
def test_shape_errors_say_what_shape_is_expected(sets, words):
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", sets)
    assert words in str(err.value) and "TrainConfig" not in str(err.value)


def test_memory_labels_name_the_jobs_16_bit_type():
    cfg = build_job_config("tiny", ['train.precision="fp16"'])
    parts = estimate(cfg).ranks[0].gpu_parts
    assert "weights (fp16)" in parts and not any("bf16" in k for k in parts)


@pytest.mark.parametrize("setting, ok", [
    ('checkpoint.local_dir="/proc/self"', False), ('checkpoint.local_dir="/sys/fs/x"', False),
    ('checkpoint.store="file:///dev/ckpt"', False), ('checkpoint.local_dir="/dev/shm/ck"', True),
    ('checkpoint.local_dir="/data/ck"', True), ('checkpoint.store="file:///procedures/x"', True),
])
def test_checkpoint_paths_on_kernel_filesystems_are_refused(setting, ok):
    """A probe's local_dir = "/proc/self" was accepted, and every save then failed as "disk
    full"; /dev/shm (a tmpfs) stays a legitimate RAM disk."""
    from ds3d.trainer.config import validate_for_daemon

    cfg = build_job_config("tiny", [setting])
    if ok:
        validate_for_daemon(cfg)
    else:
        with pytest.raises(ConfigError, match="a kernel filesystem that holds no files"):
            validate_for_daemon(cfg)
