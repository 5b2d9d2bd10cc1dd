"""Turn a control-plane model snapshot (``WatchSnapshots``) into local estimator models.

A snapshot carries, per model level, the window's sorted durations, plus η, T and the
back-off threshold. :func:`models_from_snapshot` rebuilds a
:class:`estimator.DurationHierarchy` from them (without drift detection: the samples
arrive sorted) and keeps the engine's own cost model, which learns from local prefill
timings.

>>> from estimator import get_policy
>>> snap = SnapshotData(
...     version=3,
...     models=[SnapshotModel("bash", "", "tool", [0.1, 0.2, 0.3], 3)],
...     eta=1.0, queue_delay_s=0.5, min_samples=2)
>>> models = models_from_snapshot(snap, get_policy("continuum"), tenant="acme")
>>> models.durations.lookup("bash", None, "acme").level.value
'tool'
>>> models.workload("acme").queue.get()
0.5
"""

from __future__ import annotations

from dataclasses import dataclass, field

from estimator import DurationHierarchy, Level, Models, TtlPolicy
from estimator.workload import MemoryFactor, QueueDelay, RemainingTurns

__all__ = ["SnapshotData", "SnapshotModel", "models_from_snapshot"]


@dataclass(frozen=True, slots=True)
class SnapshotModel:
    """One duration model of a snapshot (``level``: a :class:`estimator.Level` value)."""

    tool_name: str
    signature: str
    level: str
    sorted_durations_s: list[float]
    sample_count: int


@dataclass(frozen=True, slots=True)
class SnapshotData:
    """A snapshot, independent of the wire format."""

    version: int
    models: list[SnapshotModel] = field(default_factory=list)
    eta: float = 1.0
    queue_delay_s: float = 0.0
    min_samples: int = 100


class _SnapshotEta(MemoryFactor):
    """η as the control plane computed it (local updates are kept but not used)."""

    def __init__(self, window: int = 256, value: float = 1.0) -> None:
        super().__init__(window)
        self.value = value

    def get(self) -> float:
        return self.value


class _SnapshotQueueDelay(QueueDelay):
    """T as the control plane computed it."""

    def __init__(self, window: int = 256, value: float = 0.0) -> None:
        super().__init__(window)
        self.value = value

    def get(self) -> float:
        return self.value


def models_from_snapshot(
    snapshot: SnapshotData,
    policy: TtlPolicy,
    *,
    tenant: str = "default",
    base: Models | None = None,
) -> Models:
    """Models that decide as the control plane's would, with ``base``'s cost model."""
    hierarchy = DurationHierarchy(min_samples=snapshot.min_samples, forget_on_drift=False)
    for model in snapshot.models:
        level = Level(model.level)
        if level is Level.INVOCATION and not model.signature:
            continue
        hierarchy.restore(
            level,
            model.sorted_durations_s,
            tool=model.tool_name,
            signature=model.signature,
            tenant=tenant,
            n_seen=model.sample_count,
        )
    fresh = policy.new_models(min_samples=snapshot.min_samples)
    models = Models(hierarchy, base.cost if base is not None else fresh.cost)
    stats = models.workload(tenant)
    stats.eta = _SnapshotEta(models.program_window, snapshot.eta)
    stats.queue = _SnapshotQueueDelay(models.queue_window, snapshot.queue_delay_s)
    if base is not None:
        stats.remaining = base.workload(tenant).remaining
    else:
        stats.remaining = RemainingTurns(models.program_window)
    return models
