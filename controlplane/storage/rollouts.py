"""Tenants' rollouts in the store: which tools a tenant's engines pin
(``cachettl rollout set``).

The rollout itself (:class:`~controlplane.records.Rollout`: ``all``, ``only``, ``except``,
``shadow``) is part of the control plane's vocabulary, shared with the engine hook
(:mod:`enginehook.core.rollout`). Here: one row per tenant that ever had one
(:class:`StoredRollout`), its ``version`` raised by every change, and the SQL of
:class:`~controlplane.storage.sql.SqlStore`'s part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, insert, select, update

from controlplane.errors import TenantNotFoundError
from controlplane.records import Rollout, RolloutMode, parse_tools
from controlplane.storage.schema import tenant_rollouts, tenants
from controlplane.storage.transactions import transaction

__all__ = [
    "Rollout",
    "RolloutMode",
    "StoredRollout",
    "parse_tools",
    "sql_all",
    "sql_set",
]


@dataclass(frozen=True, slots=True)
class StoredRollout:
    """A tenant's rollout as stored (``None``: cleared, the engines' own setting applies):
    ``version`` rises with every change (the snapshot version engines are told adds it, so
    a change reaches them as a new snapshot)."""

    tenant: str
    rollout: Rollout | None
    version: int
    updated_at: float


# -- SQL (SqlStore's part; one row per tenant in ``tenant_rollouts``) -----------------------


def _stored(row: Any) -> StoredRollout:
    mode = RolloutMode(row.mode)
    tools = tuple(t for t in row.tools.split(",") if t)
    rollout = None if mode is RolloutMode.UNSPECIFIED else Rollout(mode, tools)
    return StoredRollout(row.name, rollout, int(row.version), float(row.updated_at))


def sql_set(engine: Engine, name: str, rollout: Rollout | None, now: float) -> StoredRollout:
    """:meth:`controlplane.storage.base.Store.set_rollout` in one write transaction."""
    mode = int(rollout.mode) if rollout is not None else 0
    tools = ",".join(rollout.tools) if rollout is not None else ""
    with transaction(engine, write=True) as c:
        found = c.execute(select(tenants.c.id).where(tenants.c.name == name)).first()
        if found is None:
            raise TenantNotFoundError(f"no tenant named {name!r}")
        key = tenant_rollouts.c.tenant_id == found.id
        old = c.execute(select(tenant_rollouts.c.version).where(key)).first()
        values = {"mode": mode, "tools": tools, "updated_at": now}
        if old is None:
            version = 1
            c.execute(insert(tenant_rollouts).values(tenant_id=found.id, version=1, **values))
        else:
            version = int(old.version) + 1
            c.execute(update(tenant_rollouts).where(key).values(version=version, **values))
    return StoredRollout(name, rollout, version, now)


def sql_all(engine: Engine) -> list[StoredRollout]:
    """:meth:`controlplane.storage.base.Store.rollouts`."""
    query = (
        select(tenant_rollouts, tenants.c.name)
        .join(tenants, tenants.c.id == tenant_rollouts.c.tenant_id)
        .order_by(tenants.c.name)
    )
    with transaction(engine) as c:
        return [_stored(row) for row in c.execute(query)]
