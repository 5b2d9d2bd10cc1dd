"""`cachettl` subcommands of this package (registered by `controlplane.cli`).

``serve``, ``db upgrade``, ``tenants create|list|revoke|rotate``
(:mod:`controlplane.cli.tenants`), ``tools list|show``, ``misses`` and ``bench
controlplane``. Inspection commands read the database directly (the same code the server's
InspectService runs), so they work with or without a running server.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, TypeAlias

from controlplane.cli.database import add_db, db_url, open_error, require_connection
from controlplane.cli.rollout import register_rollout
from controlplane.cli.tenants import register_tenants
from estimator import DEFAULT_PROFILE, DEFAULT_TTL_CAP_S

__all__ = ["register"]

_SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
POLICY_CHOICES = ("continuum", "cachettl")


def _add_name_limits(parser: argparse.ArgumentParser) -> None:
    from controlplane.learning import NameLimits  # light: no estimator import

    parser.add_argument(
        "--max-tools-per-tenant",
        type=int,
        default=NameLimits.max_tools,
        metavar="N",
        help="distinct tool names a tenant's models hold; a batch passing it is refused "
        "(RESOURCE_EXHAUSTED, nothing stored) (default %(default)s)",
    )
    parser.add_argument(
        "--max-signatures-per-tenant",
        type=int,
        default=NameLimits.max_signatures,
        metavar="N",
        help="distinct (tool, argument signature) pairs a tenant's models hold "
        "(default %(default)s)",
    )


def _add_signature_rules(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--signature-rule",
        action="append",
        default=[],
        metavar="TOOL=KIND",
        help="how TOOL's calls get their argument signature, over the built-in rule (only "
        "arguments that name a command give one): command, none, keys (of JSON "
        "arguments) or regex:PATTERN (what it finds; its first group if any); repeatable",
    )


def register(commands: _SubParsers, bench: _SubParsers) -> None:
    """Add this package's subcommands to `cachettl` and `cachettl bench`."""
    _register_serve(commands)
    _register_db(commands)
    register_tenants(commands)
    register_rollout(commands)
    _register_tools(commands)
    _register_misses(commands)
    from controlplane.cli.bench import register_bench
    from controlplane.console.cli import register_console_bench

    register_bench(bench)
    register_console_bench(bench)


# -- serve ------------------------------------------------------------------------------


def _register_serve(commands: _SubParsers) -> None:
    p = commands.add_parser("serve", help="run the control-plane gRPC server")
    from controlplane.cli.configfile import add_config_flag

    add_config_flag(p)  # --config FILE: every flag below is a key of the file
    add_db(p)
    p.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT")
    p.add_argument("--policy", choices=POLICY_CHOICES, default="cachettl")
    p.add_argument(
        "--ttl-cap", type=float, default=DEFAULT_TTL_CAP_S, help="cachettl: TTL cap, seconds"
    )
    p.add_argument("--min-samples", type=int, default=100, help="back-off threshold K")
    _add_signature_rules(p)
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help="hardware/model profile of the cost model (estimator.PROFILES)",
    )
    p.add_argument("--max-concurrent-rpcs", type=int, default=256)
    # Before gRPC loads (the import below): its core's fork handlers stay off and it logs
    # errors only, so the child that pickles each written snapshot (controlplane.snapshots)
    # neither pauses gRPC's threads nor adds a line to the server's log.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from controlplane.rpc.server import add_admission_flags

    add_admission_flags(p)  # per tenant, per peer, streams, auth cache (README "Limits")
    p.add_argument("--max-duration", type=float, default=86400.0, help="seconds")
    _add_name_limits(p)
    p.add_argument("--tail-interval", type=float, default=0.5, help="seconds")
    p.add_argument("--snapshot-interval", type=float, default=30.0, help="seconds")
    from controlplane.cli.compact import add_retention_flags

    add_retention_flags(p)  # --log-retention AGE, --log-retention-rows N, --compact-interval
    p.add_argument("--metrics", default=None, metavar="HOST:PORT", help="Prometheus /metrics")
    p.add_argument("--tls-cert", type=Path, default=None)
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--tls-client-ca", type=Path, default=None, help="require client certs")
    from controlplane.console.cli import add_console_flags

    add_console_flags(p)  # --console HOST:PORT, the read-only web console
    p.set_defaults(handler=_serve)


