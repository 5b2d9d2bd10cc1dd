"""``cachettl tools show`` as text: aligned tables a person reads (durations in ms or s,
the pins counted by outcome, a TTL per context), the cold start said in words, and no raw
Python structure printed. On the console's tenants, in a store of their own."""

from __future__ import annotations

import re

import pytest

from controlplane.__main__ import main
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from tests.console.conftest import LINT_CALLS, fill


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('toolview') / 'cachettl.sqlite3'}"
    store = create_store(url)
    fill(ControlPlane(store))
    store.close()
    return url


def _show(db: str, capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert main(["tools", "show", *argv, "--db", db]) == 0
    return capsys.readouterr().out.splitlines()


def _columns(lines: list[str], header: str) -> tuple[list[str], list[list[str]]]:
    """The header's column names and the rows below it (cells split on 2+ blanks)."""
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    rows = []
    for line in lines[at + 1 :]:
        if not line.startswith("  ") or not line.strip() or line.strip().startswith("cold"):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return re.split(r"\s{2,}", lines[at].strip()), rows


def test_tools_show_prints_tables_not_a_dict(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _show(db, capsys, "bash", "--tenant", "acme")
    text = "\n".join(lines)
    assert lines[0] == "tool bash (tenant acme)"
    for raw in ("{", "PinCounts", "hits="):  # once: pins: {'hits': 200, 'expired': ...}
        assert raw not in text
    names, pins = _columns(lines, "HITS")
    assert names == ["HITS", "EXPIRED", "RELEASED", "MOVED", "NOT PINNED", "HIT RATE"]
    assert pins == [["200", "100", "0", "0", "100", "66.7%"]]  # conftest: 1 in 4 expired
    names, decisions = _columns(lines, "CONTEXT TOKENS")
    assert names == ["CONTEXT TOKENS", "TTL", "F(TTL)", "BENEFIT", "BASIS"]
    assert [d[0] for d in decisions] == ["2,000", "8,000", "32,000", "128,000"]
    assert all(re.fullmatch(r"\d+ ms|\d+\.\d\d s", d[1]) for d in decisions), decisions
    assert {d[4] for d in decisions} == {"tool"}
    assert "cold start" not in text  # 400 samples: the tool decides
    # every line of a table is as long as its header's columns make it
    at = lines.index(next(line for line in lines if line.strip().startswith("p10")))
    assert len(lines[at]) == len(lines[at + 1])


def test_tools_show_says_when_a_tool_is_in_its_cold_start(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _show(db, capsys, "lint", "--tenant", "s0")
    _, decisions = _columns(lines, "CONTEXT TOKENS")
    assert {d[4] for d in decisions} == {"cold-start"}
    said = [line.strip() for line in lines if line.strip().startswith("cold start")]
    assert said == [
        f"cold start: {LINT_CALLS} of 101 samples; the TTL comes from the cold-start rule "
        "(durations ~ Exp(mean 1 s))"
    ]
