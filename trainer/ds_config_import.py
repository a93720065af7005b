"""A user's DeepSpeed JSON (`train.deepspeed_config`), translated once into ds3d's own fields.

Why: ds3d builds the DeepSpeed config its workers get from its own fields only
(trainer/deepspeed_config.py), so that job.json, `ds3dctl status` and the engine can never
disagree. A DeepSpeed JSON is therefore an *input format*, like a preset or a TOML file: every
key is either mapped onto a ds3d field, or accepted because it only restates what ds3d does
anyway (reported as a note), or refused before launch with the key and what to do instead.
Nothing is passed through and nothing is dropped.

Precedence (docs/configuration.md, "DeepSpeed JSON"): preset < DeepSpeed JSON < TOML file and
`--set`. The JSON replaces preset values; a JSON value that differs from a value the user wrote
in the TOML file or with `--set` is refused, naming both, so that nothing silently overrides.
Keys the JSON does not have keep ds3d's values.

Pure standard library: `ds3dctl` imports this without torch or deepspeed.
"""

from __future__ import annotations

import json
import math
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

FieldPath = tuple[str, ...]
AUTO = "auto"  # Hugging Face's placeholder: "let the trainer decide" -> ds3d's value

MAX_JSON_BYTES = 1 << 20  # DeepSpeed configs are a few KiB; this is read before it is known
_SHELL_VAR = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")
_BARE_WORD = re.compile(r":\s*([A-Z][A-Z0-9_]{2,})\s*[,}\n]")


@dataclass
class Translation:
    """What one DeepSpeed JSON means in ds3d terms."""

    fields: dict[FieldPath, Any] = field(default_factory=dict)  # ds3d field -> value
    origin: dict[FieldPath, str] = field(default_factory=dict)  # ds3d field -> JSON key(s)
    notes: list[str] = field(default_factory=list)  # accepted keys that change nothing, and why
    problems: list[str] = field(default_factory=list)  # refused keys, each with the fix
    checks: list[Callable[[Any], str | None]] = field(default_factory=list)  # on the final job
    derived_accum: int | None = None  # accumulation the JSON's batch keys imply at ds3d's DP
    steps_per_print: int | None = None  # the JSON's, for wall_clock_breakdown
    disabled: list[tuple[str, str]] = field(default_factory=list)  # (precision, key) set false

    def set(self, path: FieldPath, value: Any, key: str) -> None:
        """Two keys of one JSON that mean different values of one field (fp16 and bf16 both
        enabled; an optimizer lr beside a constant scheduler's) are refused naming both: which
        one wins would depend on the keys' order in the file."""
        if path in self.fields and not _same(self.fields[path], value):
            self.refuse(key, f"means {'.'.join(path)}={shown(value)}, but "
                        f"{self.origin[path]} means {'.'.join(path)}="
                        f"{shown(self.fields[path])}; keep only one of the two")
            return
        self.fields[path] = value
        self.origin[path] = key

    def refuse(self, key: str, why: str) -> None:
        self.problems.append(f"{key}: {why}")


def shown(value: Any, limit: int = 80) -> str:
    """A value of the user's file in a message: as JSON (other types as text), cut at `limit`
    characters while it is written, so that a YAML value of anchors that expands to gigabytes
    costs no more than a short one."""
    parts: list[str] = []
    room = limit + 1

    def emit(text: str) -> None:
        nonlocal room
        parts.append(text[:room])
        room -= len(text)

    def walk(v: Any) -> None:
        if isinstance(v, (list, tuple, dict)):
            items = list(v.items()) if isinstance(v, dict) else list(v)
            emit("{" if isinstance(v, dict) else "[")
            for i, item in enumerate(items):
                if room <= 0:
                    return
                emit(", " if i else "")
                if isinstance(v, dict):
                    emit(json.dumps(str(item[0])) + ": ")
                    item = item[1]
                walk(item)
            emit("}" if isinstance(v, dict) else "]")
        else:
            emit(json.dumps(v, default=str))

    walk(value)
    text = "".join(parts)
    return text if len(text) <= limit else f"{text[:limit]}..."


# ---- reading the file -----------------------------------------------------------------------


