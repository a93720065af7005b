"""The monitoring files in ops/ work and stay true to the daemon: promtool accepts the alert
rules and the example Prometheus configuration, every alert fires on the example series of
tests/unit/promtool/ds3d-alerts-test.yml and nowhere else, and the rules and the Grafana dashboard
query only metrics that ds3d.daemon.metrics.Metrics really exports.

The promtool tests (marked `promtool`) skip, saying why, where promtool is not installed; under
CI=true that skip fails the run (tests/required_tiers.py; .ci/run installs promtool).
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ds3d.daemon.metrics import Metrics
from ds3d.daemon.states import JobState

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "ops" / "prometheus" / "ds3d-alerts.yml"
SCRAPE = ROOT / "ops" / "prometheus" / "scrape-example.yml"
DASHBOARD = ROOT / "ops" / "grafana" / "ds3d-dashboard.json"
RULE_TESTS = ROOT / "tests" / "unit" / "promtool" / "ds3d-alerts-test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"

PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                   "group_left", "group_right", "inf", "nan", "atan2"}
SCRAPE_METRICS = {"up"}  # made by Prometheus for each target, not by the exporter
NEVER_FIRES = "vector(1) == 0"


# ---------------------------------------------------------------------------------- helpers

def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus; .ci/run does)")
    return path


def _run_promtool(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def _exported_names() -> set[str]:
    """Every sample name the daemon's registry can expose: the names of samples present after a
    few updates, plus those that the type of each family implies (a labelled family has no
    samples until its first labels() call)."""
    m = Metrics()
    m.set_state("j", JobState.RUNNING)
    m.step.labels("j").set(3)
    m.restarts.labels("j", "hang").inc()
    m.checkpoint_blocked.labels("j").observe(1.5)
    m.rpcs.labels("/ds3d.v1.Control/GetJob").inc()
    suffixes = {"gauge": ("",), "counter": ("_total", "_created"),
                "histogram": ("_bucket", "_count", "_sum", "_created")}
    names: set[str] = set()
    for family in m.registry.collect():
        implied = {family.name + s for s in suffixes[family.type]}
        present = {s.name for s in family.samples}
        assert present <= implied, f"{family.name}: samples {present - implied} not implied"
        names |= implied | present
    return names


def _family(name: str, families: set[str]) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_created", "_total"):
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return name


def _families() -> set[str]:
    return {f.name for f in Metrics().registry.collect()}


def _metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers left once strings, label matchers,
    ranges, grouping clauses, functions, keywords and numbers are taken out."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'", '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])[A-Za-z_:][\w:]*", s):
        rest = s[match.end():].lstrip()
        if match.group() in PROMQL_KEYWORDS or rest.startswith("("):
            continue
        names.add(match.group())
    return names


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _runbook_anchors() -> set[str]:
    anchors, fenced = set(), False
    for line in RUNBOOK.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            anchors.add(_slug(m.group(1)))
        anchors |= set(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return anchors


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out += _panels(p.get("panels", []))  # a collapsed row holds its panels
    return out


def _dashboard_queries(d: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, annotation and query variable."""
    out = [(f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
           for p in _panels(d["panels"]) for t in p.get("targets", [])]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in d["annotations"]["list"]
            if "expr" in a]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            assert m, f"variable {v['name']}: not label_values(selector, label): {q}"
            out.append((f"variable {v['name']}", m.group(1)))
    return out


# ------------------------------------------------------------------------ the PromQL reader

def test_metric_names_reads_promql():
    expr = ('sum by (job) (rate(foo_total{job=~"$job", x="a{b}"}[5m] offset 1h)) / on (job) '
            'group_left quantile by (job) (0.5, bar) > 1e3 and baz_seconds_bucket unless up')
    assert _metric_names(expr) == {"foo_total", "bar", "baz_seconds_bucket", "up"}


def test_exported_names_are_the_registry_with_its_suffixes():
    names = _exported_names()
    assert {"ds3d_job_state", "ds3d_job_restarts_total", "ds3d_job_restarts_created",
            "ds3d_checkpoint_blocked_seconds_bucket", "ds3d_checkpoint_blocked_seconds_count",
            "ds3d_rpc_requests_total"} <= names
    assert "ds3d_job_restarts" not in names and "ds3d_checkpoint_blocked_seconds" not in names


# ------------------------------------------------------------------------------- promtool

@pytest.mark.promtool
def test_promtool_accepts_the_alert_rules():
    r = _run_promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


