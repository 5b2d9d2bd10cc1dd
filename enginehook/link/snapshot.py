"""Turn a control-plane model snapshot (``WatchSnapshots``) into local estimator models.

A snapshot carries, per model level, the window's sorted durations (or, compact, a
quantile summary of it: :mod:`estimator.sketch`), plus η, T and the back-off threshold.
:func:`models_from_snapshot` rebuilds a :class:`estimator.DurationHierarchy` from them
(without drift detection: the samples arrive sorted; a compact model becomes a
:class:`~estimator.sketch.SketchModel` holding the window's true sample count) and keeps
the engine's own cost model, which learns from local prefill timings.

Every reply also carries the tenant's rollout while one is set (which tools its engines
pin, :mod:`enginehook.core.rollout`): :attr:`SnapshotData.rollout`, ``None`` when the
reply has none (none set, or a server from before rollouts).

A compact stream sends one full snapshot, then deltas: :class:`SnapshotFollower` holds
the models received and merges each delta into them, and refuses
(:class:`MissedDeltaError`) a delta whose base is not the version and lineage it holds, so
that the link asks again for a full snapshot.

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

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from controlplane.records import Rollout, RolloutMode
from estimator import DurationHierarchy, Level, Models, TtlPolicy
from estimator.signatures import SignatureRegistry, readable_rules
from estimator.sketch import SketchModel, decode_points
from estimator.workload import MemoryFactor, QueueDelay, RemainingTurns

if TYPE_CHECKING:
    from controlplane.rpc.client import ControlPlaneClient

__all__ = [
    "MissedDeltaError",
    "SnapshotData",
    "SnapshotFollower",
    "SnapshotModel",
    "follow",
    "models_from_snapshot",
    "rollout_of",
]


@dataclass(frozen=True, slots=True)
class SnapshotModel:
    """One duration model of a snapshot (``level``: a :class:`estimator.Level` value)."""

    tool: str
    signature: str
    level: str
    sorted_durations_s: list[float]
    sample_count: int
    #: The durations are a quantile summary (ranks ⌈i·n/K⌉) of ``sample_count`` samples.
    quantile_sketch: bool = False
    drift_epoch: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.level, self.tool, self.signature)


@dataclass(frozen=True, slots=True)
class SnapshotData:
    """A snapshot, independent of the wire format."""

    version: int
    models: list[SnapshotModel] = field(default_factory=list)
    eta: float = 1.0
    queue_delay_s: float = 0.0
    min_samples: int = 100
    #: A delta: ``models`` are only those changed since ``base_version`` of ``lineage``.
    delta: bool = False
    base_version: int = 0
    lineage: int = 0
    #: The tenant's rollout (every reply carries it, deltas too); ``None``: none.
    rollout: Rollout | None = None
    #: The server's signature rules (``TOOL=KIND``, every reply carries them): the engine
    #: derives signatures as the server does (:mod:`estimator.signatures`).
    signature_rules: tuple[str, ...] = ()


def rollout_of(reply: object) -> Rollout | None:
    """The rollout a ``WatchSnapshotsResponse`` carries, or ``None`` (unset, or a mode
    this engine does not know: its own setting applies, and the reply is otherwise used).

    >>> from controlplane._gen.cachettl.v1 import model_pb2
    >>> wire = model_pb2.WatchSnapshotsResponse(
    ...     rollout=model_pb2.Rollout(mode=model_pb2.ROLLOUT_MODE_ONLY, tools=["bash"]))
    >>> rollout_of(wire).describe(), rollout_of(model_pb2.WatchSnapshotsResponse())
    ('only bash', None)
    """
    if not reply.HasField("rollout"):  # type: ignore[attr-defined]
        return None
    wire = reply.rollout  # type: ignore[attr-defined]
    try:
        return Rollout.of(RolloutMode.parse(int(wire.mode)), list(wire.tools))
    except ValueError:
        return None


class MissedDeltaError(Exception):
    """A delta built on a version or lineage the follower does not hold."""


class SnapshotFollower:
    """The models of a compact stream as received so far: full snapshots replace them,
    deltas update them (see the module docstring).

    >>> f = SnapshotFollower()
    >>> m = SnapshotModel("bash", "", "tool", [0.1, 0.2], 2, True)
    >>> f.apply(SnapshotData(4, [m], lineage=9)).version
    4
    >>> m2 = SnapshotModel("bash", "", "tool", [0.3], 1, True)
    >>> d = f.apply(SnapshotData(6, [m2], delta=True, base_version=4, lineage=9))
    >>> d.delta, [x.sorted_durations_s for x in d.models]
    (False, [[0.3]])
    >>> f.apply(SnapshotData(9, [], delta=True, base_version=7, lineage=9))
    Traceback (most recent call last):
    ...
    enginehook.link.snapshot.MissedDeltaError: delta on 7 (lineage 9); holding 6 (lineage 9)
    """

    def __init__(self, compact: bool = True) -> None:
        #: Whether to ask for compact models and deltas.
        self.compact = compact
        self.version = 0
        self.lineage = 0
        self._models: dict[tuple[str, str, str], SnapshotModel] = {}

    def apply(self, snap: SnapshotData) -> SnapshotData:
        """The whole snapshot after ``snap``; raises :class:`MissedDeltaError` (holding what it
        held, and forgetting its lineage so that the next request asks for a full one)."""
        if snap.delta:
            if (snap.base_version, snap.lineage) != (self.version, self.lineage):
                held = f"holding {self.version} (lineage {self.lineage})"
                self.lineage = 0
                raise MissedDeltaError(
                    f"delta on {snap.base_version} (lineage {snap.lineage}); {held}"
                )
            models = dict(self._models)
        else:
            models = {}
        for model in snap.models:
            models[model.key] = model
        self._models = models
        self.version, self.lineage = snap.version, snap.lineage
        return replace(snap, models=list(models.values()), delta=False, base_version=0)


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
    signatures = SignatureRegistry(rules=readable_rules(snapshot.signature_rules))
    hierarchy = DurationHierarchy(
        min_samples=snapshot.min_samples, forget_on_drift=False, signatures=signatures
    )
    for model in snapshot.models:
        level = Level(model.level)
        if level is Level.INVOCATION and not model.signature:
            continue
        if model.quantile_sketch:
            sketch = SketchModel.of(
                model.sorted_durations_s,
                model.sample_count,
                drift_epoch=model.drift_epoch,
                window=hierarchy.window,  # what it keeps once it learns locally
            )
            hierarchy.install(level, sketch, model.tool, model.signature, tenant)
            continue
        hierarchy.restore(
            level,
            model.sorted_durations_s,
            tool=model.tool,
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


def follow(
    client: ControlPlaneClient, after_version: int, follower: SnapshotFollower
) -> Iterator[SnapshotData]:
    """Whole snapshots from ``client``'s ``WatchSnapshots`` stream, compact (deltas merged
    by ``follower``) unless the server refuses the compact request as unknown (a control
    plane older than it): then raw windows, as before, from then on. A delta that does not
    build on what ``follower`` holds raises :class:`MissedDeltaError`; the next call asks
    for a full snapshot."""
    import grpc

    from controlplane.wire import seconds

    lineage = follower.lineage if follower.version == after_version else 0
    stream = client.watch_snapshots(after_version, compact=follower.compact, lineage=lineage)
    try:
        for r in stream:
            models = [
                SnapshotModel(
                    m.tool_name,
                    m.signature,
                    m.level,
                    decode_points(m.log_steps).tolist()
                    if m.log_steps
                    else list(m.sorted_durations_seconds),
                    m.sample_count,
                    m.quantile_sketch,
                    m.drift_epoch,
                )
                for m in r.models
            ]
            delay = seconds(r.queue_delay)
            snap = SnapshotData(
                r.version,
                models,
                r.eta,
                delay,
                r.min_samples,
                r.delta,
                r.base_version,
                r.lineage,
                rollout_of(r),
                tuple(r.signature_rules),
            )
            yield follower.apply(snap) if follower.compact else snap
    except grpc.RpcError as error:
        if follower.compact and error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            follower.compact = False  # an older server: whole snapshots of raw windows
        raise
