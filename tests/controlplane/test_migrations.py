"""Schema revisions: refusal on an old schema, upgrade of a stored first-revision file, and
revision 0005 (one program end per run) upgrading and downgrading databases that hold ends.

``data/schema-0001.sqlite3`` was written once by the first revision (0001) with one tenant
(token ``rev1-token``), five ``bash`` calls (0.5 … 4.5 s) and one program end (``p1``, 6
turns, no finish time); it is never regenerated.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from controlplane.__main__ import main
from controlplane.errors import SchemaOutOfDateError
from controlplane.records import ProgramEnd
from controlplane.service import ControlPlane
from controlplane.storage.migrate import current_revision, downgrade, upgrade
from controlplane.storage.schema import HEAD_REVISION
from controlplane.storage.sql import SqlStore, make_engine

from .conftest import pg_url

STORED = Path(__file__).parent / "data" / "schema-0001.sqlite3"


def test_stored_first_revision_is_refused_then_upgraded(tmp_path: Path, capsys) -> None:
    path = tmp_path / "old.sqlite3"
    shutil.copy(STORED, path)
    url = f"sqlite:///{path}"
    with pytest.raises(SchemaOutOfDateError, match="cachettl db upgrade --db"):
        SqlStore(url)
    assert main(["db", "upgrade", "--db", url]) == 0
    assert f"0001 -> {HEAD_REVISION}" in capsys.readouterr().out
    store = SqlStore(url)
    rows = store.read_tool_calls(0, 10)
    assert [r.call.duration_s for r in rows] == [0.5, 1.5, 2.5, 3.5, 4.5]
    assert {r.call.pin_outcome for r in rows} == {0}  # the new column's default
    plane = ControlPlane(store, min_samples=1)
    tenant = plane.authenticate("rev1-token")
    assert tenant is not None
    assert tenant.name == "acme"
    assert plane.workload_stats("acme").programs_completed == 1
    assert [t.sample_count for t in plane.list_tools("acme")] == [5]
    store.close()


def test_empty_database_is_initialised(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'new.sqlite3'}")
    SqlStore(str(engine.url)).close()
    assert current_revision(engine) == HEAD_REVISION
    with engine.connect() as c:
        assert c.execute(text("PRAGMA journal_mode")).scalar() == "wal"


def test_postgres_old_schema_is_refused_then_upgraded(pg_schemas) -> None:
    url = pg_url(pg_schemas())
    engine = create_engine(url)
    upgrade(engine, "0001")
    with pytest.raises(
        SchemaOutOfDateError, match=f"revision 0001, this version needs {HEAD_REVISION}"
    ):
        SqlStore(url)
    assert upgrade(engine) == ("0001", HEAD_REVISION)
    SqlStore(url).close()
    engine.dispose()


SQL_BACKENDS = ["sqlite", "postgres"]
_TENANT = (
    "INSERT INTO tenants (id, name, token_hash, share, created_at)"
    " VALUES (1, 'acme', 'h', false, 0)"
)
_END = (
    "INSERT INTO program_ends (tenant_id, program_id, total_turns, finished_at, received_at)"
    " VALUES (1, :program, :turns, :finished, 0)"
)


def _ends(store: SqlStore) -> list[tuple[int, ProgramEnd]]:
    return [(r.seq, r.end) for r in store.read_program_ends(0, 100)]


def test_stored_first_revision_keeps_its_program_end_and_learns_a_rerun(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    shutil.copy(STORED, path)
    url = f"sqlite:///{path}"
    assert upgrade(make_engine(url)) == ("0001", HEAD_REVISION)
    store = SqlStore(url)
    try:
        assert _ends(store) == [(1, ProgramEnd("p1", 6, None))]
        plane = ControlPlane(store, min_samples=1)
        tenant = plane.authenticate("rev1-token")
        assert tenant is not None
        assert plane.record_program_end(tenant, ProgramEnd("p1", 6)) is None  # a resend
        assert plane.record_program_end(tenant, ProgramEnd("p1", 8, 50.0)) == 2  # a rerun
        assert plane.workload_stats("acme").programs_completed == 2
    finally:
        store.close()


@pytest.mark.parametrize("db_url", SQL_BACKENDS, indirect=True)
def test_revision_0005_upgrades_a_database_holding_program_ends(db_url: str) -> None:
    engine = create_engine(db_url)
    assert upgrade(engine, "0001") == (None, "0001")
    with engine.begin() as c:
        c.execute(text(_TENANT))
        for program, turns, finished in [("a", 3, 10.0), ("gone", 1, None), ("b", 5, None)]:
            c.execute(text(_END), {"program": program, "turns": turns, "finished": finished})
        c.execute(text("DELETE FROM program_ends WHERE program_id = 'gone'"))  # a gap: 1, 3
    assert upgrade(engine) == ("0001", HEAD_REVISION)
    engine.dispose()
    store = SqlStore(db_url)
    try:
        kept = [(1, ProgramEnd("a", 3, 10.0)), (3, ProgramEnd("b", 5, None))]
        assert _ends(store) == kept  # rows and positions as they were
        tenant = store.list_tenants()[0]
        assert store.append_program_end(tenant, ProgramEnd("a", 3, 10.0)) is None
        assert store.append_program_end(tenant, ProgramEnd("b", 5)) is None
        assert store.append_program_end(tenant, ProgramEnd("a", 7, 99.0)) == 4
        assert store.append_program_end(tenant, ProgramEnd("b", 2, 99.0)) == 5
        plane = ControlPlane(store)
        assert plane.workload_stats("acme").programs_completed == 4
    finally:
        store.close()


@pytest.mark.parametrize("db_url", SQL_BACKENDS, indirect=True)
def test_revision_0005_downgrade_refuses_while_a_program_has_two_ends(db_url: str) -> None:
    store = SqlStore(db_url)  # initialised at the head revision
    tenant = store.create_tenant("acme", False, "h", 0.0)
    for end in (ProgramEnd("p1", 3, 10.0), ProgramEnd("p1", 5, 20.0), ProgramEnd("p2", 4)):
        assert store.append_program_end(tenant, end) is not None
    before = _ends(store)
    with pytest.raises(RuntimeError, match=r"1 \(tenant, program id\) pairs .* nothing was"):
        downgrade(store.engine, "0004")
    assert current_revision(store.engine) == HEAD_REVISION
    assert _ends(store) == before
    with store.engine.begin() as c:
        c.execute(text("DELETE FROM program_ends WHERE finished_at = 20.0"))
    assert downgrade(store.engine, "0004") == (HEAD_REVISION, "0004")
    with pytest.raises(IntegrityError), store.engine.begin() as c:  # one end per program again
        c.execute(text(_END), {"program": "p1", "turns": 2, "finished": 30.0})
    assert _ends(store) == [before[0], before[2]]
    assert upgrade(store.engine) == ("0004", HEAD_REVISION)
    assert store.append_program_end(tenant, ProgramEnd("p1", 5, 20.0)) is not None
    store.close()