@pytest.mark.promtool
def test_promtool_accepts_the_scrape_example_and_finds_the_rules():
    r = _run_promtool("check", "config", SCRAPE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout, r.stdout


@pytest.mark.promtool
def test_every_alert_fires_on_its_example_series_and_nowhere_else():
    r = _run_promtool("test", "rules", RULE_TESTS)
    assert r.returncode == 0, r.stdout + r.stderr


def _rule_test_cases() -> list[dict]:
    return yaml.safe_load(RULE_TESTS.read_text())["tests"]


def _series_of(case: dict) -> set[tuple[str, str]]:
    """(instance, job) of each input series of a rule test case."""
    out = set()
    for s in case["input_series"]:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', s["series"]))
        out.add((labels.get("instance", ""), labels.get("job", "")))
    return out


def test_every_alert_has_a_case_that_fires_and_one_that_must_not():
    """Must not: a check that expects no alert at all, or no alert for some (instance, job) of
    its input series (promtool fails on any alert not listed)."""
    fires, silent = set(), set()
    for case in _rule_test_cases():
        for check in case.get("alert_rule_test", []):
            expected = {(a["exp_labels"].get("instance", ""), a["exp_labels"].get("job", ""))
                        for a in check.get("exp_alerts") or []}
            if expected:
                fires.add(check["alertname"])
            if _series_of(case) - expected:
                silent.add(check["alertname"])
    alerts = set(_alerts())
    assert alerts - fires == set(), "alerts never expected to fire"
    assert alerts - silent == set(), "alerts never expected to stay silent"
    assert fires | silent <= alerts, "tests name alerts that do not exist"


@pytest.mark.promtool
@pytest.mark.parametrize("alert", sorted(_alerts()))
def test_the_rule_tests_catch_an_alert_that_never_fires(alert, tmp_path):
    """The tests of one alert pass against that rule alone, and fail once its expression can
    never fire: so they test the rule, not something around it."""
    rule = _alerts()[alert]
    cases = []
    for case in _rule_test_cases():
        checks = [c for c in case.get("alert_rule_test", []) if c["alertname"] == alert]
        if checks:
            cases.append({**case, "alert_rule_test": checks})
    tests = yaml.safe_load(RULE_TESTS.read_text())

    def run(expr: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "rules.yml").write_text(yaml.safe_dump(
            {"groups": [{"name": "one", "rules": [{**rule, "expr": expr}]}]}))
        (tmp_path / "tests.yml").write_text(yaml.safe_dump(
            {**tests, "rule_files": ["rules.yml"], "tests": cases}))
        return _run_promtool("test", "rules", "tests.yml", cwd=tmp_path)

    as_is = run(rule["expr"])
    assert as_is.returncode == 0, as_is.stdout + as_is.stderr
    broken = run(NEVER_FIRES)
    assert broken.returncode != 0, f"{alert}: its tests pass with an expression that never fires"
    assert f"alertname: {alert}" in broken.stdout + broken.stderr


def _recording_rules_of_dashboard() -> str:
    rules = []
    for i, (_where, expr) in enumerate(_dashboard_queries(_dashboard())):
        expr = re.sub(r"\$__(?:rate_interval|range|interval)\b", "5m", expr)
        rules.append({"record": f"dashboard_query_{i}", "expr": expr})
    return yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})


@pytest.mark.promtool
def test_promtool_parses_every_dashboard_query(tmp_path):
    (tmp_path / "dashboard-queries.yml").write_text(_recording_rules_of_dashboard())
    r = _run_promtool("check", "rules", tmp_path / "dashboard-queries.yml")
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------ the rules

def test_alert_rules_use_only_metrics_the_daemon_exports():
    known = _exported_names()
    for rule in _rules():
        used = _metric_names(rule["expr"])
        assert used, f"{rule.get('alert')}: no metric found in {rule['expr']!r}"
        assert used <= known | SCRAPE_METRICS, f"{rule.get('alert')}: unknown {used - known}"
        text = " ".join(rule.get("annotations", {}).values())
        named = set(re.findall(r"\bds3d_[a-z0-9_]+", text))
        assert named <= known, f"{rule.get('alert')}: annotations name {named - known}"


def test_every_alert_has_severity_summary_description_and_an_existing_runbook_section():
    anchors = _runbook_anchors()
    assert {"hang", "crash-loop", "4-alerts-and-what-to-do"} <= anchors  # the reader works
    for name, rule in _alerts().items():
        assert name.startswith("Ds3d"), name
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["labels"].get("category"), name
        notes = rule["annotations"]
        assert notes.get("summary") and notes.get("description"), name
        path, _, anchor = notes["runbook"].partition("#")
        assert path == "docs/runbook.md", f"{name}: runbook {notes['runbook']}"
        assert anchor in anchors, f"{name}: docs/runbook.md has no section #{anchor}"


