"""A GPT-NeoX YAML config translated into a ds3d job, where ds3d's model can express it.

Why: people come from GPT-NeoX with a YAML that describes the model, the parallel layout and
the DeepSpeed settings at once. ds3d's GPT is a sequential-residual, pre-LayerNorm, full-rotary,
untied, GELU, dropout-free model; a NeoX config of that architecture is translated field by
field, and a config of any other (parallel residual, partial rotary, ALiBi, sparse attention,
tied embeddings, ...) is refused naming the field, never trained as something else.

Every key is mapped, refused, or (for keys that only describe the machine or a kernel choice:
hostfile, fusions, init scheme, evaluation cadence) reported as a note in `ds3dctl check`.
The DeepSpeed keys inside the YAML (optimizer, zero_optimization, fp16, batch sizes, ...) go
through the same translation as a DeepSpeed JSON (ds_config_import.py). The translated job
stands where a TOML job file would: `--set` overrides its values.

Standard library + PyYAML (a dependency of DeepSpeed); no torch.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from .ds_config_import import (
    BATCH_KEYS,
    DEEPSPEED_KEYS,
    FieldPath,
    read_deepspeed_json,
    shown,
    translate,
)
from .errors import ConfigError

# NeoX's defaults (megatron/neox_arguments/neox_args.py) where the YAML may leave them out.
_NEOX_DEFAULTS = {"pos_emb": "learned", "no_weight_tying": False, "norm": "layernorm",
                  "activation": "gelu", "rotary_pct": 1.0, "gpt_j_residual": False,
                  "make_vocab_size_divisible_by": 128, "tokenizer_type": "GPT2BPETokenizer"}
_TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257, "CharLevelTokenizer": 512}
_HF_TOKENIZER_VOCAB = {"20B_tokenizer.json": 50277}

_MODEL_FIELDS = {"num_layers": "n_layers", "hidden_size": "d_model",
                 "num_attention_heads": "n_heads", "seq_length": "seq_len",
                 "intermediate_size": "d_ff"}

# Keys that describe the machine, the files, or a kernel choice: they change nothing in what
# ds3d trains, and are reported (not silently dropped).
_NOTES = {
    "hostfile": "ds3d places processes itself (launch.hosts)",
    "distributed_backend": "ds3d picks NCCL on GPU, gloo on CPU",
    "launcher": "ds3d launches through its daemon",
    "num_workers": "ds3d's data loader reads its memory-mapped tokens in the step loop",
    "log_interval": "ds3d reports every step (ds3dctl events, TensorBoard)",
    "tensorboard_dir": "ds3d writes TensorBoard files in the job's folder",
    "log_dir": "ds3d writes logs in the job's folder",
    "eval_interval": "ds3d does not evaluate on a held-out split",
    "eval_iters": "ds3d does not evaluate on a held-out split",
    "split": "ds3d trains on all of data.source (no held-out split)",
    "data_impl": "ds3d reads data.source",
    "checkpoint_validation_with_forward_pass": "ds3d verifies checkpoints by sha256 manifest",
    "save": "ds3d saves to checkpoint.local_dir / checkpoint.store (--store)",
    "load": "ds3d resumes from its newest committed checkpoint",
    "init_method": "ds3d initialises weights with normal(0, model.init_std): the architecture "
                   "is the same, the initial scale differs",
    "output_layer_init_method": "ds3d initialises weights with normal(0, model.init_std)",
    "synchronize_each_layer": "a synchronisation only; no effect on the result",
    "scaled_upper_triang_masked_softmax_fusion": "a kernel choice; ds3d uses causal SDPA",
    "scaled_masked_softmax_fusion": "a kernel choice; ds3d uses causal SDPA",
    "rope_fusion": "a kernel choice; same rotary math",
    "layernorm_fusion": "a kernel choice; same LayerNorm math",
    "use_wandb": "ds3d reports through events, Prometheus and TensorBoard",
    "wandb_project": "ds3d reports through events, Prometheus and TensorBoard",
    "wandb_group": "ds3d reports through events, Prometheus and TensorBoard",
    "vocab_file": "used only to size the vocabulary",
    "merge_file": "used only with the vocabulary file",
    "max_position_embeddings": "rotary positions have no table; must be >= seq_length",
    "fp32_allreduce": "ds3d reduces bf16 gradients in fp32 (grad_accum_dtype) with ZeRO-1",
}


def not_toml_message(path: Path, err: tomllib.TOMLDecodeError) -> str:
    """Says what a file that is not TOML is, and how to give it instead."""
    try:
        head = path.read_text()[:4096].lstrip()
    except (OSError, UnicodeDecodeError):
        head = ""
    if head.startswith("{"):
        return (f"{path}: not valid TOML; it looks like a DeepSpeed JSON or a GPT-NeoX config. "
                "A DeepSpeed JSON says how to train, not which model: give it with a preset or "
                f"a TOML job, e.g. `ds3dctl start gpt125m --deepspeed {path}`; a GPT-NeoX YAML "
                f"is given as `ds3dctl start --neox {path}`")
    return f"{path}: not valid TOML: {err}"


def job_file_dict(source: str) -> tuple[dict[str, Any], dict[FieldPath, str]]:
    """A `.json`, `.yml` or `.yaml` job source -> (job dict, the fields it wrote)."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file {source!r} does not exist")
    if path.suffix == ".json":
        read_deepspeed_json(path)  # a shell template or broken JSON is named as such first
        raise ConfigError(
            f"{source} is a DeepSpeed JSON: it says how to train, not which model. Give it "
            f"together with a preset or a TOML job: `ds3dctl start gpt125m --deepspeed {source}` "
            "(or train.deepspeed_config in the TOML file); a GPT-NeoX config is given as "
            "`--neox FILE.yml`")
    return neox_job_dict(path)


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); a GPT-NeoX "
                          "config is a YAML mapping of NeoX arguments") from None
    except RecursionError:
        from .ds_config_import import too_deep
        raise ConfigError(too_deep(str(path), "a GPT-NeoX config")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a GPT-NeoX config is a YAML mapping, not "
                          f"{type(data).__name__}")
    return data


