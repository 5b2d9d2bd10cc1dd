"""Fixtures: real stores (memory, SQLite file, PostgreSQL schema) and in-process servers."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import create_engine, text

from controlplane.rpc.server import ControlPlaneServer, ServerOptions
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store

T = TypeVar("T")
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


class ServerThread:
    """A real aio server on port 0, running in its own thread and event loop."""

    def __init__(self, plane: ControlPlane, options: ServerOptions) -> None:
        self.server = ControlPlaneServer(plane, options)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self.run(self.server.start())
        self.target = f"127.0.0.1:{self.port}"

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def stop(self) -> None:
        self.run(self.server.stop(grace_s=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@contextmanager
def running(plane: ControlPlane, **options: object) -> Iterator[ServerThread]:
    opts = ServerOptions(listen="127.0.0.1:0", **options)  # type: ignore[arg-type]
    thread = ServerThread(plane, opts)
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture
def serve() -> Callable[..., object]:
    """``serve(plane, **options)``: a context manager running a server for ``plane``."""
    return running
