"""``cachettl db upgrade`` and ``cachettl serve`` on a PostgreSQL database that does not exist
(the real server at 127.0.0.1:5432): one line that names the command creating it, a non-zero
exit; the ``createdb`` command the line names, run as written, makes ``db upgrade`` pass."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from controlplane.storage.schema import HEAD_REVISION


@pytest.fixture
def missing() -> Iterator[tuple[str, str]]:
    """(a database name nobody created, its URL); dropped at the end if a test created it."""
    name = f"cachettl_missing_{uuid.uuid4().hex[:10]}"
    yield name, f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    dropdb = ["dropdb", "--if-exists", "-h", "127.0.0.1", "-U", "postgres", name]
    subprocess.run(dropdb, check=True, capture_output=True, timeout=60)


def _cachettl(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "controlplane", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_db_upgrade_on_a_missing_database_says_to_create_it(missing: tuple[str, str]) -> None:
    name, url = missing
    done = _cachettl("db", "upgrade", "--db", url)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    assert f"PostgreSQL database {name!r} does not exist on 127.0.0.1:5432" in done.stderr
    assert f"CREATE DATABASE {name};" in done.stderr
    createdb = re.search(r"\((createdb [^,]+),", done.stderr)
    assert createdb is not None, done.stderr
    assert createdb.group(1) == f"createdb -h 127.0.0.1 -p 5432 -U postgres {name}"
    subprocess.run(shlex.split(createdb.group(1)), check=True, capture_output=True, timeout=60)
    upgraded = _cachettl("db", "upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.strip() == f"schema empty -> {HEAD_REVISION}"


def test_serve_on_a_missing_database_says_to_create_it(missing: tuple[str, str]) -> None:
    name, url = missing
    done = _cachettl("serve", "--db", url, "--listen", "127.0.0.1:0")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"CREATE DATABASE {name};" in done.stderr


def test_an_unreachable_server_is_one_line_too() -> None:
    done = _cachettl("db", "upgrade", "--db", "postgresql+psycopg://postgres@127.0.0.1:1/none")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("cachettl: error: --db: cannot open the database: ")
