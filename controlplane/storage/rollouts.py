"""Rollouts: which tools a tenant's engines pin (``cachettl rollout set``).

A platform changes an engine's scheduling gradually: first it watches (``shadow``: every
decision made and reported, nothing pinned, vLLM's own order kept), then pins a few tools
(``only``), or all but a few (``except``), then everything (``all``). A tool outside the
rollout is handled as in shadow mode: the engine decides the TTL it would have pinned for
and reports what that pin would have met (``ToolCallEvent.shadow``), and pins nothing.

The same :class:`Rollout` is stored by the control plane (one row per tenant, its
``version`` raised by every change), sent to engines in every ``WatchSnapshotsResponse``
(``controlplane.snapshots``) and applied by the hook
(:mod:`enginehook.core.rollout`); the hook's own setting uses it too.

>>> Rollout.of("only", ["pytest", "bash"])
Rollout(mode=<RolloutMode.ONLY: 2>, tools=('bash', 'pytest'))
>>> r = Rollout.of("except", parse_tools("web_search", "--except"))
>>> r.pins("bash"), r.pins("web_search"), r.describe()
(True, False, 'every tool except web_search')
>>> Rollout.of("only", [])
Traceback (most recent call last):
...
ValueError: rollout: mode 'only' needs at least one tool
>>> parse_tools("bash,,pytest", "--only")
Traceback (most recent call last):
...
ValueError: --only: tool 2 is empty (tools are separated by commas: bash,pytest)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, insert, select, update

from controlplane.errors import TenantNotFoundError
from controlplane.storage.schema import tenant_rollouts, tenants
from controlplane.storage.transactions import transaction

__all__ = [
    "MAX_ROLLOUT_TOOLS",
    "Rollout",
    "RolloutMode",
    "StoredRollout",
    "parse_tools",
    "sql_all",
    "sql_set",
]

#: Tools a rollout lists at most (it rides in every snapshot).
MAX_ROLLOUT_TOOLS = 1000
#: The longest tool name (as ``ToolCallEvent.tool_name``).
_MAX_TOOL_NAME = 128


class RolloutMode(enum.IntEnum):
    """Which tools a rollout pins; the values are the wire's ``RolloutMode``."""

    UNSPECIFIED = 0
    ALL = 1
    ONLY = 2
    EXCEPT = 3
    SHADOW = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | int) -> RolloutMode:
        """A mode by label (``all``, ``only``, ``except``, ``shadow``) or wire value."""
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        elif isinstance(value, str) and value.upper() in cls.__members__:
            mode = cls[value.upper()]
            if mode is not cls.UNSPECIFIED:
                return mode
        names = ", ".join(m.label for m in cls if m is not cls.UNSPECIFIED)
        raise ValueError(f"rollout: unknown mode {value!r}; valid: {names}")


@dataclass(frozen=True, slots=True)
class Rollout:
    """Which tools are pinned. ``tools``: those of ``ONLY`` / ``EXCEPT``, sorted."""

    mode: RolloutMode = RolloutMode.ALL
    tools: tuple[str, ...] = ()

    @classmethod
    def of(cls, mode: str | int | RolloutMode, tools: Iterable[str] = ()) -> Rollout:
        """A checked rollout: ``only`` and ``except`` need tools, ``all`` and ``shadow``
        take none; each name 1..128 characters without commas or NUL."""
        kind = mode if isinstance(mode, RolloutMode) else RolloutMode.parse(mode)
        if kind is RolloutMode.UNSPECIFIED:
            raise ValueError("rollout: mode must be all, only, except or shadow")
        names = tuple(sorted(set(tools)))
        for name in names:
            _check_tool(name, "rollout")
        if kind in (RolloutMode.ONLY, RolloutMode.EXCEPT) and not names:
            raise ValueError(f"rollout: mode {kind.label!r} needs at least one tool")
        if kind in (RolloutMode.ALL, RolloutMode.SHADOW) and names:
            raise ValueError(f"rollout: mode {kind.label!r} takes no tools, got {names!r}")
        if len(names) > MAX_ROLLOUT_TOOLS:
            raise ValueError(f"rollout: at most {MAX_ROLLOUT_TOOLS} tools, got {len(names)}")
        return cls(kind, names)

    @property
    def shadow(self) -> bool:
        """No tool is pinned and vLLM's own order is kept."""
        return self.mode is RolloutMode.SHADOW

    def pins(self, tool: str) -> bool:
        """Whether a call of ``tool`` may be pinned (outside: reported as shadow)."""
        if self.mode is RolloutMode.ONLY:
            return tool in self.tools
        if self.mode is RolloutMode.EXCEPT:
            return tool not in self.tools
        return self.mode is not RolloutMode.SHADOW

    def describe(self) -> str:
        """In words, for logs and the CLI."""
        listed = ", ".join(self.tools)
        if self.mode is RolloutMode.ONLY:
            return f"only {listed}"
        if self.mode is RolloutMode.EXCEPT:
            return f"every tool except {listed}"
        if self.mode is RolloutMode.SHADOW:
            return "shadow: no tool pinned, vLLM's order kept"
        return "every tool"


@dataclass(frozen=True, slots=True)
class StoredRollout:
    """A tenant's rollout as stored (``None``: cleared, the engines' own setting applies):
    ``version`` rises with every change (the snapshot version engines are told adds it, so
    a change reaches them as a new snapshot)."""

    tenant: str
    rollout: Rollout | None
    version: int
    updated_at: float


def _check_tool(name: object, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool name must be a non-empty string, got {name!r}")
    if len(name) > _MAX_TOOL_NAME or "," in name or "\x00" in name:
        raise ValueError(
            f"{where}: tool name {name[:40]!r} must be at most {_MAX_TOOL_NAME} characters "
            "without commas or NUL"
        )


def parse_tools(text: str | Iterable[str], where: str) -> tuple[str, ...]:
    """Tool names from ``bash,pytest`` (or a list of names); errors name ``where``."""
    if not isinstance(text, str | list | tuple | frozenset | set):
        raise ValueError(f"{where}: a list of tool names or 'bash,pytest', got {text!r}")
    names = text.split(",") if isinstance(text, str) else list(text)
    tools = []
    for i, raw in enumerate(names, 1):
        name = raw.strip() if isinstance(raw, str) else raw
        if name == "":
            raise ValueError(
                f"{where}: tool {i} is empty (tools are separated by commas: bash,pytest)"
            )
        _check_tool(name, where)
        tools.append(name)
    return tuple(sorted(set(tools)))


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