def neox_job_dict(path: Path) -> tuple[dict[str, Any], dict[FieldPath, str]]:
    """Translates a NeoX YAML -> (job dict, the fields it wrote); ConfigError listing every
    field ds3d cannot express."""
    job, explicit, _ = translate_neox(path)
    return job, explicit


def neox_notes(path: str | Path) -> list[str]:
    """The keys of a NeoX YAML that change nothing in ds3d, each with why (for `ds3dctl check`)."""
    return translate_neox(Path(path))[2]


def _arguments(raw: dict[Any, Any], problems: list[str]) -> dict[str, Any]:
    """The YAML's keys as NeoX reads them ('-' and '_' are one argument); a key that is not a
    name, or one argument written both ways, is a problem (which one would win?)."""
    neox: dict[str, Any] = {}
    written: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(f"{shown(key)}: a NeoX argument is a name, not "
                            f"{type(key).__name__}; remove it")
            continue
        name = key.replace("-", "_")
        if name in neox:
            problems.append(f"{written[name]} and {key} are the same NeoX argument with "
                            f"different values ({shown(neox[name])}, {shown(value)}); keep "
                            "one" if not _same_value(neox[name], value) else
                            f"{written[name]} and {key} are the same NeoX argument; keep one")
            continue
        neox[name], written[name] = value, key
    return neox


