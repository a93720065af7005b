"""A user's DeepSpeed JSON / GPT-NeoX YAML has one meaning in ds3d: mapped onto the job's fields,
or refused before launch naming the key; the DeepSpeed config the workers get is built from the
fields only and passes DeepSpeed's own parser (no processes started)."""

from __future__ import annotations

import json

import pytest

from ds3d.daemon.check import source_with_files, validated_job
from ds3d.trainer.config import build_job_config
from ds3d.trainer.ds_config import build_deepspeed_config, deepspeed_verdict
from ds3d.trainer.errors import ConfigError


def ds_file(tmp_path, content, name="ds.json"):
    f = tmp_path / name
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    return f


def job(source, f=None, sets=()):
    src, overrides = source_with_files(source, str(f) if f else None, None, list(sets))
    return validated_job(src, overrides)


def refusal(source, f=None, sets=()):
    with pytest.raises(ConfigError) as err:
        job(source, f, sets)
    return str(err.value)


def test_batch_keys_derive_accumulation_as_deepspeed_does_at_ds3d_dp(tmp_path):
    """The issue's case: plain DeepSpeed accepts tb=16, mb=16 at DP 1; ds3d's preset global
    batch must not leave a derived accumulation DeepSpeed then rejects (16 != 16 * 4 * 1)."""
    f = ds_file(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 16})
    cfg = job("tiny", f)  # tiny's own micro 2 / global 8 are replaced, not mixed
    ds = build_deepspeed_config(cfg, 1)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"]) == (16, 16, 1)
    assert deepspeed_verdict(ds, 1) is None
    # at DP 2 the same keys cannot hold: refused naming the keys and the DP
    msg = refusal("tiny", f, ["parallel.dp=2"])
    assert "train_batch_size=16" in msg and "parallel.dp=2" in msg
    # micro + accumulation: the global batch follows DP
    f2 = ds_file(tmp_path, {"train_micro_batch_size_per_gpu": 2,
                            "gradient_accumulation_steps": 3}, "b.json")
    cfg = job("tiny", f2, ["parallel.dp=2"])
    assert build_deepspeed_config(cfg, 2)["train_batch_size"] == 12


def test_optimizer_precision_zero_clipping_map_onto_the_job(tmp_path):
    f = ds_file(tmp_path, {
        "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "betas": [0.9, 0.95],
                                                 "eps": 1e-8, "weight_decay": 0.01}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True},
        "gradient_clipping": 0.5, "steps_per_print": 10, "wall_clock_breakdown": True})
    cfg = job("gpt125m", f)  # the preset's bf16 is replaced by the JSON's fp16
    t = cfg.train
    assert (t.lr, t.betas, t.weight_decay, t.precision, t.initial_scale_power, t.grad_clip) == (
        1.5e-4, (0.9, 0.95), 0.01, "fp16", 12, 0.5)
    assert cfg.parallel.zero_stage == 2
    assert t.timing_interval == 10  # DeepSpeed's breakdown -> ds3d's step split, same cadence
    ds = build_deepspeed_config(cfg, 1)
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 500_000_000,
                                       "overlap_comm": True}
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    assert ds["wall_clock_breakdown"] is False and ds["steps_per_print"] == 10
    assert "optimizer" not in ds  # ds3d's AdamW, with the JSON's parameters


def test_a_json_never_silently_overrides_an_explicit_setting(tmp_path):
    f = ds_file(tmp_path, {"fp16": {"enabled": True}})
    msg = refusal("tiny", f, ["train.precision=fp32"])
    assert "fp16.enabled" in msg and "--set train.precision=fp32" in msg
    toml = tmp_path / "job.toml"
    toml.write_text(f'preset = "tiny"\n[train]\nlr = 1e-3\n'
                    f'deepspeed_config = "{tmp_path}/o.json"\n')
    ds_file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}}, "o.json")
    msg = refusal(str(toml))
    assert "optimizer.params.lr" in msg and str(toml) in msg
    # the same value is no conflict
    assert job("tiny", f, ["train.precision=\"fp16\""]).train.precision == "fp16"


