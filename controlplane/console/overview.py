"""The data of the console's overview pages: tenants, shared models, workload, engines.

Like :mod:`controlplane.console.views` (whose ``Sources`` they read): plain JSON-ready
dicts, bounded, for one tenant the caller has checked the viewer may see.
"""

from __future__ import annotations

from typing import Any

from controlplane import inspection
from controlplane.console.views import PAGE, Sources, distribution, number, paged
from controlplane.records import Tenant
from estimator import Level

__all__ = ["engine_name", "engines", "shared", "tenants", "workload"]


def tenants(src: Sources) -> dict[str, Any]:
    """Every tenant with its counts (the admin's first page)."""
    state = src.plane.state
    rows = []
    for t in src.plane.store.list_tenants():
        rows.append(
            {
                "name": t.name,
                "share": t.share,
                "revoked": t.revoked_at is not None,
                "tools": len(state.index.get(t.name, ())),
                "tool_calls": state.tool_calls.get(t.name, 0),
                "programs": state.programs.get(t.name, 0),
                "version": src.plane.tenant_version(t),
            }
        )
    return {"tenants": rows}


def shared(src: Sources, tenant: Tenant, name: str = "", page: int = 1) -> dict[str, Any]:
    """The shared models published to a sharing tenant (none to one that does not
    share): the list, or with ``name`` one model's distribution. Only published,
    quantised models are read, never another tenant's own windows."""
    if not tenant.share:
        return {"tenant": tenant.name, "share": False, "tools": [], "page": 1, "pages": 1}
    state = src.plane.state
    with src.plane.model_lock:
        names = sorted(state.shared.tools)
        found = {
            n: m
            for n in ([name] if name else names)
            if (m := inspection.stored_model(state, tenant.name, (Level.SHARED, n, "")))
        }
        if name:
            model = found.get(name)
            dist = distribution(model) if model is not None else None
            return {"tenant": tenant.name, "share": True, "tool": name, "distribution": dist}
        rows, paging = paged(sorted(found), page)
        listed = [
            {"name": n, "points": found[n].n_samples, "p50": number(found[n].quantile(0.5))}
            for n in rows
        ]
    return {"tenant": tenant.name, "share": True, **paging, "tools": listed}


def workload(src: Sources, tenant: str) -> dict[str, Any]:
    """η and T now, and as sampled since the console started."""
    v = src.plane.workload_stats(tenant)
    return {
        "tenant": tenant,
        "eta": number(v.eta),
        "queue_delay_s": number(v.queue_delay_s),
        "programs_completed": v.programs_completed,
        "programs_in_window": v.programs_in_window,
        "tool_calls": v.tool_calls,
        "queue_samples": v.queue_samples,
        "series": src.history.series(tenant),
    }


def engine_name(engine_id: str) -> tuple[str, str]:
    """``(name, instance)`` of an engine id: an engine hook reports ``NAME#INSTANCE``
    (its ``$CACHETTL_ENGINE_NAME`` or API ``host:port``, and six hex digits for each start,
    ``enginehook.vllm.services.engine_id``); any other id is a name alone.

    >>> engine_name("gpu-node-3:8000#3fa9c1"), engine_name("engine-a")
    (('gpu-node-3:8000', '3fa9c1'), ('engine-a', ''))
    """
    name, sep, instance = engine_id.rpartition("#")
    if sep and name and len(instance) == 6 and all(c in "0123456789abcdef" for c in instance):
        return name, instance
    return engine_id, ""


def engines(src: Sources, tenant: Tenant) -> dict[str, Any]:
    """The tenant's engines as the control plane sees them: linked for moves (watching),
    programs last seen on each, moves told; snapshot streams and the version lag."""
    servicer, who = src.servicer, tenant.name
    current = src.plane.tenant_version(tenant)
    out: dict[str, Any] = {"tenant": who, "version": current, "engines": []}
    if servicer is None:
        return out
    sent = servicer.snapshot_sent(who)
    out["snapshot_sent"] = sent
    out["snapshot_lag"] = None if sent is None else current - sent
    out["streams"] = servicer.gate.streams_of(who)
    hub = servicer.coherence
    engines: dict[str, dict[str, Any]] = {}

    def engine(e: str) -> dict[str, Any]:
        name, instance = engine_name(e)
        row = {"engine": e, "name": name, "instance": instance}
        return engines.setdefault(e, {**row, "watching": 0, "programs": 0, "moves": 0})

    for e, n in hub.watching(who).items():
        engine(e)["watching"] = n
    for e, n in hub.told_to(who).items():
        engine(e)["moves"] = n
    for e, n in (hub.programs_here(who) or {}).items():  # None: the database holds them
        engine(e)["programs"] = n
    out["engines"] = sorted(engines.values(), key=lambda e: (e["name"], e["engine"]))[:PAGE]
    out["engine_count"] = len(engines)
    return out
