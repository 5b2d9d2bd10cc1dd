"""`cachettl rollout set|show`: which tools a tenant's engines pin, read and written in the
database directly. Running servers read it within their tail interval (0.5 s by default)
and send it to the tenant's engines with the next snapshot: no engine restarts
(:mod:`controlplane.storage.rollouts`, :mod:`enginehook.core.rollout`).

    cachettl rollout set --tenant acme --shadow          # watch: decide and report only
    cachettl rollout set --tenant acme --only bash,pytest
    cachettl rollout set --tenant acme --except web_search
    cachettl rollout set --tenant acme --all
    cachettl rollout set --tenant acme --clear           # the engines' own setting again
    cachettl rollout show [--tenant acme] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TypeAlias

from controlplane.cli.database import add_db, db_url
from controlplane.storage.rollouts import Rollout, StoredRollout, parse_tools

__all__ = ["register_rollout"]

_SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register_rollout(commands: _SubParsers) -> None:
    p = commands.add_parser(
        "rollout", help="which tools a tenant's engines pin (shadow, some tools, all)"
    )
    sub = p.add_subparsers(dest="rollout_command", metavar="ACTION", required=True)
    set_ = sub.add_parser(
        "set",
        help="set a tenant's rollout",
        description="Set which tools the tenant's engines pin. A tool outside the rollout "
        "is handled as in shadow mode: the engine decides the TTL, reports it and what the "
        "pin would have met, and pins nothing. Servers read the change within their tail "
        "interval and engines apply it with their next snapshot, without a restart. An "
        "engine started with mode shadow stays in shadow whatever is set here.",
    )
    set_.add_argument("--tenant", required=True, metavar="NAME", help="the tenant")
    what = set_.add_mutually_exclusive_group(required=True)
    what.add_argument("--only", metavar="TOOLS", help="pin only these tools (bash,pytest)")
    what.add_argument("--except", dest="except_", metavar="TOOLS", help="pin every tool but these")
    what.add_argument("--all", action="store_true", help="pin every tool")
    what.add_argument(
        "--shadow",
        action="store_true",
        help="pin nothing, keep vLLM's own order; decide and report every pin",
    )
    what.add_argument(
        "--clear",
        action="store_true",
        help="no rollout: each engine's own setting applies (by default every tool)",
    )
    show = sub.add_parser("show", help="show the tenants' rollouts")
    show.add_argument("--tenant", metavar="NAME", help="only this tenant")
    show.add_argument("--json", action="store_true", help="one JSON object per tenant")
    for parser, handler in ((set_, _rollout_set), (show, _rollout_show)):
        add_db(parser)
        parser.set_defaults(handler=handler)


def rollout_of_args(args: argparse.Namespace) -> Rollout | None:
    """The rollout ``rollout set``'s flags ask for (``None``: ``--clear``)."""
    if args.clear:
        return None
    if args.only is not None:
        return Rollout.of("only", parse_tools(args.only, "--only"))
    if args.except_ is not None:
        return Rollout.of("except", parse_tools(args.except_, "--except"))
    return Rollout.of("shadow" if args.shadow else "all")


def _describe(row: StoredRollout) -> str:
    what = row.rollout.describe() if row.rollout is not None else "none (engines' own setting)"
    return f"{row.tenant}: {what} (version {row.version})"


def _rollout_set(args: argparse.Namespace) -> int:
    from controlplane.errors import TenantNotFoundError
    from controlplane.storage import create_store

    rollout = rollout_of_args(args)
    store = create_store(db_url(args))
    try:
        row = store.set_rollout(args.tenant, rollout, time.time())
    except TenantNotFoundError as error:
        raise ValueError(f"--tenant: {error}; nothing written") from None
    finally:
        store.close()
    print(_describe(row))
    return 0


def _rollout_show(args: argparse.Namespace) -> int:
    from controlplane.storage import create_store

    store = create_store(db_url(args))
    try:
        names = {t.name for t in store.list_tenants()}
        rows = {row.tenant: row for row in store.rollouts()}
    finally:
        store.close()
    if args.tenant is not None and args.tenant not in names:
        raise ValueError(f"--tenant: no tenant named {args.tenant!r}")
    for name in sorted(names if args.tenant is None else {args.tenant}):
        row = rows.get(name) or StoredRollout(name, None, 0, 0.0)
        if args.json:
            rollout = row.rollout
            print(
                json.dumps(
                    {
                        "tenant": name,
                        "mode": rollout.mode.label if rollout is not None else None,
                        "tools": list(rollout.tools) if rollout is not None else [],
                        "version": row.version,
                        "updated_at": row.updated_at or None,
                    }
                )
            )
        else:
            print(_describe(row))
    return 0