def test_a_disabled_precision_block_means_fp32_as_in_deepspeed(tmp_path):
    f = ds_file(tmp_path, {"bf16": {"enabled": False}})
    assert job("gpt125m", f).train.precision == "fp32"  # the preset's bf16, switched off
    assert "bf16.enabled" in refusal("gpt125m", f, ["train.precision=bf16"])
    assert job("tiny", ds_file(tmp_path, {"fp16": {"enabled": False}}, "f.json")
               ).train.precision == "fp32"


def test_layout_rules_apply_to_the_effective_values(tmp_path):
    f = ds_file(tmp_path, {"zero_optimization": {"stage": 2}})
    msg = refusal("tiny", f, ["parallel.pp=2"])
    assert "zero_stage=2 with parallel.pp=2" in msg


@pytest.mark.parametrize("content, words", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, ["optimizer.type", "AdamW"]),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 0.3}}},
     ["optimizer.params.max_grad_norm", "gradient_clipping"]),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                                                         "warmup_num_steps": 10}}},
     ["scheduler.type", "train.warmup_steps=10"]),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, ["fp16.loss_scale", "dynamic"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     ["zero_optimization.offload_param"]),
    ({"activation_checkpointing": {"partition_activations": True}},
     ["activation_checkpointing.partition_activations"]),
    ({"trian_batch_size": 8}, ["trian_batch_size", "not a DeepSpeed setting"]),
    ({"prescale_gradients": True}, ["prescale_gradients"]),
])
def test_unmappable_keys_are_refused_naming_the_key(tmp_path, content, words):
    msg = refusal("tiny", ds_file(tmp_path, content))
    assert all(w in msg for w in words), msg


def test_constant_warmup_lr_is_exact_and_mapped(tmp_path):
    f = ds_file(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-3, "warmup_max_lr": 1e-3, "warmup_num_steps": 100}}})
    t = job("tiny", f).train
    assert (t.lr, t.warmup_steps, t.min_lr_ratio) == (1e-3, 0, 1.0)


def test_files_that_are_not_json_are_named_for_what_they_are(tmp_path):
    tmpl = ds_file(tmp_path, '{\n  "train_batch_size": GBSIZE,\n  "zero_optimization": '
                   '{"stage": ${ZERO_STAGE}}\n}\n', "t.json")
    msg = refusal("tiny", tmpl)
    assert "shell template" in msg and "GBSIZE" in msg and "${ZERO_STAGE}" in msg
    yml = ds_file(tmp_path, "# neox\nnum_layers: 2\n", "n.yml")
    assert "YAML" in refusal("tiny", yml)
    # a DeepSpeed JSON as the job itself: explained, not "not valid TOML"
    good = ds_file(tmp_path, {"train_batch_size": 8}, "ds_config.json")
    msg = refusal(str(good))
    assert "--deepspeed" in msg and "not valid TOML" not in msg
    misnamed = ds_file(tmp_path, '{"train_batch_size": 8}', "ds_config.toml")
    assert "--deepspeed" in refusal(str(misnamed))


def test_a_config_with_comments_that_deepspeed_reads_is_read_as_deepspeed_reads_it(tmp_path):
    """Was: a DeepSpeed config with comments and a trailing comma, which DeepSpeed's own
    reader (hjson) takes, was refused only as "not valid JSON (line 2, column 3: Expecting
    property name ...)", leaving the user to wonder why DeepSpeed runs it. It is read as
    DeepSpeed reads it: the same job as its strict-JSON twin; a duplicate key is still
    refused; what DeepSpeed cannot read either keeps the plain refusal."""
    loose = ds_file(tmp_path, '# from our launch scripts\n{\n  // 8 sequences a step\n'
                    '  "train_batch_size": 8,\n  /* per GPU */ "train_micro_batch_size_per_gpu": 2,'
                    '\n  "bf16": {"enabled": true,},\n}\n')
    strict = ds_file(tmp_path, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                "bf16": {"enabled": True}}, "strict.json")
    cfg = job("tiny", loose)
    assert cfg.train.model_dump(exclude={"deepspeed_config"}) == \
        job("tiny", strict).train.model_dump(exclude={"deepspeed_config"})
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (8, 2)
    twice = ds_file(tmp_path, '{\n  "train_batch_size": 8, // first\n  "train_batch_size": 16,\n}',
                    "twice.json")
    assert "appears twice" in refusal("tiny", twice)
    broken = ds_file(tmp_path, '{"train_batch_size": 8', "broken.json")
    assert "is not valid JSON" in refusal("tiny", broken)
    template = ds_file(tmp_path, '{\n  "train_batch_size": $BATCH, // filled in\n}', "t.json")
    assert "shell template" in refusal("tiny", template)


