"""Retention of the event log on the command line: ``serve``'s flags and ``db compact``.

``cachettl serve --log-retention AGE [--log-retention-rows N]`` compacts the log every
``--compact-interval`` (off unless set); ``cachettl db compact --older-than AGE`` does it
once, to the newest snapshot the servers stored, and ``--dry-run`` says what it would delete.
"""

from __future__ import annotations

import argparse
import re
import time
from datetime import UTC, datetime
from typing import Any

from controlplane.cli.database import add_db, db_url

__all__ = [
    "add_retention_flags",
    "horizon_from_args",
    "parse_age",
    "register_compact",
    "retention_options",
]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_age(text: str) -> float:
    """Seconds of ``text``: a number with an optional unit s, m, h or d.

    >>> parse_age("7d"), parse_age("90m"), parse_age("2.5")
    (604800.0, 5400.0, 2.5)
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is no age: a number with s, m, h or d")
    return float(found[1]) * _UNITS[found[2] or "s"]


def add_retention_flags(parser: argparse.ArgumentParser) -> None:
    """``serve``'s retention flags (off by default)."""
    parser.add_argument(
        "--log-retention",
        type=parse_age,
        default=None,
        metavar="AGE",
        help="compact the event log: delete rows received more than AGE ago (7d, 12h, 600s) "
        "once a stored snapshot covers them; set it longer than an engine holds unacknowledged "
        "events (default: off, the log is kept whole)",
    )
    parser.add_argument(
        "--log-retention-rows",
        type=int,
        default=None,
        metavar="N",
        help="also delete, once a snapshot covers them, a tenant's rows older than its "
        "newest N per log (default: off)",
    )
    parser.add_argument(
        "--compact-interval",
        type=parse_age,
        default=600.0,
        metavar="AGE",
        help="how often the log is compacted when a retention is set (default 600 s)",
    )


def horizon_from_args(args: argparse.Namespace) -> Any:
    """The ``Horizon`` of the retention flags, or None (retention off)."""
    from controlplane.storage.base import Horizon

    if args.log_retention is None and args.log_retention_rows is None:
        return None
    if not args.compact_interval > 0:
        raise ValueError("--compact-interval must be > 0")
    try:
        return Horizon(args.log_retention, args.log_retention_rows)
    except ValueError as error:
        raise ValueError(f"--log-retention, --log-retention-rows: {error}") from None


def retention_options(args: argparse.Namespace) -> dict[str, Any]:
    """``ServerOptions`` fields of the retention flags: ``retention`` (None: off) and
    ``compact_interval_s``."""
    return {"retention": horizon_from_args(args), "compact_interval_s": args.compact_interval}


def register_compact(db: Any) -> None:
    """``cachettl db compact``."""
    p = db.add_parser(
        "compact",
        help="delete event-log rows beyond a horizon that the newest stored snapshot covers",
    )
    add_db(p)
    p.add_argument(
        "--older-than",
        type=parse_age,
        default=None,
        metavar="AGE",
        help="delete rows received more than AGE ago (7d, 12h, 600s)",
    )
    p.add_argument(
        "--rows-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="delete a tenant's rows older than its newest N (per log)",
    )
    p.add_argument(
        "--policy",
        default="cachettl",
        help="the policy whose newest snapshot the servers restore from (default cachettl)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
    p.set_defaults(handler=_compact)


def _compact(args: argparse.Namespace) -> int:
    from controlplane.state import ModelState
    from controlplane.storage import create_store
    from controlplane.storage.base import Horizon

    if args.older_than is None and args.rows_per_tenant is None:
        raise ValueError("db compact: give --older-than AGE and/or --rows-per-tenant N")
    horizon = Horizon(args.older_than, args.rows_per_tenant)
    url = db_url(args)
    if url == "memory://":
        raise ValueError("--db: memory:// holds no log to compact")
    store = create_store(url)
    try:
        record = store.latest_snapshot(args.policy)
        if record is None:
            raise ValueError(
                f"no {args.policy} snapshot is stored: nothing can be compacted before "
                "`cachettl serve` has written one (every --snapshot-interval)"
            )
        try:
            ModelState.loads(record.payload)
        except Exception as error:
            raise ValueError(f"the newest {args.policy} snapshot cannot be read: {error}") from None
        done = store.compact_log(record, horizon, time.time(), args.dry_run)
    finally:
        store.close()
    print(_summary(done, args.dry_run))
    return 0


def _summary(done: Any, dry_run: bool) -> str:
    verb = "would delete" if dry_run else "deleted"
    cutoff = (
        f", received before {datetime.fromtimestamp(done.cutoff, UTC):%Y-%m-%d %H:%M:%S} UTC"
        if done.cutoff is not None
        else ""
    )
    per_tenant = f", beyond each tenant's newest {done.keep_rows}" if done.keep_rows else ""
    return (
        f"{verb} {done.tool_rows_deleted} tool calls and {done.end_rows_deleted} program ends "
        f"(covered by the snapshot at positions {done.tool_seq}/{done.end_seq}{cutoff}"
        f"{per_tenant}); the log {'would keep' if dry_run else 'keeps'} "
        f"{done.tool_rows_kept} tool calls and {done.end_rows_kept} program ends"
    )