def _same_value(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def translate_neox(path: Path) -> tuple[dict[str, Any], dict[FieldPath, str], list[str]]:
    label = str(path)
    job: dict[str, Any] = {"name": path.stem.lower().replace(" ", "-"), "model": {},
                           "parallel": {}, "train": {}, "checkpoint": {}}
    notes: list[str] = []
    problems: list[str] = []
    neox = _arguments(_load_yaml(path), problems)
    get = lambda k: neox.get(k, _NEOX_DEFAULTS.get(k))  # noqa: E731

    def refuse(key: str, why: str) -> None:
        problems.append(f"{key}={shown(neox.get(key, _NEOX_DEFAULTS.get(key)))}"
                        f"{'' if key in neox else ' (NeoX default)'}: {why}")

    def number(key: str, default: Any = None, integer: bool = False) -> Any:
        """The argument as a finite number (an int where `integer`), or None after refusing
        it: YAML gives strings, lists, nulls and .inf as readily as numbers."""
        value = neox.get(key, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and (not integer or float(value).is_integer())
        if not ok:
            refuse(key, f"is not {'an integer' if integer else 'a finite number'}")
            return None
        return int(value) if integer else float(value)

    # -- architecture: what ds3d's GPT is, or a refusal naming the field
    if get("pos_emb") != "rotary":
        refuse("pos_emb", "ds3d's GPT uses rotary positions only (ALiBi, learned or sinusoidal "
               "positions cannot be expressed)")
    if get("rotary_pct") != 1 and get("rotary_pct") != 1.0:
        refuse("rotary_pct", "ds3d rotates every head dimension (partial rotary cannot be "
               "expressed)")
    if get("no_weight_tying") is not True:
        refuse("no_weight_tying", "ds3d's input embedding and output head are untied; set "
               "no_weight_tying: true")
    if get("gpt_j_residual") is not False:
        refuse("gpt_j_residual", "ds3d's blocks are sequential (x + attn, then + mlp); the "
               "parallel GPT-J residual cannot be expressed")
    if get("norm") != "layernorm":
        refuse("norm", "ds3d uses LayerNorm")
    if get("activation") != "gelu":
        refuse("activation", "ds3d's MLP uses exact GELU")
    if neox.get("bias_gelu_fusion"):
        refuse("bias_gelu_fusion", "NeoX's fused bias-GELU is the tanh approximation; ds3d uses "
               "exact GELU (set false)")
    for key in ("hidden_dropout", "attention_dropout"):
        if neox.get(key, 0) not in (0, 0.0):
            refuse(key, "ds3d's GPT has no dropout; set 0")
    for key in ("use_bias_in_attn_linear", "use_bias_in_norms"):
        if neox.get(key, True) is not True:
            refuse(key, "ds3d's linear layers and norms have biases")
    attn = neox.get("attention_config")
    dense = (["global"], ["flash"], "global", "flash")
    if attn is not None and not (isinstance(attn, list) and all(
            isinstance(a, list) and a and a[0] in dense for a in attn)):
        refuse("attention_config", "ds3d's attention is global (dense) in every layer (global "
               "or flash)")
    if neox.get("output_layer_parallelism", "column") != "column":
        refuse("output_layer_parallelism", "ds3d's output head is column (vocab) parallel")
    for key, name in _MODEL_FIELDS.items():
        if key in neox:
            job["model"][name] = neox[key]
    for key, name in (("layernorm_epsilon", "norm_eps"), ("rotary_emb_base", "rope_theta"),
                      ("init_method_std", "init_std")):
        if key in neox and (value := number(key)) is not None:
            job["model"][name] = value
    seq, mpe = neox.get("seq_length"), neox.get("max_position_embeddings")
    if isinstance(seq, int) and isinstance(mpe, int) and mpe < seq:
        refuse("max_position_embeddings", f"is below seq_length={seq}")

    tp = number("model_parallel_size", 1, integer=True) or 1
    job["parallel"]["tp"] = tp
    job["parallel"]["pp"] = max(1, number("pipe_parallel_size", 1, integer=True) or 1)
    vocab = _vocab_size(neox, tp, refuse, number)
    if vocab is not None:
        job["model"]["vocab_size"] = vocab

    # -- training
    if "train_iters" in neox:
        job["train"]["steps"] = neox["train_iters"]
    for key, name in (("weight_decay", "weight_decay"), ("seed", "seed")):
        if key in neox:
            job["train"][name] = neox[key]
    _schedule(neox, job, refuse, number)
    if neox.get("checkpoint_activations"):
        job["parallel"]["activation_checkpoint_interval"] = neox.get("checkpoint_num_layers", 1)
    if neox.get("partition_activations"):
        if tp > 1:
            refuse("partition_activations", "ds3d does not split checkpointed activations over "
                   "tensor-parallel ranks; set false")
        else:
            notes.append("partition_activations=true: no effect at model_parallel_size 1")
    precision = neox.get("precision")
    if precision is not None and not isinstance(precision, str):
        refuse("precision", "is not a name such as fp16, bfloat16 or fp32")
    elif precision is not None:
        job["train"]["precision"] = {"fp16": "fp16", "float16": "fp16", "bfloat16": "bf16",
                                     "bf16": "bf16", "fp32": "fp32", "float32": "fp32"}.get(
                                         precision, precision)
    if "checkpoint_factor" in neox:
        job["checkpoint"]["interval"] = neox["checkpoint_factor"]
    if "keep_last_n_checkpoints" in neox:
        job["checkpoint"]["keep_last"] = neox["keep_last_n_checkpoints"]
    for key in ("data_path", "train_data_paths", "train_data_path"):
        if key in neox:
            refuse(key, "set data.source instead (--set data.source=PATH, see "
                   "docs/configuration.md)")

    # -- the DeepSpeed keys of the YAML, as a DeepSpeed JSON would be translated
    ds = {k: v for k, v in neox.items() if k in DEEPSPEED_KEYS or k in BATCH_KEYS}
    extra = neox.get("deepspeed_extra_args") or {}
    if not isinstance(extra, dict):
        refuse("deepspeed_extra_args", "expected a mapping of DeepSpeed keys")
        extra = {}
    fp16 = ds.get("fp16")
    if isinstance(fp16, dict) and "fp16" in fp16:  # NeoX repeats enabled as fp16.fp16
        fp16 = dict(fp16)
        if fp16.pop("fp16") != fp16.get("enabled", fp16.get("fp16")):
            refuse("fp16", "fp16.fp16 and fp16.enabled disagree")
        ds["fp16"] = fp16
    tr = translate({**ds, **extra}, 1)
    if "train_batch_size" not in ds and ("train", "global_batch_size") in tr.fields:
        # NeoX's batch is per GPU (micro x accumulation); the global batch follows DP
        del tr.fields[("train", "global_batch_size")]
        tr.fields[("train", "grad_accum_steps")] = number("gradient_accumulation_steps", 1,
                                                         integer=True)
    problems += tr.problems
    notes += tr.notes
    for fpath, value in tr.fields.items():
        node = job
        for part in fpath[:-1]:
            node = node.setdefault(part, {})
        if fpath == ("train", "precision") and job["train"].get("precision", value) != value:
            refuse("precision", f"disagrees with the {value} block")
        node[fpath[-1]] = value
    for key in neox:
        if key in _NOTES:
            notes.append(f"{key}: {_NOTES[key]}")
        elif not _is_known(key):
            refuse(key, "a NeoX argument ds3d does not translate; remove it, or express it "
                   "with ds3d settings (docs/configuration.md)")
    if problems:
        raise ConfigError(f"{label}: this GPT-NeoX config cannot be translated to a ds3d job:"
                          "\n  - " + "\n  - ".join(problems))
    job["train"].setdefault("precision", "fp32")
    job = {k: v for k, v in job.items() if v != {}}
    explicit = {path: label for path in _leaves(job)}
    return job, explicit, notes


_KNOWN = set(_MODEL_FIELDS) | set(_NEOX_DEFAULTS) | {
    "pipe_parallel_size", "model_parallel_size", "layernorm_epsilon", "rotary_emb_base",
    "init_method_std", "bias_gelu_fusion", "hidden_dropout", "attention_dropout",
    "use_bias_in_attn_linear", "use_bias_in_norms", "attention_config",
    "output_layer_parallelism", "train_iters", "lr_decay_iters", "lr_decay_style", "warmup",
    "min_lr", "weight_decay", "seed", "checkpoint_activations", "checkpoint_num_layers",
    "partition_activations", "precision", "checkpoint_factor", "keep_last_n_checkpoints",
    "data_path", "train_data_paths", "train_data_path", "deepspeed_extra_args",
    "padded_vocab_size", "max_position_embeddings"}


def _is_known(key: str) -> bool:
    return key in _KNOWN or key in DEEPSPEED_KEYS or key in BATCH_KEYS


def _leaves(d: dict[str, Any], prefix: FieldPath = ()) -> list[FieldPath]:
    out: list[FieldPath] = []
    for k, v in d.items():
        out += _leaves(v, prefix + (k,)) if isinstance(v, dict) else [prefix + (k,)]
    return out


def _vocab_size(neox: dict[str, Any], tp: int, refuse: Any, number: Any) -> int | None:
    """NeoX pads the tokenizer's vocabulary to a multiple of make_vocab_size_divisible_by x TP."""
    if "padded_vocab_size" in neox:
        return number("padded_vocab_size", integer=True)  # type: ignore[no-any-return]
    kind = neox.get("tokenizer_type", _NEOX_DEFAULTS["tokenizer_type"])
    size = _TOKENIZER_VOCAB.get(kind) if isinstance(kind, str) else None
    if kind == "HFTokenizer":
        size = _HF_TOKENIZER_VOCAB.get(Path(str(neox.get("vocab_file", ""))).name)
    if size is None:
        refuse("tokenizer_type", "ds3d cannot tell this tokenizer's vocabulary size from the "
               "YAML; add padded_vocab_size: N to it")
        return None
    multiple = number("make_vocab_size_divisible_by", 128, integer=True)
    if multiple is None or multiple < 1:
        if multiple is not None:
            refuse("make_vocab_size_divisible_by", "must be 1 or more")
        return None
    return math.ceil(size / (multiple * tp)) * multiple * tp


def _schedule(neox: dict[str, Any], job: dict[str, Any], refuse: Any, number: Any) -> None:
    """NeoX's cosine decay maps onto ds3d's (warm-up fraction of lr_decay_iters, min_lr as a
    share of lr); other decay styles, or a decay that ends before the job, are refused."""
    style = neox.get("lr_decay_style", "linear")
    if style != "cosine":
        refuse("lr_decay_style", "ds3d's schedule is linear warm-up then cosine decay; use "
               "cosine")
        return
    iters = neox.get("lr_decay_iters", neox.get("train_iters"))
    if iters != neox.get("train_iters"):
        refuse("lr_decay_iters", f"ds3d decays over the whole job; set it to train_iters "
               f"({neox.get('train_iters')})")
        return
    if isinstance(iters, int) and "warmup" in neox and (warmup := number("warmup")) is not None:
        job["train"]["warmup_steps"] = int(round(warmup * iters))
    opt = neox.get("optimizer")
    params = opt.get("params", {}) if isinstance(opt, dict) else None
    lr = params.get("lr") if isinstance(params, dict) else None
    if "min_lr" in neox:
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
            refuse("min_lr", "needs optimizer.params.lr to express it as a share of lr")
        elif (min_lr := number("min_lr")) is not None:
            job["train"]["min_lr_ratio"] = min_lr / float(lr)
    else:
        job["train"]["min_lr_ratio"] = 0.0  # NeoX's default min_lr is 0