def test_deepspeeds_parser_run_from_threads_leaves_the_process_as_it_found_it():
    """Was: ds3dd checks a StartJob's DeepSpeed config in the RPC thread, inside
    redirect_stdout and a patched deepspeed.comm.get_rank, neither of them thread-safe: the
    first StartJobs at once (DeepSpeed imported by the first, cold) left the daemon's
    sys.stdout a StringIO and get_rank patched for good. A fresh interpreter, 8 threads."""
    import subprocess
    import sys

    script = (
        "import sys, threading, logging\n"
        "from ds3d.trainer.config import build_job_config\n"
        "from ds3d.trainer.ds_config import check_with_deepspeed\n"
        "cfg = build_job_config('tiny')\n"
        "out = sys.stdout\n"
        "ts = [threading.Thread(target=check_with_deepspeed, args=(cfg,)) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "import deepspeed.comm as c\n"
        "ok = sys.stdout is out and c.get_rank.__name__ != '<lambda>' and "
        "logging.getLogger('DeepSpeed').level != logging.ERROR\n"
        "print('restored' if ok else 'leaked', file=sys.__stderr__)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert "restored" in r.stderr, r.stderr[-2000:]


def test_hugging_face_auto_means_ds3d_value(tmp_path):
    f = ds_file(tmp_path, {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                           "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    cfg = job("tiny", f)
    base = build_job_config("tiny")
    assert cfg.train.model_dump(exclude={"deepspeed_config"}) == base.train.model_dump(
        exclude={"deepspeed_config"})


def test_elastic_zero0_is_refused_at_validation():
    msg = str(pytest.raises(ConfigError, build_job_config, "tiny", [
        "launch.nnodes=2", "launch.min_nodes=1", "parallel.dp=2", "parallel.zero_stage=0",
        "train.global_batch_size=8"]).value)
    assert "zero_stage=0" in msg and "zero_stage=1" in msg and "min_nodes = nnodes" in msg


def test_daemon_refuses_a_job_whose_json_was_never_translated(tmp_path):
    from ds3d.daemon.service import parse_config

    f = ds_file(tmp_path, {"fp16": {"enabled": True}})
    raw = build_job_config("tiny")
    raw.train.deepspeed_config = str(f)  # as a client that skipped ds3dctl would send it
    with pytest.raises(ConfigError, match="fp16.enabled"):
        parse_config(raw.dump_json())
    translated = build_job_config("tiny", [f'train.deepspeed_config="{f}"'])
    assert parse_config(translated.dump_json()).train.precision == "fp16"


NEOX = """
# a NeoX-style YAML (comments, Python booleans, trailing commas)
{
  "pipe_parallel_size": 2, "model_parallel_size": 2,
  "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
  "max_position_embeddings": 64, "norm": "layernorm", "pos_emb": "rotary",
  "no_weight_tying": true, "gpt_j_residual": false,
  "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1.0e-8,}},
  "min_lr": 0.0001,
  "zero_optimization": {"stage": 1, "overlap_comm": True,},
  "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
  "checkpoint_activations": true, "checkpoint_num_layers": 1,
  "fp16": {"enabled": true, "loss_scale": 0},
  "train_iters": 100, "lr_decay_iters": 100, "lr_decay_style": "cosine", "warmup": 0.1,
  "hostfile": "/mock_path",
}
"""


def test_neox_yaml_is_translated_where_the_architecture_is_expressible(tmp_path):
    f = ds_file(tmp_path, NEOX, "small.yml")
    cfg = job(str(f))
    m, p, t = cfg.model, cfg.parallel, cfg.train
    # NeoX pads GPT-2's 50257 to a multiple of 128 x TP (2)
    assert (m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size) == (4, 64, 4, 64, 50432)
    assert (p.tp, p.pp, p.zero_stage, p.activation_checkpoint_interval) == (2, 2, 1, 1)
    assert (t.steps, t.warmup_steps, t.lr, t.precision, t.micro_batch_size) == (
        100, 10, 0.001, "fp16", 2)
    assert t.min_lr_ratio == pytest.approx(0.1)
    assert build_deepspeed_config(cfg, 1)["train_batch_size"] == 4


@pytest.mark.parametrize("change, field", [
    ('"gpt_j_residual": false', '"gpt_j_residual": true'),
    ('"pos_emb": "rotary"', '"pos_emb": "alibi"'),
    ('"no_weight_tying": true', '"no_weight_tying": false'),
    ('"norm": "layernorm"', '"norm": "rmsnorm"'),
    ('"hostfile": "/mock_path"', '"rotary_pct": 0.25'),
    ('"hostfile": "/mock_path"', '"attention_config": [[["sparse_fixed"], 4]]'),
])
def test_neox_architecture_ds3d_cannot_express_is_refused_naming_the_field(tmp_path, change,
                                                                            field):
    f = ds_file(tmp_path, NEOX.replace(change, field), "bad.yml")
    msg = refusal(str(f))
    assert field.split(":")[0].strip('"') in msg


def test_check_prints_the_effective_job_and_deepspeed_config(tmp_path):
    """No daemon: --addr points nowhere and check still answers."""
    import io
    import tomllib

    from ds3d.daemon import cli

    f = ds_file(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                           "bf16": {"enabled": True}, "steps_per_print": 5})
    out = io.StringIO()
    args = cli.build_parser().parse_args(["--addr", "127.0.0.1:1", "check", "tiny", "--deepspeed",
                                          str(f), "--set", "train.steps=7"])
    assert cli.run(args, out) == 0
    text = out.getvalue()
    toml_part, rest = text.split("# ---- DeepSpeed config")
    job_toml = tomllib.loads(toml_part.split("\n", 1)[1])
    assert job_toml["train"]["precision"] == "bf16" and job_toml["train"]["steps"] == 7
    ds = json.loads(rest.split("\n", 1)[1].split("# ----")[0])
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"] == {"enabled": True} and ds["steps_per_print"] == 5


@pytest.mark.parametrize("content, words", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     ["bf16.enabled", "fp16.enabled", 'train.precision="bf16"', 'train.precision="fp16"']),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}},
     ["bf16.enabled", "fp16.enabled"]),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 3e-4,
                                                   "warmup_max_lr": 3e-4}}},
     ["optimizer.params.lr", "scheduler.params.warmup_max_lr", "train.lr=0.0003",
      "train.lr=0.0001"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 3e-4,
                                                   "warmup_max_lr": 3e-4}},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
     ["optimizer.params.lr", "scheduler.params.warmup_max_lr"]),
])
def test_two_keys_meaning_different_values_of_one_field_are_refused(tmp_path, content, words):
    """Was: the later key silently won (fp16 and bf16 both enabled trained in bf16, which
    DeepSpeed itself refuses; an lr beside a constant scheduler depended on key order)."""
    msg = refusal("tiny", ds_file(tmp_path, content))
    assert all(w in msg for w in words), msg
    assert "keep only one of the two" in msg


