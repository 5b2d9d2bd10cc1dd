"""The ``--db`` option every `cachettl` command that opens the database shares."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = ["add_db", "db_url", "default_db_url"]


def default_db_url() -> str:
    """``$CACHETTL_DB``, else an SQLite file in the user's data directory."""
    env = os.environ.get("CACHETTL_DB")
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
        "(default: $CACHETTL_DB, else cachettl.sqlite3 in the user's data directory)",
    )


def db_url(args: argparse.Namespace) -> str:
    return str(args.db or default_db_url())
