"""The ``--db`` option every `cachettl` command that opens the database shares, and the one
line a command prints when the database cannot be opened."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

__all__ = ["DB_ENV", "add_db", "db_url", "default_db_url", "open_error", "require_connection"]

#: Environment variable holding the database URL when ``--db`` is not given.
DB_ENV = "CACHETTL_DB"

_MISSING = re.compile(r'database "([^"]+)" does not exist')


def default_db_url() -> str:
    """``$CACHETTL_DB``, else an SQLite file in the user's data directory."""
    env = os.environ.get(DB_ENV)
    if env:
        return env
    from platformdirs import user_data_dir

    return f"sqlite:///{Path(user_data_dir('cachettl')) / 'cachettl.sqlite3'}"


def add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=None,
        metavar="URL",
        help="sqlite:///PATH, postgresql://USER@HOST:PORT/DB or memory:// "
        f"(default: ${DB_ENV}, else cachettl.sqlite3 in the user's data directory)",
    )


def db_url(args: argparse.Namespace) -> str:
    return str(args.db or default_db_url())


def open_error(url: str, error: BaseException) -> ValueError:
    """One line for a database that cannot be opened; a PostgreSQL database that does not
    exist names the commands that create it. The URL's password is never shown.

    >>> url = "postgresql+psycopg://cachettl:secret@db:5432/cachettl"
    >>> print(open_error(url, OSError('FATAL:  database "cachettl" does not exist')))
    --db: PostgreSQL database 'cachettl' does not exist on db:5432; create it first
    (createdb -h db -p 5432 -U cachettl cachettl, or in psql: CREATE DATABASE cachettl;),
    then run: cachettl db upgrade
    >>> print(open_error(url, OSError("connection refused\\n\\tIs the server running?")))
    --db: cannot open the database: connection refused
    """
    cause = error
    while cause.__cause__ is not None and "does not exist" not in str(cause):
        cause = cause.__cause__
    text = str(getattr(cause, "orig", None) or cause).strip()
    missing = _MISSING.search(text)
    if missing:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        host, port = parsed.host or "localhost", parsed.port or 5432
        user = f" -U {parsed.username}" if parsed.username else ""
        name = missing.group(1)
        return ValueError(
            f"--db: PostgreSQL database {name!r} does not exist on {host}:{port}; create it "
            f"first (createdb -h {host} -p {port}{user} {name}, or in psql: CREATE DATABASE "
            f"{name};), then run: cachettl db upgrade"
        )
    first = text.splitlines()[0] if text else type(cause).__name__
    return ValueError(f"--db: cannot open the database: {first}")


def require_connection(engine: object, url: str) -> None:
    """Connect once; a failure is :func:`open_error`'s one line (a ``ValueError``)."""
    from sqlalchemy import Engine
    from sqlalchemy.exc import SQLAlchemyError

    assert isinstance(engine, Engine)
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as error:
        raise open_error(url, error) from None
