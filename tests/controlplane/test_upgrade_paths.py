"""Every earlier schema revision upgrades to the head with its rows, on SQLite and PostgreSQL.

For each revision before the head, a database is taken to that revision, filled there with
what that revision's tables hold (a tenant, tool calls with the columns the revision has,
program ends, and where the revision has them an unreadable stored snapshot and a program's
location), and upgraded to the head. A server on it then replays the log into the models the
rows imply; it learns more, live; and a second server started on the same database (a
replay of the whole log) holds models equal to the live ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, create_engine, insert

from controlplane.records import ProgramEnd, ToolCall
from controlplane.service import ControlPlane
from controlplane.state import differences
from controlplane.storage.migrate import upgrade
from controlplane.storage.schema import HEAD_REVISION
from controlplane.storage.sql import SqlStore

ROOT = Path(__file__).resolve().parents[2]
EARLIER = sorted(
    p.name[:4]
    for p in (ROOT / "migrations" / "versions").glob("0*.py")
    if p.name[:4] < HEAD_REVISION
)
SECONDS = {"bash": [0.5, 1.5, 2.5, 3.5, 4.5, 5.5], "grep": [0.1, 0.2, 0.3]}


def _tool_rows() -> list[dict[str, Any]]:
    rows = []
    for tool, durations in SECONDS.items():
        for i, duration in enumerate(durations):
            rows.append(
                {
                    "tenant_id": 1,
                    "event_id": f"{tool}-{i}",
                    "program_id": f"p{i % 3}",
                    "tool_name": tool,
                    "tool_args": "pytest -x" if tool == "bash" else "-r x",
                    "duration_s": duration,
                    "finished_at": 100.0 + i,
                    "turn_index": i,
                    "shared": False,
                    "received_at": 100.0 + i,
                    "chosen_ttl_s": 2.0,  # the columns of later revisions, where present
                    "pin_outcome": 1,
                    "admission_delay_s": 0.05,
                    "miss_reason": 0,
                    "not_pinned_cause": 0,
                }
            )
    return rows


def _fill(url: str, revision: str) -> None:
    """The rows of ``revision``'s tables (reflected: only the columns it has)."""
    engine = create_engine(url)
    tables = MetaData()
    tables.reflect(engine)

    def fit(table: str, values: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in values.items() if k in tables.tables[table].c}

    with engine.begin() as c:
        tenant = {"id": 1, "name": "acme", "token_hash": "h" * 64, "share": False}
        c.execute(insert(tables.tables["tenants"]), fit("tenants", {**tenant, "created_at": 0.0}))
        c.execute(
            insert(tables.tables["tool_events"]), [fit("tool_events", r) for r in _tool_rows()]
        )
        ends = [("p0", 6, 200.0), ("p1", 4, None)]
        c.execute(
            insert(tables.tables["program_ends"]),
            [
                {
                    "tenant_id": 1,
                    "program_id": p,
                    "total_turns": n,
                    "finished_at": f,
                    "received_at": 1.0,
                }
                for p, n, f in ends
            ],
        )
        if "snapshots" in tables.tables:  # a snapshot no server can read: the log is replayed
            snapshot = {"policy": "cachettl", "tool_seq": 9, "end_seq": 2, "created_at": 1.0}
            c.execute(insert(tables.tables["snapshots"]), {**snapshot, "payload": b"old"})
        if "program_locations" in tables.tables:
            location = {"tenant_id": 1, "program_id": "p0", "engine_id": "e1"}
            c.execute(
                insert(tables.tables["program_locations"]),
                {**location, "arrived_at": 1.0, "seen_at": 1.0},
            )
    engine.dispose()


@pytest.mark.parametrize("revision", EARLIER)
@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_a_populated_database_upgrades_from_every_revision(db_url: str, revision: str) -> None:
    engine = create_engine(db_url)
    assert upgrade(engine, revision) == (None, revision)
    _fill(db_url, revision)
    assert upgrade(engine) == (revision, HEAD_REVISION)
    engine.dispose()
    store = SqlStore(db_url)
    again = None
    try:
        plane = ControlPlane(store, min_samples=1)
        counts = {t.tool: t.sample_count for t in plane.list_tools("acme")}
        assert counts == {tool: len(d) for tool, d in SECONDS.items()}
        assert plane.workload_stats("acme").programs_completed == 2
        (tenant,) = store.list_tenants()
        live = [ToolCall(f"new-{i}", "p9", "bash", "make", 1.0 + i) for i in range(5)]
        assert plane.record_tool_calls(tenant, live) is not None
        assert plane.record_program_end(tenant, ProgramEnd("p9", 5, 300.0)) is not None
        plane.catch_up()
        again = SqlStore(db_url)
        replayed = ControlPlane(again, min_samples=1)
        assert differences(plane.state, replayed.state) == []
        assert replayed.workload_stats("acme").programs_completed == 3
    finally:
        store.close()
        if again is not None:
            again.close()
