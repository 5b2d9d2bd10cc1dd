"""The Prometheus rules and the Grafana dashboard under ``deploy/``.

- ``promtool check rules`` accepts the rules and ``promtool test rules`` passes their unit
  tests (Debian's ``prometheus`` package, which scripts/setup installs);
- every alert is tested both firing and not firing, and carries a summary, a description
  and a ``runbook_url`` pointing at a section of docs/operations.md that exists;
- the committed dashboard is ``deploy/grafana/dashboard.py``'s output, every panel queries
  the templated data source, and the variables it uses are defined.

That every panel's query and every recording rule returns data from a real scrape of a
cluster is checked by the last test of ``tests/enginehook/test_cluster_real.py``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "cachettl-rules.yml"
RULE_TESTS = sorted((ROOT / "deploy" / "prometheus" / "tests").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "cachettl.json"
OPERATIONS = ROOT / "docs" / "operations.md"
PROMTOOL = "/usr/bin/promtool"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not Path(PROMTOOL).exists():
        pytest.fail(f"{PROMTOOL} is missing: scripts/setup installs Debian's prometheus package")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


def test_promtool_accepts_the_rules() -> None:
    done = _promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_the_rules_unit_tests_pass() -> None:
    assert RULE_TESTS, "no unit tests under deploy/prometheus/tests"
    done = _promtool("test", "rules", *map(str, RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_not() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = set(_alerts())
    assert len(alerts) >= 20
    assert sorted(alerts - firing) == [], "alerts never tested firing"
    assert sorted(alerts - quiet) == [], "alerts never tested quiet"
    assert sorted((firing | quiet) - alerts) == [], "tests of alerts that do not exist"


def test_every_alert_says_what_and_where_to_read() -> None:
    from tests.docs.pages import anchors as github_anchors

    anchors = github_anchors(OPERATIONS)
    for name, rule in _alerts().items():
        notes = rule.get("annotations", {})
        assert {"summary", "description", "runbook_url"} <= set(notes), name
        assert rule.get("labels", {}).get("severity") in {"info", "warning", "critical"}, name
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/operations.md", (name, page)
        assert anchor in anchors, f"{name}: docs/operations.md has no section #{anchor}"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard", DASHBOARD.with_name("dashboard.py"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_dashboard_is_the_generators_output() -> None:
    assert DASHBOARD.read_text() == _generator().render(), (
        "deploy/grafana/cachettl.json is stale: run python deploy/grafana/dashboard.py"
    )


def test_every_panel_queries_the_templated_data_source() -> None:
    board = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "tenant", "engine", "control_plane"} <= names
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for query in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", query["expr"])) - {"__rate_interval"}
            assert used <= names, (panel["title"], used - names)
