"""Read-only views of one tenant's models (shared by the gRPC service and the CLI).

A tenant only ever sees its own keys; the cross-tenant ``shared`` models appear in a
sharing tenant's snapshot only as published, k-anonymous, quantised aggregates
(``controlplane.sharing``), never as another tenant's raw events.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from controlplane.records import MISSES, MissQuery, MissReason, ToolCall
from controlplane.state import ModelState, PinCounts
from controlplane.storage import Store
from estimator import DurationModel, Level
from estimator.policies import COLD_START

__all__ = [
    "BASIS_TEXT",
    "EXPIRED_BY_SAMPLES",
    "ColdStart",
    "DistributionView",
    "MissStats",
    "MissesView",
    "ModelKey",
    "ModelView",
    "SnapshotView",
    "ToolView",
    "WorkloadView",
    "basis_text",
    "cold_start",
    "compacted",
    "distribution",
    "list_tools",
    "miss_stats",
    "misses",
    "model_view",
    "snapshot",
    "snapshot_keys",
    "stored_model",
    "workload",
]

#: Windows longer than this are sent in snapshots as this many evenly spaced quantiles.
SNAPSHOT_MAX_POINTS = 512
QUANTILES = (0.5, 0.9, 0.99)
#: A model of a snapshot: (level, tool, signature).
ModelKey = tuple[Level, str, str]
#: Newest expired turns whose expired-by quantiles are shown.
EXPIRED_BY_SAMPLES = 10_000


@dataclass(frozen=True)
class MissStats:
    """Returning turns by reason (enum order, only reasons with turns) and the
    expired-by quantiles ``(q, seconds)`` of the newest expired ones."""

    reasons: dict[MissReason, int]
    expired_by: list[tuple[float, float]]

    @property
    def returning(self) -> int:
        return sum(self.reasons.values())

    @property
    def missed(self) -> int:
        return sum(n for r, n in self.reasons.items() if r in MISSES)


@dataclass(frozen=True)
class MissesView:
    """The newest missed turns matching a query (their tool calls) and the summary by
    reason under the same tool and program filters."""

    turns: list[ToolCall]
    summary: MissStats


@dataclass(frozen=True)
class ToolView:
    tool: str
    sample_count: int
    seen_count: int
    quantiles_s: tuple[float, float, float]  # p50, p90, p99
    drift_epoch: int
    signatures: list[str]
    pins: PinCounts


@dataclass(frozen=True)
class DistributionView:
    tool: str
    signature: str
    basis: str
    sample_count: int
    seen_count: int
    drift_epoch: int
    quantiles: list[tuple[float, float]]  # (q, seconds)
    cdf: list[tuple[float, float]]  # (seconds, probability)
    pins: PinCounts
    sorted_samples_s: list[float] = field(repr=False, default_factory=list)


@dataclass(frozen=True)
class WorkloadView:
    eta: float
    queue_delay_s: float
    programs_completed: int
    programs_in_window: int
    tool_calls: int
    queue_samples: int


@dataclass(frozen=True)
class ModelView:
    tool: str
    signature: str
    level: str
    sorted_durations_s: list[float]
    summarized: bool
    sample_count: int
    drift_epoch: int


@dataclass(frozen=True)
class SnapshotView:
    version: int
    models: list[ModelView]
    eta: float
    queue_delay_s: float
    min_samples: int


#: What each ``basis`` of a decision means, as the console and the CLI say it.
BASIS_TEXT = {
    COLD_START: "the cold-start rule (durations ~ Exp(mean 1 s))",
    Level.INVOCATION.value: "this signature's own model",
    Level.TOOL.value: "the tool's model (all its signatures)",
    Level.TENANT.value: "the model of all the tenant's tools",
    Level.SHARED.value: "the tool's model shared across tenants",
}


def basis_text(basis: str) -> str:
    """What a decision's ``basis`` means; a blend (``invocation+tool``) names each part.

    >>> basis_text("all-tools")
    "the model of all the tenant's tools"
    >>> basis_text("invocation+tool")
    "a blend of this signature's own model and the tool's model (all its signatures)"
    """
    parts = [BASIS_TEXT.get(p, p) for p in basis.split("+")]
    return parts[0] if len(parts) == 1 else "a blend of " + " and ".join(parts)


@dataclass(frozen=True)
class ColdStart:
    """A model shown whose samples do not decide yet: it holds ``samples``, the back-off
    takes a level with ``needed`` (more than K) or more, and the TTL comes from ``basis``."""

    samples: int
    needed: int
    basis: str

    @property
    def text(self) -> str:
        return (
            f"cold start: {self.samples} of {self.needed} samples; "
            f"the TTL comes from {basis_text(self.basis)}"
        )


def cold_start(level: str, samples: int, min_samples: int, basis: str) -> ColdStart | None:
    """Whether the model of ``level`` (holding ``samples``) shown beside a decision of
    ``basis`` is still in its cold start: another level decided, and it holds at most
    ``min_samples``. (A thin level whose samples contradict its parent's decides alone,
    so its basis is its own level: not a cold start.)

    >>> cold_start("tool", 37, 100, "all-tools").text
    "cold start: 37 of 101 samples; the TTL comes from the model of all the tenant's tools"
    >>> cold_start("tool", 37, 100, "tool") is None, cold_start("tool", 101, 100, "shared")
    (True, None)
    """
    if basis == level or samples > min_samples:
        return None
    return ColdStart(samples, min_samples + 1, basis)


def _quantiles(model: DurationModel) -> tuple[float, float, float]:
    q50, q90, q99 = (model.quantile(q) for q in QUANTILES)
    return q50, q90, q99


def list_tools(
    state: ModelState, tenant: str, tools: Sequence[str] | None = None
) -> list[ToolView]:
    """The tenant's tools (or those of ``tools`` it has), sorted by name.

    Linear in the tenant's own tools and signatures (the state indexes them per tenant),
    so callers can list a large tenant a slice of ``tools`` at a time.
    """
    durations = state.models.durations
    views = []
    for tool in state.tools_of(tenant) if tools is None else tools:
        model = durations.model(Level.TOOL, tool, None, tenant)
        if model is None:
            continue
        views.append(
            ToolView(
                tool,
                model.n_samples,
                model.n_seen,
                _quantiles(model),
                model.drift_epoch,
                state.signatures_of(tenant, tool),
                state.pin_counts(tenant, tool),
            )
        )
    return views


def distribution(
    state: ModelState, tenant: str, tool: str, args: str, points: int
) -> DistributionView | None:
    """One tool's (or, with ``args``, one invocation's) distribution; None if unknown."""
    durations = state.models.durations
    level, model = Level.TOOL, durations.model(Level.TOOL, tool, None, tenant)
    signature = ""
    if args:
        invocation = durations.model(Level.INVOCATION, tool, args, tenant)
        if invocation is not None:
            level, model = Level.INVOCATION, invocation
            signature = durations.signatures.signature(tool, args)
    if model is None:
        return None
    samples = model.sorted_samples()
    cdf: list[tuple[float, float]] = []
    if samples.size:
        idx = np.unique(np.linspace(0, samples.size - 1, max(points, 2)).round().astype(int))
        cdf = [(float(samples[i]), model.cdf(float(samples[i]))) for i in idx]
    return DistributionView(
        tool,
        signature,
        level.value,
        model.n_samples,
        model.n_seen,
        model.drift_epoch,
        [(q, model.quantile(q)) for q in (0.1, 0.25, *QUANTILES)],
        cdf,
        state.pin_counts(tenant, tool),
        [float(x) for x in samples],
    )


def _nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (sorted), nearest rank: the smallest value with at
    least q of the values at or below it."""
    return values[max(0, math.ceil(q * len(values)) - 1)]


