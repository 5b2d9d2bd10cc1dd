"""The data of the console's pages: plain JSON-ready dicts, each bounded in size.

Every function reads the live ``ControlPlane`` the gRPC services read (models under its
lock, the store for pin outcomes and misses), for one tenant named by the caller, which
has already checked that the viewer may see it (:mod:`controlplane.console.sessions`).
They block (locks, database): the app runs them in worker threads.

Bounds, so that a tenant at its name caps (1,000 tools, 10,000 signatures) pages fast:
lists are paged (``PAGE`` rows) after a substring search, a CDF has at most ``CDF_POINTS``
points, a histogram ``BINS`` bins, the timelines bucket the newest ``TIMELINE_CALLS`` calls
of a tool, and the misses listed are the newest ``MISSES_LISTED``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from controlplane import inspection
from controlplane.console.watch import History
from controlplane.records import MISSES, MissQuery, MissReason, PinOutcome, Tenant
from controlplane.service import ControlPlane
from controlplane.state import PinCounts
from estimator import DurationModel, Level, RequestFacts

__all__ = ["PAGE", "Sources", "distribution", "number", "paged", "tool", "tools"]

PAGE = 100
CDF_POINTS = 200
BINS = 30
TIMELINE_CALLS = 500
TIMELINE_BUCKETS = 24
MISSES_LISTED = 20
#: Context length of the TTL decision shown when the viewer names none (tokens).
CONTEXT_TOKENS = 32_768
#: Store reads kept (``Sources.read``).
READS_KEPT = 256
#: Where zero durations sit on the histogram's log axis (seconds).
LOG_FLOOR_S = 1e-3


@dataclass
class Sources:
    """What the console reads: the control plane, and (when served beside a gRPC server)
    its servicer (snapshots sent, streams, the pin-coherence hub)."""

    plane: ControlPlane
    servicer: Any = None
    history: History = field(default_factory=History)
    #: Store reads of a tool (misses, timelines) by (what, tenant, tool, tenant version):
    #: a page polled while nothing new arrived reads the database once.
    reads: OrderedDict[tuple[str, str, str, int], Any] = field(default_factory=OrderedDict)

    def read(self, what: str, tenant: Tenant, tool: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or what it gave for the same tenant version (the newest 256 kept)."""
        key = (what, tenant.name, tool, self.plane.tenant_version(tenant))
        if key in self.reads:
            self.reads.move_to_end(key)
            return self.reads[key]
        value = self.reads[key] = fn()
        while len(self.reads) > READS_KEPT:
            self.reads.popitem(last=False)
        return value