def _policy_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"ttl_cap_s": args.ttl_cap} if args.policy == "cachettl" else {}


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from controlplane.errors import StorageError
    from controlplane.learning import NameLimits
    from controlplane.records import Limits
    from controlplane.rpc.server import ServerOptions, admission_from_args, serve
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    for name in ("max_concurrent_rpcs", "min_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.max_duration <= 30 * 86400:
        raise ValueError("--max-duration must be in (0, 2592000] seconds")
    tls = _tls_files(args)
    from estimator import get_profile

    get_profile(args.profile)  # ValueError naming the valid profiles
    from estimator.signatures import parse_rules

    rules = parse_rules(args.signature_rule)  # ValueError naming the rule
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its plugin set-up chatter
    limits = NameLimits(args.max_tools_per_tenant, args.max_signatures_per_tenant)
    budgets, auth = admission_from_args(args)
    from controlplane.cli.compact import retention_options

    retention = retention_options(args)  # --log-retention: the horizon and interval
    try:
        store = create_store(db_url(args))
    except StorageError as error:  # one line: the database is missing, down or too old
        raise open_error(db_url(args), error) from None
    plane = ControlPlane(
        store,
        args.policy,
        _policy_params(args),
        args.min_samples,
        profile=args.profile,
        name_limits=limits,
        signature_rules=rules,
    )
    options = ServerOptions(
        listen=args.listen,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        tail_interval_s=args.tail_interval,
        snapshot_interval_s=args.snapshot_interval,
        limits=Limits(max_duration_s=args.max_duration),
        tls=tls,
        metrics_listen=args.metrics,
        budgets=budgets,
        auth=auth,
        **retention,
    )
    try:
        asyncio.run(_with_console(plane, options, args) if args.console else serve(plane, options))
    finally:
        store.close()
    return 0


def _tls_files(args: argparse.Namespace) -> Any:
    """The server's ``TlsFiles`` of the TLS flags (None: plaintext); ValueError naming a
    flag that is missing or a file that is bad."""
    from controlplane.rpc.server import TlsFiles

    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if args.tls_client_ca and not (args.tls_cert or args.tls_key):
        raise ValueError(
            "--tls-client-ca requires --tls-cert and --tls-key (mutual TLS); refusing "
            "to start a plaintext server that asks no client certificate"
        )
    if not (args.tls_cert and args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca)
    tls.credentials()  # a missing or bad file: one line naming the flag, before binding
    return tls


def _with_console(plane: Any, options: Any, args: argparse.Namespace) -> Any:
    """``serve`` with the read-only web console beside the gRPC server (``--console``)."""
    from controlplane.console.cli import console_options
    from controlplane.console.host import serve_with_console

    return serve_with_console(plane, options, console_options(args))


# -- db ---------------------------------------------------------------------------------


def _register_db(commands: _SubParsers) -> None:
    p = commands.add_parser("db", help="database maintenance")
    sub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = sub.add_parser("upgrade", help="upgrade the schema to this version's revision")
    add_db(up)
    up.set_defaults(handler=_db_upgrade)
    from controlplane.cli.compact import register_compact

    register_compact(sub)  # cachettl db compact --older-than AGE [--dry-run]


def _db_upgrade(args: argparse.Namespace) -> int:
    from controlplane.storage.migrate import upgrade
    from controlplane.storage.sql import SqlStore

    url = db_url(args)
    if url == "memory://":
        raise ValueError("--db: memory:// has no schema to upgrade")
    store = SqlStore(url, check_schema=False)
    try:
        require_connection(store.engine, url)  # a missing database: one line naming createdb
        before, after = upgrade(store.engine)
    finally:
        store.close()
    print(f"schema {before or 'empty'} -> {after}")
    return 0


# -- tools ------------------------------------------------------------------------------


def _register_tools(commands: _SubParsers) -> None:
    p = commands.add_parser("tools", help="inspect learned tool-duration models")
    sub = p.add_subparsers(dest="tools_command", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="tools with counts, quantiles and pin hit rates")
    show = sub.add_parser("show", help="one tool's distribution and the TTLs it gives")
    show.add_argument("tool")
    show.add_argument("--args", default="", metavar="SIG", help="tool arguments (invocation)")
    show.add_argument("--png", type=Path, default=None, metavar="FILE", help="draw the CDF")
    for parser in (listing, show):
        add_db(parser)
        parser.add_argument("--tenant", default="default", help="tenant name")
        parser.add_argument("--policy", choices=POLICY_CHOICES, default="cachettl")
        parser.add_argument("--min-samples", type=int, default=100)
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        _add_name_limits(parser)
        _add_signature_rules(parser)
    listing.set_defaults(handler=_tools_handler("list"))
    show.set_defaults(handler=_tools_handler("show"))


def _tools_handler(action: str) -> Any:
    def handler(args: argparse.Namespace) -> int:
        from controlplane.cli import toolview

        return toolview.run(action, args, db_url(args))

    return handler


# -- misses -----------------------------------------------------------------------------


def _register_misses(commands: _SubParsers) -> None:
    p = commands.add_parser(
        "misses", help="recent turns that missed their previous turn's cache, and why"
    )
    add_db(p)
    p.add_argument("--tenant", default="default", help="tenant name")
    p.add_argument("--tool", default=None, help="only this tool's turns")
    p.add_argument("--session", default=None, metavar="PROGRAM", help="only this program's")
    p.add_argument(
        "--reason",
        default=None,
        help="only this reason: not_pinned, expired, released_under_pressure, evicted, diverged",
    )
    p.add_argument("--limit", type=int, default=50, help="turns to list, newest first (1..1000)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_misses)


def _misses(args: argparse.Namespace) -> int:
    from controlplane.cli import missview

    return missview.run(args, db_url(args))