def read_deepspeed_json(path: str | Path) -> dict[str, Any]:
    """The file as a dict, or a ConfigError saying what the file is instead (a shell template,
    a YAML file) and what to do."""
    path = Path(path)
    try:  # stat first: reading a FIFO blocks forever, /dev/zero until memory runs out
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"train.deepspeed_config={str(path)!r} is not a regular file; "
                              "give the path of a DeepSpeed JSON file")
        if info.st_size > MAX_JSON_BYTES:
            raise ConfigError(f"train.deepspeed_config={str(path)!r} is {info.st_size} bytes; "
                              f"a DeepSpeed JSON is a few KiB (at most {MAX_JSON_BYTES}): give "
                              "the config file, not a data or checkpoint file")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"train.deepspeed_config={str(path)!r} cannot be read: {e}") from None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ConfigError(f"{path}: the key {k!r} appears twice; DeepSpeed refuses "
                                  "duplicate keys too: keep one")
            out[k] = v
        return out

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except RecursionError:
        raise ConfigError(too_deep(str(path), "a DeepSpeed JSON")) from None
    except json.JSONDecodeError as e:
        data = _as_deepspeed_reads_it(text, no_duplicates)
        if data is None:
            raise ConfigError(_not_json_message(path, text, e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object ({{...}}), "
                          f"not a {type(data).__name__}")
    return data


def too_deep(where: str, what: str) -> str:
    """The refusal of a file or value nested deeper than Python's parsers recurse (thousands of
    brackets: never a config, and its traceback would say nothing)."""
    return (f"{where} nests objects or lists too deeply to be {what}; check that it is the "
            "file or value you meant")


def _not_json_message(path: Path, text: str, err: json.JSONDecodeError) -> str:
    placeholders = sorted(set(_SHELL_VAR.findall(text)) | set(_BARE_WORD.findall(text)))
    if placeholders:
        return (f"{path} is a shell template, not JSON: it has the placeholders "
                f"{', '.join(placeholders[:8])} that a launch script fills in (sed/envsubst). "
                "Render it with your values first, or give the values as ds3d settings "
                "(--set train.global_batch_size=..., see docs/configuration.md)")
    if path.suffix in (".yml", ".yaml") or re.search(r"^\s*#", text, re.M):
        return (f"{path} is not JSON (it looks like YAML, e.g. a GPT-NeoX config): give a "
                "GPT-NeoX YAML as `ds3dctl start FILE.yml` or `--neox FILE.yml`, which "
                "translates it; train.deepspeed_config takes a DeepSpeed JSON only")
    return (f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            "train.deepspeed_config takes a DeepSpeed JSON file")


# a config object first: braces after blank lines and hjson's comments (#, //, /* */)
_BRACED = re.compile(r"\A(?:\s|#[^\n]*|//[^\n]*|/\*.*?\*/)*\{", re.S)


def _as_deepspeed_reads_it(text: str, hook: Any) -> dict[str, Any] | None:
    """A config that is not strict JSON but that DeepSpeed's own reader takes (hjson: JSON
    with comments, trailing commas, unquoted strings; `DeepSpeedConfig` loads files with it),
    read the same way, duplicate keys refused as there; None for anything else. Only a braced
    object: hjson also reads brace-less `key: value` lines, which here are a YAML file (a
    GPT-NeoX config) or a shell template, refused as such by `_not_json_message`."""
    if not _BRACED.match(text) or _SHELL_VAR.search(text) or _BARE_WORD.search(text):
        return None
    try:
        import hjson  # DeepSpeed's dependency
    except ImportError:
        return None
    try:
        data = hjson.loads(text, object_pairs_hook=hook)
    except (ValueError, RecursionError):  # HjsonDecodeError is a ValueError
        return None
    return data if isinstance(data, dict) else None


# ---- translation ----------------------------------------------------------------------------


def _given(v: Any) -> bool:
    return v is not None and v != AUTO


def _auto(tr: Translation, key: str, v: Any, decides: str) -> bool:
    """Hugging Face's "auto" ("the trainer decides"): accepted, and said which ds3d setting
    decides, so that `ds3dctl check` accounts for every key of the file."""
    if v != AUTO:
        return False
    tr.notes.append(f"{key}=\"auto\": {decides} decides")
    return True


def _number(tr: Translation, key: str, v: Any, *, integer: bool = False) -> bool:
    """JSON writes big integers as 2e8: an integral float is an integer (DeepSpeed's reading)."""
    ok = (isinstance(v, int) or isinstance(v, float) and v.is_integer()) if integer else \
        isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        tr.refuse(key, f"{shown(v)} is not {'an integer' if integer else 'a number'}")
        return False
    return True


def _flag(tr: Translation, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        tr.refuse(key, f"{shown(v)} is not true or false")
        return False
    return True


def _only(tr: Translation, key: str, v: Any, allowed: Any, why: str) -> None:
    """A key ds3d accepts only at the value that restates what it does."""
    if v is None or v == allowed or v == AUTO:
        tr.notes.append(f"{key}={shown(v)}: {why}" if v is not None else f"{key}: {why}")
    else:
        tr.refuse(key, f"{shown(v)} is not supported by ds3d ({why}); remove the key or set "
                  f"it to {shown(allowed)}")


def _section(tr: Translation, key: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        tr.refuse(key, f"expected an object {{...}}, got {shown(v)}")
        return {}
    return v


def translate(ds: dict[str, Any], dp: int) -> Translation:
    """The meaning of DeepSpeed config `ds` for a ds3d job with `dp` data-parallel ranks."""
    tr = Translation()
    spp = ds.get("steps_per_print")
    # JSON's 1e400 is infinity: the key's own handler refuses it, this reading must not raise
    tr.steps_per_print = int(spp) if isinstance(spp, (int, float)) and math.isfinite(spp) \
        and spp >= 0 else None
    _batch(tr, ds, dp)
    for name, value in ds.items():
        if name in BATCH_KEYS:
            continue
        handler = DEEPSPEED_KEYS.get(name)
        if handler is None:
            tr.refuse(name, "not a DeepSpeed setting ds3d can map onto its own (see "
                      "docs/deepspeed-configs.md for the keys it maps); remove it")
        else:
            handler(tr, name, value)
    return tr


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps")


def _batch(tr: Translation, ds: dict[str, Any], dp: int) -> None:
    """DeepSpeed's own batch rules (`_set_batch_related_parameters`) at ds3d's DP: the JSON's
    batch keys fix the global and micro-batch; accumulation is derived by ds3d from them, so it
    is never a number the user did not write."""
    tb, mb, gas = (ds.get(k) for k in BATCH_KEYS)
    given = {k: v for k, v in zip(BATCH_KEYS, (tb, mb, gas), strict=True) if _given(v)}
    for k in BATCH_KEYS:
        if ds.get(k) == AUTO:
            tr.notes.append(f"{k}=\"auto\": ds3d's train.* batch settings decide")
    for k, v in given.items():
        if not _number(tr, k, v, integer=True):
            return
        if v <= 0:
            tr.refuse(k, f"{v} must be > 0")
            return
        given[k] = int(v)
    tb, mb, gas = (given.get(k) for k in BATCH_KEYS)
    keys = " + ".join(given)
    where = f"at parallel.dp={dp}"
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * dp:
            tr.refuse(keys, f"train_batch_size={tb} != micro ({mb}) x accumulation ({gas}) x "
                      f"dp ({dp}) = {mb * gas * dp} {where}; give two of the three keys, or "
                      f"use parallel.dp={tb // (mb * gas)}" if tb % (mb * gas) == 0 else
                      f"train_batch_size={tb} is not micro x accumulation x dp {where}")
            return
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            tr.refuse(keys, f"train_batch_size={tb} is not divisible by "
                      f"train_micro_batch_size_per_gpu x dp = {mb} x {dp} {where}")
            return
    elif tb is not None and gas is not None:
        if tb % (gas * dp):
            tr.refuse(keys, f"train_batch_size={tb} is not divisible by "
                      f"gradient_accumulation_steps x dp = {gas} x {dp} {where}")
            return
        mb = tb // (gas * dp)
    elif mb is not None and gas is not None:
        tb = mb * gas * dp
    elif tb is not None:
        if tb % dp:
            tr.refuse(keys, f"train_batch_size={tb} is not divisible by dp={dp}")
            return
        mb = tb // dp
    elif mb is not None:
        tb = mb * dp
    elif gas is not None:
        tr.refuse("gradient_accumulation_steps", "alone it does not fix a batch size (DeepSpeed "
                  "needs train_batch_size or train_micro_batch_size_per_gpu too); add one")
        return
    else:
        return
    tr.set(("train", "micro_batch_size"), mb, keys)
    tr.set(("train", "global_batch_size"), tb, keys)
    tr.set(("train", "grad_accum_steps"), None, keys)  # derived: tb / (mb x dp)
    tr.derived_accum = tb // (mb * dp)


def _precision_block(kind: str) -> Callable[[Translation, str, Any], None]:
    def handle(tr: Translation, key: str, value: Any) -> None:
        block = _section(tr, key, value)
        enabled = block.get("enabled")
        if _given(enabled) and _flag(tr, f"{key}.enabled", enabled):
            if enabled:
                tr.set(("train", "precision"), kind, f"{key}.enabled")
            else:
                tr.disabled.append((kind, f"{key}.enabled"))
            tr.checks.append(lambda cfg, e=enabled: _precision_agrees(cfg, key, kind, e))
        elif enabled == AUTO:
            tr.notes.append(f"{key}.enabled=\"auto\": train.precision decides")
        for k, v in block.items():
            full = f"{key}.{k}"
            if k == "enabled":
                continue
            if kind == "fp16" and k in _FP16_FIELDS:
                if _auto(tr, full, v, f"train.{_FP16_FIELDS[k]}"):
                    continue
                if _number(tr, full, v, integer=k != "min_loss_scale"):
                    tr.set(("train", _FP16_FIELDS[k]),
                           float(v) if k == "min_loss_scale" else int(v), full)
            elif kind == "fp16" and k == "loss_scale":
                if _given(v) and v != 0:
                    tr.refuse(full, f"a static loss scale ({v}) is not supported: ds3d scales "
                              "fp16 losses dynamically; set 0 (dynamic) and tune "
                              "initial_scale_power / loss_scale_window / hysteresis")
                else:
                    tr.notes.append(f"{full}={shown(v)}: dynamic loss scaling, as ds3d does")
            elif k in ("auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads",
                       "bf16_master_weights_and_grads", "bf16_optimizer_states",
                       "immediate_grad_update"):
                _only(tr, full, v, False, "ds3d keeps fp32 master weights and optimizer states "
                      "and casts the model, not the inputs")
            else:
                tr.refuse(full, f"not a {kind} setting ds3d maps; remove it")
    return handle


_FP16_FIELDS = {"initial_scale_power": "initial_scale_power",
                "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
                "min_loss_scale": "min_loss_scale"}


def _precision_agrees(cfg: Any, key: str, kind: str, enabled: bool) -> str | None:
    if not enabled and cfg.train.precision == kind:
        return (f"{key}.enabled=false but train.precision={kind!r}; make them agree")
    return None


_ZERO_TUNING = ("allgather_partitions", "allgather_bucket_size", "overlap_comm",
                "reduce_scatter", "reduce_bucket_size", "contiguous_gradients",
                "round_robin_gradients", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
                "sub_group_size")
_ZERO_ALIASES = {"stage3_gather_fp16_weights_on_model_save":
                 "stage3_gather_16bit_weights_on_model_save"}


# ZeRO keys ds3d accepts only at DeepSpeed's default (deepspeed/runtime/zero/config.py), where
# a config restating the default changes nothing
_ZERO_AT_DEFAULT: dict[str, Any] = {
    "load_from_fp32_weights": True, "ignore_unused_parameters": True,
    "use_multi_rank_bucket_allreduce": True, "compute_grad_norm": True,
    "memory_efficient_linear": True, "override_module_apply": True,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False, "legacy_stage1": False, "parameter_alignment": False,
    "pipeline_loading_checkpoint": False, "log_trace_cache_warnings": False,
    "enable_sanity_checks": False}


def _zero(tr: Translation, key: str, value: Any) -> None:
    if isinstance(value, bool):  # DeepSpeed's deprecated form (`read_zero_config_deprecated`)
        tr.set(("parallel", "zero_stage"), int(value), key)  # true: {"stage": 1}
        return
    block = _section(tr, key, value)
    for k, v in block.items():
        full = f"{key}.{k}"
        name = _ZERO_ALIASES.get(k, k)
        if k == "stage":
            if not _auto(tr, full, v, "parallel.zero_stage") and \
                    _number(tr, full, v, integer=True):
                tr.set(("parallel", "zero_stage"), int(v), full)
        elif name in _ZERO_TUNING:
            if _given(v):
                flag = name in ("allgather_partitions", "overlap_comm", "reduce_scatter",
                                "contiguous_gradients", "round_robin_gradients",
                                "stage3_gather_16bit_weights_on_model_save")
                if (_flag(tr, full, v) if flag else _number(tr, full, v, integer=True)):
                    tr.set(("parallel", "zero_options", name), v if flag else int(v), full)
            else:
                tr.notes.append(f"{full}=\"auto\": DeepSpeed's default")
        elif k in ("offload_optimizer", "offload_param"):
            device = v.get("device") if isinstance(v, dict) else v
            _only(tr, full, device if device != "none" else None, None,
                  "ds3d does not offload to CPU/NVMe; it shards with ZeRO over DP ranks")
        elif k == "cpu_offload":
            _only(tr, full, v, False, "ds3d does not offload to CPU")
        elif k in _ZERO_AT_DEFAULT:
            _only(tr, full, v, _ZERO_AT_DEFAULT[k], "DeepSpeed's default, which ds3d keeps")
        elif k == "elastic_checkpoint":
            _only(tr, full, v, False, "ds3d reshapes checkpoints through DeepSpeed's universal "
                  "checkpoint (checkpoints/reshape.py)")
        else:
            tr.refuse(full, "not a ZeRO setting ds3d maps (stage and the bucket/overlap options "
                      "are); remove it")


_ADAM_TYPES = {"adam", "adamw"}


def _optimizer(tr: Translation, key: str, value: Any) -> None:
    block = _section(tr, key, value)
    kind = block.get("type")
    if not isinstance(kind, str) or kind.lower() not in _ADAM_TYPES:
        tr.refuse(f"{key}.type", f"{shown(kind)}: ds3d trains with AdamW only (decoupled "
                  "weight decay on matrices); use \"Adam\" or \"AdamW\", or remove the block "
                  "and set train.lr / train.betas / train.eps / train.weight_decay")
        return
    for k in block:
        if k not in ("type", "params"):
            tr.refuse(f"{key}.{k}", "an optimizer block has only type and params")
    params = _section(tr, f"{key}.params", block.get("params", {}))
    for k, v in params.items():
        full = f"{key}.params.{k}"
        if k in ("lr", "eps", "weight_decay"):
            if not _auto(tr, full, v, f"train.{k}") and _number(tr, full, v):
                tr.set(("train", k), float(v), full)
        elif k == "betas":
            if not _auto(tr, full, v, "train.betas"):
                if (isinstance(v, list) and len(v) == 2
                        and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                for b in v)):
                    tr.set(("train", "betas"), [float(b) for b in v], full)
                else:
                    tr.refuse(full, f"{shown(v)} is not a pair of numbers [beta1, beta2]")
        elif k == "adam_w_mode":
            _only(tr, full, v, True, "ds3d's Adam is AdamW (decoupled weight decay)")
        elif k == "bias_correction":
            _only(tr, full, v, True, "torch AdamW always corrects the bias")
        elif k == "amsgrad":
            _only(tr, full, v, False, "ds3d's AdamW does not use AMSGrad")
        elif k in ("torch_adam", "fused"):
            tr.notes.append(f"{full}={shown(v)}: selects an implementation only; ds3d uses "
                            "torch.optim.AdamW (fused on GPU)")
        elif k == "max_grad_norm":
            tr.checks.append(lambda cfg, v=v, full=full: _max_grad_norm(cfg, full, v))
        else:
            tr.refuse(full, "not an Adam parameter ds3d maps (lr, betas, eps, weight_decay); "
                      "remove it")


def _max_grad_norm(cfg: Any, key: str, v: Any) -> str | None:
    if v == cfg.train.grad_clip or v == 0:
        return None
    return (f"{key}={v}: DeepSpeed does not clip with an optimizer parameter (it warns and "
            f"ignores it) while train.grad_clip={cfg.train.grad_clip} clips; set "
            f"\"gradient_clipping\": {v} instead and remove max_grad_norm")


def _scheduler(tr: Translation, key: str, value: Any) -> None:
    """Maps only where ds3d's schedule gives exactly DeepSpeed's learning rates: DeepSpeed's
    warm-ups start at step 0 with the minimum (ds3d's first step trains at lr / warmup_steps)
    and its cosine counts one step later, so only constant schedules are exact."""
    block = _section(tr, key, value)
    kind = block.get("type")
    params = block.get("params", {}) if isinstance(block.get("params", {}), dict) else {}
    const_lr = None
    if kind == "WarmupLR":
        lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr")
        if isinstance(hi, (int, float)) and not isinstance(hi, bool) and lo == hi:
            const_lr = hi
    elif kind == "WarmupCosineLR":
        if params.get("warmup_min_ratio", 0.0) == 1 and params.get("cos_min_ratio", 1e-4) == 1:
            const_lr = AUTO
    if const_lr is not None:
        if const_lr != AUTO:
            tr.set(("train", "lr"), float(const_lr), f"{key}.params.warmup_max_lr")
        tr.set(("train", "warmup_steps"), 0, f"{key} (constant)")
        tr.set(("train", "min_lr_ratio"), 1.0, f"{key} (constant)")
        return
    warm = params.get("warmup_num_steps", 1000)
    hint = f"train.warmup_steps={warm if isinstance(warm, int) else 'N'}"
    if kind == "WarmupCosineLR":
        hint += f", train.min_lr_ratio={params.get('cos_min_ratio', 1e-4)}"
    elif kind == "WarmupLR":
        hint += ", train.min_lr_ratio=1.0 (constant after warm-up)"
    tr.refuse(f"{key}.type", f"{shown(kind)} is not exactly ds3d's schedule (linear warm-up "
              "whose first step trains at lr/warmup_steps, then cosine to min_lr_ratio x lr at "
              "train.steps; DeepSpeed's warm-ups start at the minimum, default 'log' shape, "
              "and WarmupDecayLR decays linearly); remove the scheduler block and set the "
              f"nearest ds3d schedule yourself, e.g. {hint}")


def _fixed(value: Any, why: str) -> Callable[[Translation, str, Any], None]:
    return lambda tr, key, v: _only(tr, key, v, value, why)


def _enabled_false(why: str) -> Callable[[Translation, str, Any], None]:
    def handle(tr: Translation, key: str, v: Any) -> None:
        block = _section(tr, key, v)
        _only(tr, f"{key}.enabled", block.get("enabled", False), False, why)
    return handle


def _activation_checkpointing(tr: Translation, key: str, value: Any) -> None:
    block = _section(tr, key, value)
    for k, v in block.items():
        full = f"{key}.{k}"
        if k in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                 "synchronize_checkpoint_boundary", "profile"):
            _only(tr, full, v, False, "ds3d recomputes whole layers "
                  "(parallel.activation_checkpoint_interval) without partitioning, CPU copies "
                  "or extra synchronisation")
        elif k == "number_checkpoints":
            _only(tr, full, v, None, "only used with contiguous_memory_optimization")
        else:
            tr.refuse(full, "not an activation checkpointing option ds3d maps; use "
                      "parallel.activation_checkpoint_interval")


def _grad_clip(tr: Translation, key: str, v: Any) -> None:
    if not _auto(tr, key, v, "train.grad_clip") and _number(tr, key, v):
        tr.set(("train", "grad_clip"), float(v), key)


def _steps_per_print(tr: Translation, key: str, v: Any) -> None:
    if not _auto(tr, key, v, "train.steps_per_print") and _number(tr, key, v, integer=True):
        tr.set(("train", "steps_per_print"), int(v), key)


def _wall_clock(tr: Translation, key: str, v: Any) -> None:
    """DeepSpeed's breakdown prints forward/backward/step times every steps_per_print steps;
    ds3d's step split (train.timing_interval, `ds3dctl status JOB`) reports the same, for every
    stage (DeepSpeed's own crashes with pipeline stages, FIELD-NOTES)."""
    if not _flag(tr, key, v):
        return
    if v:
        every = _STEPS_PER_PRINT_DEFAULT if tr.steps_per_print is None else tr.steps_per_print
        tr.set(("train", "timing_interval"), every, f"{key} (+ steps_per_print)")
    else:
        tr.notes.append(f"{key}=false: DeepSpeed's breakdown stays off; ds3d's own step split "
                        "is train.timing_interval")


_STEPS_PER_PRINT_DEFAULT = 10  # DeepSpeed's


def _data_types(tr: Translation, key: str, value: Any) -> None:
    for k, v in _section(tr, key, value).items():
        if k == "grad_accum_dtype":
            tr.checks.append(lambda cfg, v=v, full=f"{key}.{k}": _grad_accum_dtype(cfg, full, v))
        else:
            tr.refuse(f"{key}.{k}", "not a data type ds3d maps; remove it")


def _grad_accum_dtype(cfg: Any, key: str, v: Any) -> str | None:
    ds3d = "fp32" if cfg.train.precision == "fp32" or (
        cfg.train.precision == "bf16" and cfg.parallel.zero_stage == 1) else None
    if v == ds3d or v is None:
        return None
    return (f"{key}={shown(v)}: with train.precision={cfg.train.precision!r} and "
            f"zero_stage={cfg.parallel.zero_stage} ds3d accumulates gradients "
            f"{'in ' + ds3d if ds3d else 'as DeepSpeed does by default'}; remove the key")


DEEPSPEED_KEYS: dict[str, Callable[[Translation, str, Any], None]] = {
    "fp16": _precision_block("fp16"),
    "bf16": _precision_block("bf16"),
    "bfloat16": _precision_block("bf16"),
    "zero_optimization": _zero,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "gradient_clipping": _grad_clip,
    "steps_per_print": _steps_per_print,
    "activation_checkpointing": _activation_checkpointing,
    "data_types": _data_types,
    "wall_clock_breakdown": _wall_clock,
    "zero_allow_untested_optimizer": lambda tr, key, v: tr.notes.append(
        f"{key}={shown(v)}: no effect, ds3d's torch AdamW is one DeepSpeed tests with ZeRO"),
    "prescale_gradients": _fixed(False, "ds3d averages gradients after the reduction"),
    "gradient_predivide_factor": _fixed(1.0, "ds3d averages gradients after the reduction"),
    "sparse_gradients": _fixed(False, "ds3d's gradients are dense"),
    "memory_breakdown": _fixed(False, "ds3d reports memory itself"),
    "communication_data_type": _fixed(None, "ds3d reduces gradients in their training type"),
    "dump_state": _fixed(False, "not used by ds3d"),
    "tensorboard": _enabled_false("ds3d writes TensorBoard event files itself (`ds3dctl logs JOB "
                                  "--tensorboard`)"),
    "wandb": _enabled_false("ds3d reports through events, Prometheus and TensorBoard"),
    "csv_monitor": _enabled_false("ds3d reports through events, Prometheus and TensorBoard"),
    "comet": _enabled_false("ds3d reports through events, Prometheus and TensorBoard"),
    "flops_profiler": _enabled_false("ds3d reports tokens/s and the step split itself"),
    "comms_logger": _enabled_false("ds3d reports the DP reduction time itself"),
    "autotuning": _enabled_false("ds3d does not run DeepSpeed's autotuner"),
    "amp": _enabled_false("ds3d's precision is train.precision"),
    "elasticity": _enabled_false("ds3d's elasticity is launch.min_nodes (docs/configuration.md)"),
    "curriculum_learning": _enabled_false("ds3d's data order is fixed by (seed, step)"),
    "data_efficiency": _enabled_false("ds3d's data order is fixed by (seed, step)"),
    "compression_training": _fixed(None, "ds3d trains without compression"),
    "checkpoint": _fixed(None, "ds3d saves and restores checkpoints itself (checkpoint.*)"),
    "pipeline": _fixed(None, "ds3d sets the pipeline from parallel.pp and "
                       "parallel.partition_method"),
}


# ---- applying it to a job -------------------------------------------------------------------


def _get(data: dict[str, Any], path: FieldPath) -> Any:
    node: Any = data
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return node


def _put(data: dict[str, Any], path: FieldPath, value: Any) -> None:
    node = data
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def import_into(data: dict[str, Any], explicit: dict[FieldPath, str]) -> Translation:
    """Applies `data['train']['deepspeed_config']` to the job dict `data` in place.
    `explicit` names the fields the user wrote (path -> "the TOML file" or "--set"); a JSON
    value that differs from one of them is refused naming both. The refused keys are left in
    `problems`, not raised, so that the caller reports them with the schema's verdict on the
    values that were mapped (`refusal`): every problem of the file in one answer."""
    path = _get(data, ("train", "deepspeed_config"))
    ds = read_deepspeed_json(path)
    dp = _get(data, ("parallel", "dp"))
    tr = translate(ds, dp if isinstance(dp, int) and dp > 0 else 1)
    current = _get(data, ("train", "precision"))
    for kind, key in tr.disabled:
        if ("train", "precision") not in tr.fields and current == kind:
            tr.set(("train", "precision"), "fp32", key)  # DeepSpeed's meaning: neither block on
    for fpath, value in tr.fields.items():
        where = explicit.get(fpath)
        if fpath == ("train", "grad_accum_steps") and value is None:
            value = tr.derived_accum  # the user's explicit accumulation must equal the derived
        if where is not None and not _same(_get(data, fpath), value):
            tr.problems.append(
                f"{tr.origin[fpath]} means {'.'.join(fpath)}={shown(value)}, but "
                f"{where} sets {'.'.join(fpath)}={shown(_get(data, fpath))}; remove one "
                "of the two (a DeepSpeed JSON never silently overrides a ds3d setting)")
    for fpath, value in tr.fields.items():
        if fpath not in explicit:
            _put(data, fpath, value)
    return tr


def refusal(path: Any, problems: list[str]) -> str:
    return (f"train.deepspeed_config={path!r} cannot be used as it is:\n  - "
            + "\n  - ".join(problems))


def mapped_from_json(tr: Translation, explicit: dict[FieldPath, str]) -> dict[FieldPath, str]:
    """ds3d field -> the JSON key its value came from (fields the user also wrote are theirs),
    so that a value the schema refuses is named as the user wrote it."""
    return {f: key for f, key in tr.origin.items() if f not in explicit}


def check_translated(cfg: Any, tr: Translation) -> None:
    """The checks that need the final job (e.g. a JSON key that must agree with the final
    precision)."""
    problems = [p for p in (check(cfg) for check in tr.checks) if p]
    if problems:
        raise ConfigError(refusal(cfg.train.deepspeed_config, problems))


def verify_job_matches(cfg: Any) -> None:
    """For a job that arrives already built (ds3dd, the workers): its fields must be what its
    DeepSpeed JSON means, i.e. it was translated with `import_into` (ds3dctl does that).
    A job whose JSON was never translated would otherwise have its keys silently ignored."""
    if cfg.train.deepspeed_config is None:
        return
    ds = read_deepspeed_json(cfg.train.deepspeed_config)
    tr = translate(ds, cfg.parallel.dp)
    data = cfg.model_dump(mode="json")
    for fpath, value in tr.fields.items():
        if fpath == ("train", "grad_accum_steps") and _get(data, fpath) == tr.derived_accum:
            continue  # written explicitly, equal to what the JSON's batch keys derive
        if not _same(_get(data, fpath), value):
            tr.problems.append(
                f"{tr.origin[fpath]} means {'.'.join(fpath)}={shown(value)}, but the job "
                f"has {shown(_get(data, fpath))}; build the job with `ds3dctl check`/"
                "`ds3dctl start`, which translate the JSON, or make them agree")
    tr.problems += [p for p in (check(cfg) for check in tr.checks) if p]
    if tr.problems:
        raise ConfigError(f"train.deepspeed_config={cfg.train.deepspeed_config!r} does not "
                          "match the job:\n  - " + "\n  - ".join(tr.problems))