def number(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _pins(p: PinCounts) -> dict[str, Any]:
    return {
        "hits": p.hits,
        "expired": p.expired,
        "released_under_pressure": p.released_under_pressure,
        "not_pinned": p.not_pinned,
        "hit_rate": p.hit_rate,
    }


def paged(items: list[Any], page: int) -> tuple[list[Any], dict[str, int]]:
    pages = max(1, math.ceil(len(items) / PAGE))
    page = min(max(page, 1), pages)
    return items[(page - 1) * PAGE : page * PAGE], {
        "page": page,
        "pages": pages,
        "total": len(items),
    }


def tools(
    src: Sources, tenant: str, q: str = "", sort: str = "name", page: int = 1
) -> dict[str, Any]:
    """The tenant's tools matching ``q`` (substring, any case), by name or by calls seen."""
    views = src.plane.list_tools(tenant)
    if q:
        needle = q.casefold()
        views = [v for v in views if needle in v.tool.casefold()]
    if sort == "calls":
        views.sort(key=lambda v: (-v.seen_count, v.tool))
    rows, paging = paged(views, page)
    return {
        "tenant": tenant,
        "q": q,
        "sort": sort,
        **paging,
        "tools": [
            {
                "name": v.tool,
                "samples": v.sample_count,
                "seen": v.seen_count,
                "p50": number(v.quantiles_s[0]),
                "p90": number(v.quantiles_s[1]),
                "p99": number(v.quantiles_s[2]),
                "change_points": v.drift_epoch,
                "signatures": len(v.signatures),
                "pins": _pins(v.pins),
            }
            for v in rows
        ],
    }


def distribution(model: DurationModel) -> dict[str, Any]:
    """CDF (at most ``CDF_POINTS`` points) and a log-binned histogram of a model."""
    samples = model.sorted_samples()
    out: dict[str, Any] = {
        "samples": model.n_samples,
        "seen": model.n_seen,
        "change_points": model.drift_epoch,
        "quantiles": [[q, number(model.quantile(q))] for q in (0.1, 0.25, 0.5, 0.9, 0.99)],
        "cdf": [],
        "histogram": [],
        "zeros": 0,
    }
    if not samples.size:
        return out
    idx = np.unique(np.linspace(0, samples.size - 1, CDF_POINTS).round().astype(int))
    out["cdf"] = [[float(samples[i]), model.cdf(float(samples[i]))] for i in idx]
    positive = samples[samples > 0]
    out["zeros"] = int(samples.size - positive.size)
    if positive.size:
        low, high = math.log10(max(positive[0], LOG_FLOOR_S)), math.log10(positive[-1])
        edges = np.logspace(low, max(high, low + 1e-6), BINS + 1)
        counts, _ = np.histogram(np.clip(positive, edges[0], edges[-1]), edges)
        out["histogram"] = [
            [float(edges[i]), float(edges[i + 1]), int(c)] for i, c in enumerate(counts)
        ]
    return out


def _signatures(src: Sources, tenant: str, name: str, q: str, page: int) -> dict[str, Any]:
    state = src.plane.state
    with src.plane.model_lock:  # the lock inspection is read under (ControlPlane)
        names = state.signatures_of(tenant, name)
    if q:
        names = [s for s in names if q.casefold() in s.casefold()]
    rows, paging = paged(names, page)
    listed = []
    with src.plane.model_lock:
        for sig in rows:
            model = inspection.stored_model(state, tenant, (Level.INVOCATION, name, sig))
            if model is not None:
                listed.append(
                    {
                        "signature": sig,
                        "samples": model.n_samples,
                        "p50": number(model.quantile(0.5)),
                        "p90": number(model.quantile(0.9)),
                        "change_points": model.drift_epoch,
                    }
                )
    return {"q": q, **paging, "rows": listed}


def _timeline(src: Sources, tenant: str, name: str) -> dict[str, Any]:
    """Pin outcomes and miss reasons of the tool's newest calls, in time buckets."""
    query = MissQuery(name, None, frozenset(MissReason), TIMELINE_CALLS)
    calls = [r.call for r in src.plane.store.list_misses(tenant, query)]
    timed = [c for c in calls if c.finished_at is not None]
    out: dict[str, Any] = {"calls": len(calls), "untimed": len(calls) - len(timed), "t": []}
    outcomes = [o for o in PinOutcome if o is not PinOutcome.UNSPECIFIED]
    reasons = sorted(MISSES)
    out["outcomes"] = {o.label: [] for o in outcomes}
    out["reasons"] = {r.label: [] for r in reasons}
    if not timed:
        return out
    first = min(c.finished_at or 0.0 for c in timed)
    last = max(c.finished_at or 0.0 for c in timed)
    n = TIMELINE_BUCKETS if last > first else 1
    width = (last - first) / n or 1.0
    pins = np.zeros((len(PinOutcome), n), dtype=int)
    why = np.zeros((len(MissReason), n), dtype=int)
    for c in timed:
        b = min(int(((c.finished_at or first) - first) / width), n - 1)
        if not c.shadow:  # a shadow call's outcome is what a pin would have met
            pins[c.pin_outcome, b] += 1
        why[c.cache.reason, b] += 1
    out["t"] = [first + (i + 0.5) * width for i in range(n)]
    out["outcomes"] = {o.label: pins[o].tolist() for o in outcomes}
    out["reasons"] = {r.label: why[r].tolist() for r in reasons}
    return out


def _misses(src: Sources, tenant: str, name: str) -> dict[str, Any]:
    store = src.plane.store
    stats = inspection.miss_stats(store, tenant, name)
    newest = store.list_misses(tenant, MissQuery(name, None, MISSES, MISSES_LISTED))
    return {
        "compacted": inspection.compacted(store),
        "by_reason": {r.label: n for r, n in stats.reasons.items()},
        "returning": stats.returning,
        "missed": stats.missed,
        "expired_by": [[q, number(s)] for q, s in stats.expired_by],
        "newest": [
            {
                "program": r.call.program_id,
                "turn": r.call.turn_index,
                "reason": r.call.cache.reason.label,
                "cause": r.call.cache.not_pinned_cause.label,
                "finished_at": number(r.call.finished_at),
                "duration_s": number(r.call.duration_s),
                "ttl_s": number(r.call.chosen_ttl_s),
                "expired_by_s": number(r.call.cache.expired_by_s),
            }
            for r in newest
        ],
    }


def tool(
    src: Sources,
    tenant: Tenant,
    name: str,
    sig: str = "",
    q: str = "",
    page: int = 1,
    context_tokens: int = CONTEXT_TOKENS,
) -> dict[str, Any] | None:
    """One tool (or, with ``sig``, one of its signatures): distribution, the TTL the policy
    picks now for a call of it and F(TTL), the level it used (and, while the model shown
    has too few samples to decide, how many it has of those it needs), pins, misses,
    timelines and the tool's signatures (paged). None if the tenant has no such tool or
    signature."""
    plane, who = src.plane, tenant.name
    key = (Level.INVOCATION, name, sig) if sig else (Level.TOOL, name, "")
    with plane.model_lock:
        model = inspection.stored_model(plane.state, who, key)
        if model is None:
            return None
        dist = distribution(model)
        pins = _pins(plane.state.pin_counts(who, name))
    facts = RequestFacts(tool=name, tool_args=sig or None, context_tokens=context_tokens)
    decision, version = plane.decide(tenant, facts)
    cold = inspection.cold_start(key[0].value, dist["samples"], plane.min_samples, decision.basis)
    return {
        "tenant": who,
        "tool": name,
        "signature": sig,
        "level": key[0].value,
        "version": version,
        "distribution": dist,
        "decision": {
            "ttl_s": number(decision.ttl_s),
            "f_ttl": number(decision.return_probability),
            "benefit_s": number(decision.benefit_s),
            "expected_benefit_s": number(decision.expected_benefit_s),
            "basis": decision.basis,
            "context_tokens": context_tokens,
            # The model shown does not decide yet: how far it is, and what decides.
            "cold_start": None if cold is None else cold.text,
            "samples_needed": None if cold is None else cold.needed,
        },
        "pins": pins,
        "misses": src.read("misses", tenant, name, lambda: _misses(src, who, name)),
        "timeline": src.read("timeline", tenant, name, lambda: _timeline(src, who, name)),
        "signatures": _signatures(src, who, name, q, page),
    }
