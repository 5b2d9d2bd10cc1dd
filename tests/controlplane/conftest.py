"""Fixtures: real stores (memory, SQLite file, PostgreSQL schema) and in-process servers
(:mod:`tests.support`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from controlplane.storage import Store, create_store
from tests.support import running

PG_BASE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def pg_url(schema: str) -> str:
    return f"{PG_BASE}?options=-csearch_path%3D{schema}"


@pytest.fixture(scope="session")
def pg_schemas() -> Iterator[Callable[[], str]]:
    """Creates uniquely named schemas in database ``test``; drops them all at the end."""
    engine = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    created: list[str] = []

    def new_schema() -> str:
        name = f"cp_{uuid.uuid4().hex[:12]}"
        with engine.connect() as c:
            c.execute(text(f"CREATE SCHEMA {name}"))
        created.append(name)
        return name

    yield new_schema
    with engine.connect() as c:
        for name in created:
            c.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
    engine.dispose()


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path, pg_schemas: Callable[[], str]) -> str:
    """A fresh database URL of the backend named by the test's ``backend`` parameter."""
    backend = getattr(request, "param", "sqlite")
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'cachettl.sqlite3'}"
    return pg_url(pg_schemas())


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = create_store(db_url)
    yield s
    s.close()


@pytest.fixture
def serve() -> Callable[..., object]:
    """``serve(plane, **options)``: a context manager running a server for ``plane``."""
    return running
