"""A real Prometheus scraping a running cluster, for the check of the dashboard and the
recording rules (the last test of ``tests/enginehook/test_cluster_real.py``).

- :class:`Prometheus`: Debian's ``/usr/bin/prometheus`` on a free port with its own data
  folder, scraping every second and evaluating ``deploy/prometheus/cachettl-rules.yml``;
- :func:`observed_replica`: one more control-plane replica that serves ``/metrics``;
- :func:`queries`: every dashboard query and recording rule, the variables substituted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from enginehook.tools.servers import ControlPlaneProcess, free_port, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "cachettl-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "cachettl.json"
#: Grafana's variables in the queries asked: "All" of each, and a rate window of the scrapes.
VARIABLES = {"$tenant": ".*", "$engine": ".*", "$control_plane": ".*", "$__rate_interval": "1m"}


@dataclass
class Prometheus:
    """A Prometheus server's HTTP API."""

    url: str

    def get(self, path: str, **params: str) -> Any:
        """The ``data`` of an API answer; an error answer raises naming the request."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read().decode())["data"]
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{path} {params}: {error.read().decode()[:500]}") from None

    def query(self, expr: str) -> list[Any]:
        """The samples of an instant query now."""
        return list(self.get("/api/v1/query", query=expr)["result"])


@contextmanager
def prometheus(work: Path, targets: dict[str, list[str]], tenant: str) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (hosts by job) every second, with the rules; the
    ``engine`` job's targets carry the ``tenant`` label an operator sets there."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": job,
                "static_configs": [
                    {"targets": hosts, "labels": {"tenant": tenant} if job == "engine" else {}}
                ],
            }
            for job, hosts in targets.items()
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    args = ["/usr/bin/prometheus", f"--config.file={work / 'prometheus.yml'}"]
    args += [f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
    log = work / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/-/ready", proc, log), 60, "prometheus")
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        stop_process(proc, 10)


@contextmanager
def observed_replica(db: str, work: Path) -> Iterator[tuple[int, int]]:
    """``(gRPC port, metrics port)`` of one more control-plane replica on ``db`` serving
    ``/metrics``, with retention on (so compaction's gauges exist; a 1-hour horizon deletes
    nothing in a test) and the policy settings of :class:`ControlPlaneProcess`, so its
    snapshots agree with the other replicas'."""
    port, metrics = free_port(), free_port()
    args = [str(Path(sys.executable).parent / "cachettl"), "serve", "--db", db]
    args += ["--listen", f"127.0.0.1:{port}", "--metrics", f"127.0.0.1:{metrics}"]
    args += ["--policy", ControlPlaneProcess.policy]
    args += ["--min-samples", str(ControlPlaneProcess.min_samples), "--snapshot-interval", "1"]
    args += ["--log-retention", "1h", "--compact-interval", "2"]
    log = work / "cp-observed.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{metrics}/metrics"
        wait_for(lambda: _answers(url, proc, log), 60, "the observed replica")
        yield port, metrics
    finally:
        stop_process(proc, 30)


def _answers(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    """Whether ``url`` answers; ``RuntimeError`` with the log's tail if ``proc`` died."""
    if proc.poll() is not None:
        raise RuntimeError(f"{proc.args!r} exited {proc.returncode}: {log.read_text()[-2000:]}")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def rule_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULES.read_text())["groups"])


def queries(not_checked: dict[str, str]) -> dict[str, str]:
    """Every dashboard query (``panel 'title' refId``) but those in ``not_checked``, and
    every recording rule's expression (``rule name``), with the variables substituted."""
    board = json.loads(DASHBOARD.read_text())
    found = {}
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            found[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    unknown = sorted(set(not_checked) - set(found))
    assert unknown == [], f"exclusions that name no dashboard query: {unknown}"
    for group in rule_groups():
        for rule in group["rules"]:
            if "record" in rule:
                found[f"rule {rule['record']}"] = rule["expr"]
    for name, value in VARIABLES.items():
        found = {key: expr.replace(name, value) for key, expr in found.items()}
    return {key: expr for key, expr in found.items() if key not in not_checked}


def variable_values(prom: Prometheus) -> dict[str, list[str]]:
    """What each of the dashboard's ``label_values(selector, label)`` variables lists."""
    board = json.loads(DASHBOARD.read_text())
    values = {}
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        selector, label = variable["definition"][len("label_values(") : -1].rsplit(", ", 1)
        for name, value in VARIABLES.items():
            selector = selector.replace(name, value)
        values[variable["name"]] = prom.get(
            f"/api/v1/label/{label}/values", **{"match[]": selector}
        )
    return values