def test_keys_that_agree_on_a_field_are_accepted(tmp_path):
    f = ds_file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                           "scheduler": {"type": "WarmupLR", "params": {
                               "warmup_min_lr": 3e-4, "warmup_max_lr": 3e-4}},
                           "bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    t = job("tiny", f).train
    assert (t.lr, t.precision, t.min_lr_ratio) == (3e-4, "bf16", 1.0)


@pytest.mark.parametrize("value", ["1e400", "-1e400", "NaN", "Infinity"])
def test_non_finite_steps_per_print_is_refused_not_a_traceback(tmp_path, value):
    """Was: OverflowError from the early reading of steps_per_print for wall_clock_breakdown."""
    f = ds_file(tmp_path, f'{{"steps_per_print": {value}, "wall_clock_breakdown": true}}')
    assert "steps_per_print" in refusal("tiny", f)


@pytest.mark.timeout(30)
def test_a_deepspeed_config_that_is_no_regular_file_or_too_big_is_refused_unread(tmp_path):
    """Was: a FIFO blocked ds3dctl forever and /dev/zero read until a MemoryError traceback."""
    import os

    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        msg = str(pytest.raises(ConfigError, build_job_config, "tiny",
                                [f'train.deepspeed_config="{path}"']).value)
        assert "is not a regular file" in msg, msg
    big = ds_file(tmp_path, "{" + " " * (2 << 20) + "}", "big.json")
    msg = refusal("tiny", big)
    assert "a DeepSpeed JSON is a few KiB" in msg and str(big) in msg


