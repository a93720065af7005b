"""The operator-facing files stay true to the code: the example jobs load and say what their
comments say, the systemd unit keeps the training alive across daemon restarts and only passes
flags ds3dd has, and the docs name only metrics, settings and commands that exist."""

import re
import shlex
from pathlib import Path

import pytest

from ds3d.daemon import cli
from ds3d.daemon import main as ds3dd_main
from ds3d.trainer.config import JobConfig, build_job_config

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
DOCS = ROOT / "docs"

METRIC_RE = re.compile(r"\bds3d_[a-z0-9_]+")
EXPORT_SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def test_gpt10b_is_the_seed_cluster():
    cfg = build_job_config(str(OPS / "gpt10b.toml"))
    p, t, launch = cfg.parallel, cfg.train, cfg.launch
    assert cfg.name == "gpt10b" and cfg.preset == "gpt10b"
    assert (p.tp, p.pp, p.dp, p.zero_stage) == (4, 2, 2, 1)
    assert t.precision == "bf16"
    assert (launch.nnodes, launch.nproc_per_node, launch.device) == (2, 8, "cuda")
    assert launch.nnodes * launch.nproc_per_node == p.world_size == 16
    assert len(launch.hosts) == launch.nnodes
    assert 9.5e9 < cfg.model.n_params() < 10.5e9
    c = cfg.checkpoint
    assert c.store is not None and c.store.startswith("s3://")
    assert c.interval > 0 and c.keep_last >= 1
    assert c.keep_every % c.interval == 0  # milestones fall on saved steps


def test_gpt10b_would_be_accepted_by_the_daemon():
    """ds3dd validates again on receipt, with the multi-node hosts rule on top."""
    from ds3d.daemon.service import parse_config

    cfg = build_job_config(str(OPS / "gpt10b.toml"))
    assert parse_config(cfg.dump_json()).name == "gpt10b"


def test_tiny_cpu_is_a_small_3d_job_on_cpu():
    cfg = build_job_config(str(OPS / "tiny-cpu.toml"))
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp) == (2, 2, 1)
    assert cfg.launch.device == "cpu" and cfg.launch.nnodes == 1
    assert cfg.launch.nproc_per_node == p.world_size == 4
    assert cfg.train.precision == "fp32"
    assert cfg.model.n_params() < 1e6


def _unit() -> dict[str, list[str]]:
    """systemd unit keys -> values (a key may repeat); comments and sections dropped."""
    out: dict[str, list[str]] = {}
    for line in (OPS / "ds3dd.service").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _ds3dd_flags() -> set[str]:
    return {s for a in ds3dd_main.build_parser()._actions for s in a.option_strings}


def test_systemd_unit_keeps_training_alive_across_daemon_restarts():
    unit = _unit()
    assert unit["KillMode"] == ["process"]
    assert unit["Restart"] == ["always"]
    assert unit["User"] == ["ds3d"]
    assert unit["EnvironmentFile"] == ["/etc/ds3d/ds3dd.env"]
    assert "LimitNOFILE" in unit
    # systemd would delete these under agents that outlive the daemon
    assert "PrivateTmp" not in unit and "RuntimeDirectory" not in unit
    (exec_start,) = unit["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/bin/ds3dd")
    assert argv[argv.index("--state-dir") + 1] == "/var/lib/ds3d"


def test_systemd_waits_for_the_drain_before_it_kills():
    """SIGTERM drains (pauses every job, up to --drain-timeout); systemd's SIGKILL after
    TimeoutStopSec must not cut it short (it was 30 s against a 300 s drain)."""
    drain = ds3dd_main.build_parser().parse_args([]).drain_timeout
    (stop,) = _unit()["TimeoutStopSec"]
    assert float(stop) > drain


def test_systemd_unit_and_env_example_pass_only_real_ds3dd_flags():
    known = _ds3dd_flags()
    (exec_start,) = _unit()["ExecStart"]
    used = [a for a in shlex.split(exec_start) if a.startswith("--")]
    env = (OPS / "ds3dd.env.example").read_text()
    for m in re.finditer(r"^#?\s*DS3D_ARGS=(.*)$", env, re.MULTILINE):
        used += [a for a in shlex.split(m.group(1)) if a.startswith("--")]
    # the flags listed in comments
    used += re.findall(r"^#\s+(--[a-z][a-z-]*)\s", env, re.MULTILINE)
    assert used, "no flags found"
    assert set(used) <= known, f"not ds3dd flags: {sorted(set(used) - known)}"


def _code_metric_names() -> set[str]:
    text = (ROOT / "daemon" / "metrics.py").read_text()
    return set(re.findall(r"[\"'](ds3d_[a-z0-9_]+)[\"']", text))


def _base(name: str, known: set[str]) -> str:
    for suffix in EXPORT_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in known:
            return name[: -len(suffix)]
    return name


@pytest.mark.parametrize("doc", ["metrics.md", "runbook.md"])
def test_docs_name_only_metrics_the_daemon_exports(doc):
    known = _code_metric_names()
    assert len(known) >= 5, "metric names not found in daemon/metrics.py"
    mentioned = {_base(n, known) for n in METRIC_RE.findall((DOCS / doc).read_text())}
    assert mentioned <= known, f"{doc} names metrics that do not exist: {sorted(mentioned - known)}"


def test_metrics_doc_covers_every_metric():
    known = _code_metric_names()
    documented = set(METRIC_RE.findall((DOCS / "metrics.md").read_text()))
    assert known <= documented, f"undocumented metrics: {sorted(known - documented)}"


def _sections() -> dict[str, type]:
    out: dict[str, type] = {"": JobConfig}
    for name, field in JobConfig.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            out[name] = ann
    return out


def test_configuration_doc_covers_every_section_and_field():
    doc = (DOCS / "configuration.md").read_text()
    missing = []
    for section, model in _sections().items():
        if section and f"`[{section}]`" not in doc:
            missing.append(f"[{section}]")
        for name in model.model_fields:
            if section == "" and name in _sections():
                continue
            if f"| `{name}` |" not in doc:
                missing.append(f"{section or '(top)'}.{name}")
    assert not missing, f"docs/configuration.md lacks: {missing}"


def test_runbook_uses_only_real_ds3dctl_commands():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    commands = set(sub.choices)
    runbook = (DOCS / "runbook.md").read_text()
    used = set(re.findall(r"\bds3dctl (?:--addr \S+ )?([a-z][a-z-]*)\b", runbook))
    assert used, "no ds3dctl commands found"
    assert used <= commands, f"not ds3dctl commands: {sorted(used - commands)}"
