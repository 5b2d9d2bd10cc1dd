"""`cachettl bench controlplane --links N` at a tiny size: real `serve` processes (SQLite,
one server; PostgreSQL, two replicas), real gRPC links; the report's shape and convergence
on every link. The figures themselves are the benchmark's, not asserted here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from controlplane.cli import main
from controlplane.cli.linkreport import convergence
from tests.controlplane.conftest import PG_BASE

LINKS, SECONDS, RATE, FLUSH = 4, 2.0, 20.0, 0.25
BATCHES_PER_LINK = int(SECONDS / FLUSH)
BATCH = int(RATE * FLUSH)


def test_convergence_is_the_slowest_link_per_replica() -> None:
    records = [
        {"replica": "A", "acks": [(10.0, 5, 5, 0.01)], "snaps": [(9.0, 3, 1), (10.3, 5, 1)]},
        {"replica": "B", "acks": [(11.0, 9, 4, 0.01)], "snaps": [(10.8, 6, 1), (11.5, 9, 1)]},
        {"replica": "B", "acks": [], "snaps": [(10.1, 5, 1)]},
    ]
    lags, missing = convergence(records)
    assert lags["A->A"] == pytest.approx([0.3])
    assert lags["A->B"] == pytest.approx([0.8])  # the slower of B's two links (10.8, 10.1)
    assert lags["all"] == pytest.approx([0.8, 0.5])
    assert "B->A" not in lags  # A's link never streamed version 9
    assert lags["B->B"] == pytest.approx([0.5])
    assert missing == 2  # batch 9: A's link and the third link never streamed it


def _run(tmp_path: Path) -> dict[str, object]:
    out = tmp_path / "links"
    argv = ["bench", "controlplane", "--links", str(LINKS), "--seconds", str(SECONDS)]
    argv += ["--link-rate", str(RATE), "--flush", str(FLUSH), "--client-procs", "2"]
    argv += ["--setups", "sqlite:1,postgres:2", "--postgres", PG_BASE, "--out", str(out)]
    assert main(argv) == 0
    assert "| sqlite:1 | 4 |" in out.with_suffix(".md").read_text()
    report: dict[str, object] = json.loads(out.with_suffix(".json").read_text())
    return report


def test_links_bench_converges_on_every_link(tmp_path: Path) -> None:
    report = _run(tmp_path)
    setups = report["setups"]
    assert isinstance(setups, list)
    assert [s["setup"] for s in setups] == ["sqlite:1", "postgres:2"]
    pairs = {"sqlite:1": {"single->single"}, "postgres:2": {"A->A", "A->B", "B->A", "B->B"}}
    for s in setups:
        batches = LINKS * BATCHES_PER_LINK
        assert s["errors"] == {}
        assert s["stream_errors"] == []
        assert 0 < s["batches"] <= batches  # a link behind its schedule merges batches
        assert s["events_accepted"] == batches * BATCH
        assert s["arrivals_reported"] == batches * BATCH
        assert s["links_converged"] == LINKS
        assert s["convergence_missing"] == 0
        lags = s["convergence_lag_s"]
        assert set(lags) == pairs[s["setup"]] | {"all"}
        assert lags["all"]["n"] == s["batches"]
        for lag in lags.values():
            assert math.isfinite(lag["max"])
            assert -1.0 < lag["p50"] <= lag["max"] < 30.0
        assert len(s["server_cpu_s"]) == len(s["peak_rss_mib"]) == s["servers"]
        assert s["server_cpu_s_per_1000_events"] > 0
        assert all(rss > 0 for rss in s["peak_rss_mib"].values())
        assert set(s["rss_before_load_mib"]) == set(s["peak_rss_mib"])
        assert s["snapshots_streamed"] >= 2 * LINKS  # the seed's and at least one more
        assert s["snapshot_bytes_streamed"] > 0


def test_links_bench_refuses_an_unknown_setup(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "controlplane", "--links", "4", "--setups", "mysql:1"]
    assert main(argv) == 2
    assert "--setups: 'mysql:1'" in capsys.readouterr().err
