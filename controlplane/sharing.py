"""What sharing tenants learn from each other: published, k-anonymous, quantised models.

Every sharing tenant's tool calls feed one exact window per tool (``SharedTool.raw``) that
no RPC ever reads. Decisions (basis ``shared``) and snapshots see only the *published*
model of a tool: a fresh model of at most ``points`` quantiles of that window, each
rounded to a logarithmic grid, installed into the hierarchy's ``shared`` level. A tool
is published again once ``refresh_every`` samples arrived since the last publication,
and only when both its whole window and the samples added since the last publication are
*anonymous*: for every tenant that might look (each contributor, and anyone else), the
other tenants' samples come from at least ``min_tenants`` tenants and none of them holds
more than ``max_share`` of those samples. Publications are a function of the log, so
every server (and every replay) publishes the same models at the same positions.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from estimator import DurationHierarchy, DurationModel, Level

__all__ = ["SharedModels", "SharedTool", "SharingRules", "anonymous", "quantised"]


@dataclass(frozen=True)
class SharingRules:
    """When a shared model may be shown, and how coarsely."""

    #: Distinct tenants, other than the one looking, whose samples a published model holds.
    min_tenants: int = 3
    #: Largest fraction of those other tenants' samples that one tenant may hold.
    max_share: float = 0.5
    #: New samples of a tool between two publications of its shared model.
    refresh_every: int = 64
    #: Most quantile points a published model holds.
    points: int = 256
    #: Relative step of the logarithmic grid published durations are rounded to.
    grid: float = 0.05

    def __post_init__(self) -> None:
        if self.min_tenants < 1:
            raise ValueError(f"min_tenants must be >= 1, got {self.min_tenants!r}")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {self.max_share!r}")
        if self.refresh_every < 1 or self.points < 2 or self.grid <= 0.0:
            raise ValueError("refresh_every >= 1, points >= 2 and grid > 0 are required")


def anonymous(counts: Counter[str], rules: SharingRules) -> bool:
    """Whether samples with these per-tenant counts hide every tenant (see module doc)."""
    if len(counts) < rules.min_tenants:
        return False
    total = sum(counts.values())
    ranked = counts.most_common(2)
    viewers: list[tuple[str | None, int]] = [(None, 0), *counts.items()]
    for viewer, own in viewers:
        others = total - own
        largest = ranked[1][1] if viewer == ranked[0][0] else ranked[0][1]
        distinct = len(counts) - (viewer is not None)
        if distinct < rules.min_tenants or largest > rules.max_share * others:
            return False
    return True


def quantised(sorted_samples: np.ndarray, rules: SharingRules) -> list[float]:
    """At most ``rules.points`` evenly spaced quantiles, rounded to the log grid, in a
    fixed shuffled order (a model fed sorted values would see a drift)."""
    n = int(sorted_samples.size)
    m = min(n, rules.points)
    idx = np.linspace(0, n - 1, m).round().astype(int)
    step = math.log1p(rules.grid)
    values = sorted_samples[idx]
    positive = values > 1e-6
    rounded = np.zeros(m)
    rounded[positive] = np.exp(np.round(np.log(values[positive]) / step) * step)
    order = np.random.default_rng(0).permutation(m)
    return [float(x) for x in rounded[order]]


@dataclass
class SharedTool:
    """One tool's exact cross-tenant window and who contributed what to it."""

    raw: DurationModel
    #: Tenant of each sample in ``raw``'s window, oldest first.
    owners: deque[str] = field(default_factory=deque)
    window: Counter[str] = field(default_factory=Counter)
    #: Samples added since the last publication, per tenant.
    fresh: Counter[str] = field(default_factory=Counter)

    def add(self, tenant: str, duration_s: float) -> None:
        self.raw.update(duration_s)
        self.owners.append(tenant)
        self.window[tenant] += 1
        self.fresh[tenant] += 1
        while len(self.owners) > self.raw.n_samples:  # the window keeps the newest samples
            gone = self.owners.popleft()
            self.window[gone] -= 1
            if not self.window[gone]:
                del self.window[gone]


@dataclass
class SharedModels:
    """Every tool's shared window and the count of publications (part of versions)."""

    rules: SharingRules = field(default_factory=SharingRules)
    tools: dict[str, SharedTool] = field(default_factory=dict)
    publications: int = 0

    def record(self, hierarchy: DurationHierarchy, tool: str, tenant: str, duration: float) -> bool:
        """Learn one sharing tenant's call; True if it published the tool's model."""
        shared = self.tools.get(tool)
        if shared is None:
            prototype = DurationModel(hierarchy.window, hierarchy.forget_on_drift)
            shared = self.tools[tool] = SharedTool(prototype)
        shared.add(tenant, duration)
        rules = self.rules
        if sum(shared.fresh.values()) < rules.refresh_every:
            return False
        if not (anonymous(shared.fresh, rules) and anonymous(shared.window, rules)):
            return False
        hierarchy.restore(Level.SHARED, quantised(shared.raw.sorted_samples(), rules), tool)
        shared.fresh.clear()
        self.publications += 1
        return True

    def published(self, hierarchy: DurationHierarchy) -> list[tuple[str, DurationModel]]:
        """The published shared models, sorted by tool."""
        out = []
        for tool in sorted(self.tools):
            model = hierarchy.model(Level.SHARED, tool)
            if model is not None:
                out.append((tool, model))
        return out