def test_scrape_example_keeps_ds3d_job_label_and_scrapes_the_default_port():
    cfg = yaml.safe_load(SCRAPE.read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "ds3dd"  # Ds3dDaemonDown: up{job="ds3dd"}
    assert 'up{job="ds3dd"}' in _alerts()["Ds3dDaemonDown"]["expr"]
    assert job["honor_labels"] is True  # else ds3d's job label becomes exported_job
    env = (ROOT / "ops" / "ds3dd.env.example").read_text()
    port = re.search(r"^DS3D_METRICS_PORT=(\d+)", env, re.MULTILINE).group(1)
    assert [t for sc in job["static_configs"] for t in sc["targets"]] == [f"127.0.0.1:{port}"]
    assert [(SCRAPE.parent / f).resolve() for f in cfg["rule_files"]] == [RULES.resolve()]


def test_metrics_doc_lists_every_alert_with_its_runbook_section():
    text = METRICS_DOC.read_text()
    section = text[text.index("## Dashboards and alerts"):]
    for name, rule in _alerts().items():
        anchor = rule["annotations"]["runbook"].partition("#")[2]
        row = next((line for line in section.splitlines() if line.startswith(f"| `{name}` |")),
                   None)
        assert row, f"docs/metrics.md 'Dashboards and alerts' lacks {name}"
        assert f"(runbook.md#{anchor})" in row, f"{name}: links another section than #{anchor}"
        assert rule["labels"]["severity"] in row, name


# -------------------------------------------------------------------------- the dashboard

def test_dashboard_is_an_importable_grafana_dashboard():
    d = _dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    assert d["title"] and d["uid"] and d.get("id") is None  # id is assigned at import
    ids = [p["id"] for p in _panels(d["panels"])]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    for p in _panels(d["panels"]):
        if p["type"] == "row":
            continue
        assert p["gridPos"]["w"] <= 24 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert p.get("targets"), f"panel {p['title']!r} has no query"


def test_dashboard_queries_go_to_the_datasource_variable_and_filter_by_job():
    d = _dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    job = variables["job"]
    assert "label_values(ds3d_job_step, job)" in json.dumps(job["query"])
    assert job["datasource"]["uid"] == "${datasource}"
    uses = [v.get("datasource") for v in variables.values() if v["type"] == "query"]
    for p in _panels(d["panels"]):
        if p["type"] != "row":
            uses += [p["datasource"]] + [t["datasource"] for t in p["targets"]]
    uses += [a["datasource"] for a in d["annotations"]["list"] if "expr" in a]
    assert uses and all(u == {"type": "prometheus", "uid": "${datasource}"} for u in uses), uses
    for where, expr in _dashboard_queries(d):
        if where.startswith("variable job"):
            continue
        for name, matchers in re.findall(r"(ds3d_[a-z0-9_]+)(\{[^}]*\})?", expr):
            if name != "ds3d_rpc_requests_total":  # per daemon: no job label
                assert 'job=~"$job"' in matchers, f"{where}: {name} not filtered by $job"


def test_dashboard_queries_use_only_metrics_the_daemon_exports():
    known = _exported_names()
    for where, expr in _dashboard_queries(_dashboard()):
        used = _metric_names(expr)
        assert used, f"{where}: no metric in {expr!r}"
        assert used <= known, f"{where}: not exported by ds3dd: {sorted(used - known)}"


def test_dashboard_shows_every_metric():
    families = _families()
    shown = {_family(n, families) for _w, e in _dashboard_queries(_dashboard())
             for n in _metric_names(e)}
    assert families <= shown, f"no panel for {sorted(families - shown)}"


@pytest.mark.promtool
def test_dashboard_job_state_query_yields_the_number_its_mapping_names(tmp_path):
    """The state panels turn the one-per-state gauges into the JobState number of the job's
    state, and map the numbers back to the names."""
    state_panels = [p for p in _panels(_dashboard()["panels"])
                    if p["title"] in {"Job state", "Job state over time"}]
    assert len(state_panels) == 2
    for panel in state_panels:
        (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
        assert {int(k): v["text"] for k, v in mapping["options"].items()} == {
            s.value: s.name for s in JobState}
    exprs = {p["targets"][0]["expr"] for p in state_panels}
    assert len(exprs) == 1
    series = [{"series": f'ds3d_job_state{{instance="n1", job="{job}", state="{s.name}"}}',
               "values": "1" if s is state else "0"}
              for job, state in (("j1", JobState.RECOVERING), ("j2", JobState.FAILED))
              for s in JobState]
    (tmp_path / "none.yml").write_text("groups: []\n")
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": ["none.yml"], "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": exprs.pop().replace("$job", ".*"), "eval_time": "0m",
                              "exp_samples": [
                                  {"labels": '{job="j1"}', "value": JobState.RECOVERING.value},
                                  {"labels": '{job="j2"}', "value": JobState.FAILED.value}]}]}]}))
    r = _run_promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
