"""`cachettl bench router`: one row per replica count, figures from a real run, and bad
arguments named."""

from __future__ import annotations

import json
import re

import pytest

from controlplane.cli import main
from enginehook.tools.routerbench import format_rows, run_router_bench


def test_the_bench_prints_a_row_per_replica_count(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "router", "--replicas", "2,3", "--pins", "5", "--decisions", "6", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["replicas"], r["pins"]) for r in rows] == [(2, 10), (3, 15)]
    for r in rows:
        assert 0 < r["decide_ms"] <= r["decide_p90_ms"]
        assert 0 < r["copied_ms"] <= r["copied_p90_ms"]
        assert 0 < r["read_ms"] <= r["read_p90_ms"]
    table = format_rows(run_router_bench([2], pins_per_replica=5, decisions=4))
    assert table.splitlines()[2].startswith("| 2 | 10 | ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "4,x"], "--replicas: expected counts like 4,16,64, got '4,x'"),
        (["--replicas", "0"], r"--replicas: counts must be >= 1, got \[0\]"),
        (["--decisions", "1"], "--decisions >= 2"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "router", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
