"""The console's command-line parts: ``serve --console`` flags and ``bench console``.

Light on purpose (no web imports): ``cachettl --help`` must not need the ``console`` extra.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["add_console_flags", "console_options", "register_console_bench"]

#: Environment variable that may hold the console's admin token (else a file, or none).
ADMIN_TOKEN_ENV = "CACHETTL_CONSOLE_ADMIN_TOKEN"


def add_console_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--console",
        default=None,
        metavar="HOST:PORT",
        help="also serve the read-only web console there (the console extra); HTTPS "
        "with --tls-cert/--tls-key",
    )
    parser.add_argument(
        "--console-admin-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="file holding the console's admin token, which shows every tenant (default: "
        f"${ADMIN_TOKEN_ENV}, else no admin)",
    )
    for flag, what in (
        ("--console-max-connections", "connections at most (1/8 of RLIMIT_NOFILE, <= 1024)"),
        ("--console-max-connections-per-source", "connections per client address (cap / 8)"),
        ("--console-sessions-per-tenant", "sessions per tenant; its oldest end first (64)"),
        ("--console-logins-per-minute", "logins per tenant per minute, burst as many (30)"),
        ("--console-failed-logins-per-minute", "failed logins per address per minute (10)"),
        ("--console-accepts-per-second", "new connections accepted a second (64)"),
    ):
        parser.add_argument(flag, type=int, default=None, metavar="N", help=what)


def console_options(args: argparse.Namespace) -> Any:
    """The ``ConsoleOptions`` of the flags; ValueError naming a bad one."""
    token = os.environ.get(ADMIN_TOKEN_ENV) or None
    if args.console_admin_token_file is not None:
        try:
            token = args.console_admin_token_file.read_text().strip()
        except OSError as error:
            raise ValueError(
                f"--console-admin-token-file: cannot read "
                f"{str(args.console_admin_token_file)!r}: {error.strerror}"
            ) from None
    if token is not None and len(token) < 16:
        raise ValueError("console admin token: must be at least 16 characters")
    return _options(args, token)


def _options(args: argparse.Namespace, token: str | None) -> Any:
    from controlplane.console.host import ConsoleOptions, console_door
    from controlplane.console.sessions import RateLimit, SessionLimits

    values = {}
    for flag in (
        "--console-max-connections",
        "--console-max-connections-per-source",
        "--console-sessions-per-tenant",
        "--console-logins-per-minute",
        "--console-failed-logins-per-minute",
        "--console-accepts-per-second",
    ):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
        values[flag[10:].replace("-", "_")] = value
    door = console_door(
        max_connections=values["max_connections"],
        max_per_source=values["max_connections_per_source"],
        accepts_per_s=values["accepts_per_second"],
    )
    sessions = SessionLimits()
    if values["sessions_per_tenant"]:
        sessions = replace(sessions, per_tenant=values["sessions_per_tenant"])
    if values["logins_per_minute"]:
        rate = values["logins_per_minute"]
        sessions = replace(sessions, logins_per_tenant=RateLimit(rate, float(rate)))
    if values["failed_logins_per_minute"]:
        rate = values["failed_logins_per_minute"]
        sessions = replace(sessions, failures_per_source=RateLimit(10, float(rate)))
    options = ConsoleOptions(listen=args.console, admin_token=token, door=door, sessions=sessions)
    options.host_port()  # ValueError naming --console
    return options


def register_console_bench(bench: Any) -> None:
    p = bench.add_parser(
        "console", help="console page times and sizes for a tenant at its name caps"
    )
    p.add_argument("--tools", type=int, default=1000, help="tools of the tenant (its cap)")
    p.add_argument(
        "--signatures", type=int, default=10_000, help="signatures of the tenant (its cap)"
    )
    p.add_argument("--repeat", type=int, default=20, help="loads of each page")
    p.add_argument("--db", default=None, metavar="URL", help="default: a temporary SQLite file")
    p.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from controlplane.console.bench import run

    if min(args.tools, args.signatures, args.repeat) < 1:
        raise ValueError("--tools, --signatures and --repeat must be >= 1")
    run(args.tools, args.signatures, args.repeat, args.db)
    return 0
