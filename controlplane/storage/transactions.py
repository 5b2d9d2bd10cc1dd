"""The one transaction helper of the SQL store (and its autocommit sibling): commits, rolls
back on error, closes, and turns driver errors into the control plane's exceptions.

Writers commit in ``seq`` order: on SQLite a write transaction starts with ``BEGIN
IMMEDIATE`` (``make_engine`` in :mod:`controlplane.storage.sql` issues it for connections
marked ``cachettl_write``); on PostgreSQL it first takes the log's advisory lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.exc import DataError, SQLAlchemyError

from controlplane.errors import InvalidInputError, StorageError, clip

__all__ = ["LOG_LOCK", "autocommit", "transaction", "translated"]

#: Key of the PostgreSQL advisory lock that orders log writers.
LOG_LOCK = 0x0CAC4E77


@contextmanager
def transaction(engine: Engine, write: bool = False) -> Iterator[Connection]:
    """One transaction: commits on success, rolls back on error, always closes.

    Driver errors come out as ``StorageError``, except a value the database cannot hold
    (out of range, too long, ...): that is the request's fault, never worth a retry, and
    comes out as ``InvalidInputError``. The body's own exceptions pass through. On
    PostgreSQL a write transaction first takes the log's advisory lock.
    """
    with translated(), engine.connect() as connection:
        if write:
            connection.execution_options(cachettl_write=True)
        with connection.begin():
            if write and engine.dialect.name == "postgresql":
                connection.execute(select(func.pg_advisory_xact_lock(LOG_LOCK)))
            yield connection


@contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    """A connection whose every statement is a transaction of its own (PostgreSQL's
    autocommit; committed, durably, when the statement returns), errors translated as
    by ``transaction``."""
    with translated(), engine.connect() as connection:
        yield connection.execution_options(isolation_level="AUTOCOMMIT")


@contextmanager
def translated() -> Iterator[None]:
    """Driver errors as ``transaction`` documents them."""
    try:
        yield
    except (DataError, OverflowError) as error:  # OverflowError: sqlite3 and huge ints
        original = getattr(error, "orig", None) or error
        message = clip(f"holds a value the database cannot store: {original}")
        raise InvalidInputError("request", message) from error
    except SQLAlchemyError as error:
        original = getattr(error, "orig", None)
        raise StorageError(clip(f"database error: {original or error}")) from error
