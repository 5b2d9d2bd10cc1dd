"""The console's command-line parts: ``serve --console`` flags and ``bench console``.

Light on purpose (no web imports): ``cachettl --help`` must not need the ``console`` extra.
"""

from __future__ import annotations

import argparse
import os
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


def console_options(args: argparse.Namespace) -> Any:
    """The ``ConsoleOptions`` of the flags; ValueError naming a bad one."""
    from controlplane.console.host import ConsoleOptions

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
    options = ConsoleOptions(listen=args.console, admin_token=token)
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
