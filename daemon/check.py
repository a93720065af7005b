"""`ds3dctl check`: a job validated without a daemon, shown as what will run.

Why: a user migrating a DeepSpeed JSON or a GPT-NeoX YAML needs to see what it means to ds3d
(the effective job, the DeepSpeed config the workers get, the keys that changed nothing) before
spending a cluster on it. `check_sections` returns named sections so that later views (e.g. a
memory estimate) are one more entry, not a new command.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds3d.trainer.config import JobConfig, build_job_config, job_warnings, validate_for_daemon


@dataclass(frozen=True)
class Section:
    title: str
    text: str


def validated_job(source: str, overrides: list[str], name: str | None = None) -> JobConfig:
    """The job as `ds3dctl start` would send it, after every check ds3dd makes, including
    DeepSpeed's own config parser on the config the workers would get."""
    from ds3d.trainer.ds_config import check_with_deepspeed

    cfg = build_job_config(source, overrides, name)
    check_with_deepspeed(cfg)
    validate_for_daemon(cfg)
    return cfg


def check_sections(cfg: JobConfig, source: str) -> list[Section]:
    """What `ds3dctl check` prints, in order. Each builder sees the validated job."""
    return [Section(title, build(cfg, source)) for title, build in SECTION_BUILDERS]


def _job_toml(cfg: JobConfig, source: str) -> str:
    return to_toml(cfg.model_dump(mode="json", exclude_none=True))


def _deepspeed(cfg: JobConfig, source: str) -> str:
    from ds3d.trainer.ds_config import build_deepspeed_config

    return json.dumps(build_deepspeed_config(cfg, cfg.parallel.dp), indent=2)


def _notes(cfg: JobConfig, source: str) -> str:
    """Keys of the user's DeepSpeed JSON / NeoX YAML that were accepted without a field to map
    onto (they restate what ds3d does), each with why."""
    from ds3d.trainer.ds_config_import import read_deepspeed_json, translate
    from ds3d.trainer.neox_import import neox_notes

    lines: list[str] = []
    if source.endswith((".yml", ".yaml")):
        lines += neox_notes(source)
    elif cfg.train.deepspeed_config:
        ds = read_deepspeed_json(cfg.train.deepspeed_config)
        lines += translate(ds, cfg.parallel.dp).notes
    return "\n".join(f"- {n}" for n in lines) if lines else "(none)"


def _memory(cfg: JobConfig, source: str) -> str:
    """The fit check's per-rank breakdown (what `ds3dctl start` refuses with)."""
    from ds3d.trainer.memory_model import breakdown, estimate

    return breakdown(estimate(cfg))


def _warnings(cfg: JobConfig, source: str) -> str:
    return "\n".join(f"- {w}" for w in job_warnings(cfg)) or "(none)"


SECTION_BUILDERS: list[tuple[str, Callable[[JobConfig, str], str]]] = [
    ("effective job (TOML)", _job_toml),
    ("DeepSpeed config the workers get (at the configured dp)", _deepspeed),
    ("accepted keys that change nothing in ds3d", _notes),
    ("predicted peak memory per rank", _memory),
    ("warnings", _warnings),  # last: what a terminal shows without scrolling
]


def render(sections: list[Section]) -> str:
    return "\n\n".join(f"# ---- {s.title}\n{s.text}" for s in sections)


# ---- a small TOML writer (the standard library reads TOML but does not write it) ----------


def to_toml(data: dict[str, Any]) -> str:
    lines: list[str] = []
    _table(data, (), lines)
    return "\n".join(lines).strip() + "\n"


def _table(data: dict[str, Any], path: tuple[str, ...], lines: list[str]) -> None:
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    if not scalars and not tables:
        return
    if path and scalars:
        lines.append(f"\n[{'.'.join(path)}]")
    for k, v in scalars.items():
        lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in tables.items():
        _table(v, path + (k,), lines)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, str)):
        return json.dumps(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else
                                                 ("inf" if v > 0 else "-inf"))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):  # in a list (data.blend's entries): an inline table
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _key(k: str) -> str:
    """A bare key when TOML allows one, else a quoted key."""
    return k if k and all(c.isascii() and (c.isalnum() or c in "-_") for c in k) \
        else json.dumps(k)


def source_with_files(source: str | None, deepspeed: str | None, neox: str | None,
                      overrides: list[str]) -> tuple[str, list[str]]:
    """`start`/`check` arguments -> (source, overrides): `--deepspeed FILE` becomes
    train.deepspeed_config (applied before --set, like the other shorthands), `--neox FILE`
    is the job source."""
    from ds3d.trainer.errors import ConfigError

    if neox is not None:
        if source is not None:
            raise ConfigError(f"give either a preset/job file ({source}) or --neox {neox}: a "
                              "GPT-NeoX YAML describes the whole job (override with --set)")
        if not neox.endswith((".yml", ".yaml")):
            raise ConfigError(f"--neox {neox}: expected a GPT-NeoX .yml/.yaml file")
        source = neox
    if source is None:
        raise ConfigError("a job source is required: give a preset (tiny, gpt125m, gpt1b, "
                          "gpt10b), a TOML job file, or --neox FILE.yml")
    if deepspeed is not None:
        path = Path(deepspeed)
        overrides = [f"train.deepspeed_config={json.dumps(str(path.resolve()))}"] + overrides
    return source, overrides