def miss_stats(
    store: Store, tenant: str, tool: str | None = None, program: str | None = None
) -> MissStats:
    """The tenant's returning turns by reason (of one tool and program when given).

    >>> from controlplane.storage.memory import MemoryStore
    >>> miss_stats(MemoryStore(), "acme")
    MissStats(reasons={}, expired_by=[])
    """
    counts = store.miss_counts(tenant, tool, program)
    late = sorted(store.expired_by(tenant, tool, program, EXPIRED_BY_SAMPLES))
    quantiles = [(q, _nearest_rank(late, q)) for q in QUANTILES] if late else []
    return MissStats({r: counts[r] for r in MissReason if r in counts}, quantiles)


def compacted(store: Store) -> str:
    """Which turns the miss counts and lists no longer see ('' if the log is whole): they
    read the log's rows, which compaction deletes, while the models learned every row."""
    mark = store.log_compaction()
    if mark is None:
        return ""
    if mark.cutoff is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(mark.cutoff))
        return f"turns received before {when}"
    return f"each tenant's turns before its newest {mark.keep_rows}"


def misses(store: Store, tenant: str, query: MissQuery) -> MissesView:
    """The newest missed turns matching ``query`` and the summary by reason."""
    turns = [row.call for row in store.list_misses(tenant, query)]
    return MissesView(turns, miss_stats(store, tenant, query.tool, query.program))