@pytest.mark.parametrize("extra, words", [
    ('"layernorm_epsilon": "abc"', ['layernorm_epsilon="abc": is not a finite number']),
    ('"rotary_emb_base": [1]', ["rotary_emb_base=[1]: is not a finite number"]),
    ('"init_method_std": null', ["init_method_std=null: is not a finite number"]),
    ('"padded_vocab_size": "x"', ['padded_vocab_size="x": is not an integer']),
    ('"make_vocab_size_divisible_by": "x"', ["make_vocab_size_divisible_by"]),
    ('"make_vocab_size_divisible_by": 0', ["make_vocab_size_divisible_by=0: must be 1 or more"]),
    ('"warmup": "ten percent"', ['warmup="ten percent": is not a finite number']),
    ('"precision": ["fp16"]', ["precision=[\"fp16\"]: is not a name"]),
    ('"attention_config": 5', ["attention_config=5"]),
    ('"tokenizer_type": [1]', ["tokenizer_type"]),
    ('"optimizer": {"type": "Adam", "params": [1]}', ["optimizer.params"]),
    ('"model-parallel-size": 2', ["model_parallel_size and model-parallel-size are the same "
                                  "NeoX argument; keep one"]),
    ('"pipe-parallel-size": 4', ["pipe_parallel_size and pipe-parallel-size are the same NeoX "
                                 "argument with different values (2, 4); keep one"]),
    ('1: 2', ["1: a NeoX argument is a name, not int"]),
])
def test_neox_values_of_the_wrong_type_are_refused_naming_the_key(tmp_path, extra, words):
    """Was: ValueError/TypeError/AttributeError tracebacks from float()/int()/str.replace on the
    YAML's values and keys, and the same argument written with '-' and '_' silently
    deduplicated by whichever came last."""
    f = ds_file(tmp_path, NEOX.replace('"hostfile": "/mock_path",',
                                       f'"hostfile": "/mock_path", {extra},'), "odd.yml")
    msg = refusal(str(f))
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("n", [("model_parallel_size", ".inf"), ("pipe_parallel_size", "2.5"),
                               ("model_parallel_size", '"x"')])
def test_neox_parallel_sizes_must_be_integers(tmp_path, n):
    key, value = n
    f = ds_file(tmp_path, NEOX.replace(f'"{key}": 2', f'"{key}": {value}'), "p.yml")
    assert f"{key}=" in refusal(str(f)) and "is not an integer" in refusal(str(f))


@pytest.mark.timeout(60)
def test_a_yaml_of_expanding_anchors_is_refused_in_a_short_message(tmp_path):
    """Was: a 1 KB YAML whose anchors expand to 4 * 10**7 strings made a 254 MB refusal (12 s,
    500 MB of memory); one level more runs out of memory."""
    levels = ['&a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    text = NEOX.replace('"hostfile": "/mock_path",',
                        f'"hostfile": [{", ".join(levels)}], "bogus_key": *a8,'
                        ' "num_layers": *a8,').replace('"num_layers": 4,', "")
    msg = refusal(str(ds_file(tmp_path, text, "bomb.yml")))
    assert "bogus_key=" in msg and len(msg) < 4000, len(msg)
