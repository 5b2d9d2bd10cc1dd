"""`cachettl tenants create|list|revoke|rotate`: tenants and their bearer tokens, read and
written in the database directly (a running server sees the change within seconds)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TypeAlias

from controlplane.cli.database import add_db, db_url

__all__ = ["register_tenants"]

_SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register_tenants(commands: _SubParsers) -> None:
    p = commands.add_parser("tenants", help="create, list, revoke tenants and rotate tokens")
    sub = p.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    create = sub.add_parser(
        "create",
        help="add a tenant and print its bearer token",
        description="Add a tenant and print its bearer token, once (only its hash is "
        "stored). A tenant that exists is refused and nothing is written: its token cannot "
        "be shown again; `cachettl tenants rotate NAME` issues a new one. Note that the "
        "shell empties a file redirected to (`> FILE`) before the command runs, refused or "
        "not: --token-file FILE writes the token only once the tenant exists.",
    )
    create.add_argument("name")
    create.add_argument(
        "--share", action="store_true", help="feed (and use) cross-tenant per-tool priors"
    )
    listing = sub.add_parser("list", help="list tenants")
    revoke = sub.add_parser(
        "revoke",
        help="disable a tenant's token",
        description="Disable the tenant's token (its data stays). Servers refuse it and end "
        "its open streams within seconds. `cachettl tenants rotate NAME` re-issues one.",
    )
    revoke.add_argument("name")
    rotate = sub.add_parser(
        "rotate",
        help="issue a tenant a new bearer token (the old one stops working)",
        description="Issue the tenant a new bearer token and print it, once. The old token "
        "stops working at once: servers refuse it and end the streams opened with it "
        "(engines reconnect with the new token once their token file holds it). A revoked "
        "tenant is active again with the new token. Its data stays.",
    )
    rotate.add_argument("name")
    for parser in (create, rotate):
        parser.add_argument(
            "--token-file",
            type=Path,
            default=None,
            metavar="FILE",
            help="write the token to FILE (mode 0600, replaced whole) instead of stdout; "
            "nothing is written when the command is refused",
        )
    for parser, handler in (
        (create, _tenants_create),
        (listing, _tenants_list),
        (revoke, _tenants_revoke),
        (rotate, _tenants_rotate),
    ):
        add_db(parser)
        parser.set_defaults(handler=handler)


def _emit_token(token: str, path: Path | None) -> None:
    """Print the token, or write it to ``path`` whole (a temporary file renamed over it,
    readable by its owner only)."""
    if path is None:
        print(token, flush=True)
        return
    import tempfile

    folder = path.parent if str(path.parent) else Path(".")
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _check_token_file(path: Path | None) -> None:
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"--token-file: folder {str(folder)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"--token-file: {str(path)!r} is a folder")


def _tenants_create(args: argparse.Namespace) -> int:
    from controlplane.errors import TenantExistsError
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    _check_token_file(args.token_file)
    store = create_store(db_url(args))
    try:
        _, token = ControlPlane(store).create_tenant(args.name, args.share)
    except TenantExistsError as error:
        raise ValueError(
            f"{error}; nothing written (its token is stored only hashed and cannot be shown "
            f"again): `cachettl tenants rotate {args.name}` issues a new one"
        ) from None
    finally:
        store.close()
    _emit_token(token, args.token_file)
    return 0


def _tenants_rotate(args: argparse.Namespace) -> int:
    from controlplane.errors import TenantNotFoundError
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    _check_token_file(args.token_file)
    store = create_store(db_url(args))
    try:
        _, token = ControlPlane(store).rotate_token(args.name)
    except TenantNotFoundError as error:
        raise ValueError(f"{error}; nothing written") from None
    finally:
        store.close()
    _emit_token(token, args.token_file)
    return 0


def _tenants_list(args: argparse.Namespace) -> int:
    import time

    from controlplane.cli.terminal import printable
    from controlplane.storage import create_store

    store = create_store(db_url(args))
    try:
        tenants = store.list_tenants()
    finally:
        store.close()
    print(f"{'NAME':<24} {'SHARE':<6} {'STATUS':<8} CREATED")
    for t in tenants:
        status = "revoked" if t.revoked_at is not None else "active"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t.created_at))
        print(f"{printable(t.name):<24} {'yes' if t.share else 'no':<6} {status:<8} {created}")
    return 0


def _tenants_revoke(args: argparse.Namespace) -> int:
    import time

    from controlplane.errors import TenantNotFoundError
    from controlplane.storage import create_store

    store = create_store(db_url(args))
    try:
        store.revoke_tenant(args.name, time.time())
    except TenantNotFoundError as error:
        raise ValueError(str(error)) from None
    finally:
        store.close()
    print(f"revoked {args.name}")
    return 0