def workload(state: ModelState, tenant: str) -> WorkloadView:
    """η, T and counts of one tenant."""
    stats = state.models.workload(tenant)
    return WorkloadView(
        stats.eta.get(),
        stats.queue.get(),
        state.programs.get(tenant, 0),
        stats.eta.n_programs,
        state.tool_calls.get(tenant, 0),
        stats.queue.n_samples,
    )


def _model_view(tool: str, signature: str, level: Level, model: DurationModel) -> ModelView:
    samples = model.sorted_samples()
    # Shared models are always summaries (published quantiles, controlplane.sharing).
    thinned = samples.size > SNAPSHOT_MAX_POINTS
    summarized = thinned or level is Level.SHARED
    if thinned:
        idx = np.linspace(0, samples.size - 1, SNAPSHOT_MAX_POINTS).round().astype(int)
        samples = samples[idx]
    return ModelView(
        tool,
        signature,
        level.value,
        [float(x) for x in samples],
        summarized,
        model.n_samples,
        model.drift_epoch,
    )


def snapshot_keys(state: ModelState, tenant: str, share: bool) -> list[ModelKey]:
    """Which models a tenant's snapshot holds: its pool of all tools, the published shared
    models if it shares, then its tools, each followed by its invocations."""
    keys: list[ModelKey] = [(Level.TENANT, "", "")]
    if share:
        keys += [(Level.SHARED, tool, "") for tool in sorted(state.shared.tools)]
    for tool in state.tools_of(tenant):
        keys.append((Level.TOOL, tool, ""))
        keys += [(Level.INVOCATION, tool, s) for s in state.signatures_of(tenant, tool)]
    return keys


def stored_model(state: ModelState, tenant: str, key: ModelKey) -> DurationModel | None:
    """The model behind one snapshot key, if it has one."""
    level, tool, signature = key
    scope = "shared" if level is Level.SHARED else f"t:{tenant}"
    # DurationHierarchy looks models up by arguments only; the key layout is its own
    # (scope, tool, signature), read here so that a snapshot never re-parses arguments.
    return state.models.durations._models.get((scope, tool, signature))


def model_view(key: ModelKey, model: DurationModel) -> ModelView:
    level, tool, signature = key
    return _model_view(tool, signature, level, model)


def snapshot(state: ModelState, tenant: str, share: bool) -> SnapshotView:
    """Every model the tenant's decisions may use, compactly (all at once)."""
    views = []
    for key in snapshot_keys(state, tenant, share):
        model = stored_model(state, tenant, key)
        if model is not None:
            views.append(model_view(key, model))
    stats = state.models.workload(tenant)
    return SnapshotView(
        state.tenant_version(tenant, share),
        views,
        stats.eta.get(),
        stats.queue.get(),
        state.models.durations.min_samples,
    )
