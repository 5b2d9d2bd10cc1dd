"""Schema revisions: refusal on an old schema, and upgrade of a stored first-revision file.

``data/schema-0001.sqlite3`` was written once by the first revision (0001) with one tenant
(token ``rev1-token``), five ``bash`` calls (0.5 … 4.5 s) and one program end; it is never
regenerated.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from controlplane.__main__ import main
from controlplane.errors import SchemaOutOfDateError
from controlplane.migrate import current_revision, upgrade
from controlplane.schema import HEAD_REVISION
from controlplane.service import ControlPlane
from controlplane.sql_store import SqlStore, make_engine

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
