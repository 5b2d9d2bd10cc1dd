"""Serialized ``WatchSnapshots`` replies, built incrementally and a slice at a time.

Two kinds. Engines that ask for ``compact`` snapshots get :class:`CompactSnapshots`: each
model as a 128-point quantile summary (``estimator.sketch``, about 175 bytes), one full
snapshot, then deltas of the models whose summary moved; their decisions stay within a
stated bound of the raw-duration ones (the class docstring). Clients that do not ask get
whole snapshots of raw windows, :class:`SnapshotPayloads`, as follows.

A tenant's snapshot is its models (``inspection.snapshot_keys``) as ``ToolModel``
messages. Each model's message is serialized once and kept until the model changes
(same object, same ``n_seen``, same number of points); a reply is the header's bytes
followed by every model's bytes, which protobuf parses as one message (concatenated
messages merge, repeated fields append). The model lock is held for about
``lock_slice_s`` at a time, so a snapshot of a tenant with ten thousand tools never
stalls decisions.

Sizes are bounded by construction: a snapshot holds at most ``SNAPSHOT_POINTS``
durations over all its models (each model at most ``inspection.SNAPSHOT_MAX_POINTS``,
at least ``MIN_POINTS_PER_MODEL``; a window longer than its share is sent as evenly
spaced quantiles, ``summarized``). A tenant at the default name caps (1,000 tools,
10,000 signatures: 11,001 models) gets 23 points per model, about 2.7 MB with names of
twenty characters and at most 13.8 MB with every name at its 128-character limit in
4-byte UTF-8, under ``MAX_SNAPSHOT_BYTES`` (32 MiB), the receive limit of every
``ControlPlaneClient`` channel and the server's send limit. A reply that would still
pass it (thousands of published shared tools) is refused with ``OverloadedError``
naming the sizes (the stream ends RESOURCE_EXHAUSTED), never cut short.

Every reply's header also carries the tenant's rollout while one is set (which tools its
engines pin, :mod:`controlplane.storage.rollouts`), deltas too. The version a tenant is
told is its models' version plus its rollout's (:class:`RolloutBoard`): both only grow,
so a change of the rollout is a new version, sent to every stream as any other.

A written snapshot (``dumps_off_process``) is pickled by a forked child process from its
copy-on-write image of the state, so the serving process's interpreter lock is held only
for the ``fork`` itself: decisions are not slowed by pickling thousands of models.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import signal
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from controlplane import inspection
from controlplane._gen.cachettl.v1 import model_pb2
from controlplane.errors import OverloadedError
from controlplane.state import ModelState, in_slices
from controlplane.storage.base import Store
from controlplane.storage.rollouts import Rollout, StoredRollout
from controlplane.wire import duration
from estimator import DurationModel, Level
from estimator.sketch import (
    DEFAULT_POINTS,
    cdf_distance,
    encode_points,
    sketch_points,
)

__all__ = [
    "MAX_SNAPSHOT_BYTES",
    "MIN_POINTS_PER_MODEL",
    "RESEND",
    "SNAPSHOT_POINTS",
    "CompactSnapshots",
    "RolloutBoard",
    "SnapshotPayloads",
    "dumps_off_process",
    "in_slices",
    "points_per_model",
    "rollout_message",
]

log = logging.getLogger(__name__)

#: The largest ``WatchSnapshotsResponse``: the server's send limit and the receive limit
#: of every ``ControlPlaneClient`` channel (gRPC's default receive limit is 4 MiB).
MAX_SNAPSHOT_BYTES = 32 * 1024 * 1024
#: Durations a snapshot holds at most over all its models (2 MiB of doubles).
SNAPSHOT_POINTS = 262_144
#: The fewest points a model with that many samples is sent with, however many models.
MIN_POINTS_PER_MODEL = 16

#: How far (sup |H − F|) a model's window may move from the summary engines hold before
#: the summary is sent again (compact snapshots: decisions within (2·RESEND + 2⁻¹⁰)·B).
RESEND = 1.0 / 64

#: How long a forked child may take to pickle the state before it is killed and the
#: state is pickled in this process instead.
CHILD_TIMEOUT_S = 120.0

# (model, its n_seen, its points, serialized ToolModel field)
_Entry = tuple[DurationModel, int, int, bytes]


def points_per_model(models: int) -> int:
    """Points each model of a snapshot of ``models`` models is sent with at most.

    >>> points_per_model(1), points_per_model(1_201), points_per_model(11_001)
    (512, 218, 23)
    >>> points_per_model(100_000)
    16
    """
    share = SNAPSHOT_POINTS // max(1, models)
    return max(MIN_POINTS_PER_MODEL, min(inspection.SNAPSHOT_MAX_POINTS, share))


class RolloutBoard:
    """The tenants' rollouts as this server last read them from the store.

    :meth:`refresh` reads them all (one small row per tenant that ever had one; off the
    event loop, with each round of the log's tail); the rest reads what it holds. A
    tenant's :meth:`version` only grows (the store raises it with every change), so the
    version a tenant is told, its models' plus its rollout's, only grows too.

    >>> from controlplane.storage.memory import MemoryStore
    >>> store, board = MemoryStore(), RolloutBoard()
    >>> _ = store.create_tenant("acme", False, "h", 0.0)
    >>> _ = store.set_rollout("acme", Rollout.of("only", ["bash"]), 1.0)
    >>> board.version("acme"), board.refresh(store), board.version("acme")
    (0, 1, 1)
    >>> rollout_message(board.get("acme").rollout).tools
    ['bash']
    """

    def __init__(self) -> None:
        self._rows: dict[str, StoredRollout] = {}

    def refresh(self, store: Store) -> int:
        """Read every tenant's rollout; how many changed since the last read."""
        rows = {row.tenant: row for row in store.rollouts()}
        changed = sum(1 for name, row in rows.items() if self._rows.get(name) != row)
        self._rows = rows  # replaced whole: readers see the old or the new rows
        return changed

    def get(self, tenant: str) -> StoredRollout | None:
        """The tenant's rollout row (``None``: it never had one)."""
        return self._rows.get(tenant)

    def version(self, tenant: str) -> int:
        """The tenant's rollout version (0: it never had one)."""
        row = self._rows.get(tenant)
        return row.version if row is not None else 0


def rollout_message(rollout: Rollout | None) -> model_pb2.Rollout | None:
    """The wire form of a tenant's rollout; ``None`` when it has none (the field stays
    unset: its engines apply their own setting)."""
    if rollout is None:
        return None
    mode = int(rollout.mode)
    return model_pb2.Rollout(mode=mode, tools=list(rollout.tools))  # type: ignore[arg-type]


def _version(state: ModelState, tenant: str, share: bool, rollout: StoredRollout | None) -> int:
    """What ``tenant`` is told: its models' version plus its rollout's."""
    return state.tenant_version(tenant, share) + (rollout.version if rollout is not None else 0)


def _model_field(key: inspection.ModelKey, model: DurationModel, points: int) -> bytes:
    level, tool, signature = key
    samples = model.sorted_samples()
    thinned = samples.size > points
    if thinned:
        samples = samples[np.linspace(0, samples.size - 1, points).round().astype(int)]
    message = model_pb2.ToolModel(
        tool_name=tool,
        signature=signature,
        level=level.value,
        sorted_durations_seconds=samples.tolist(),
        # Shared models are always summaries (published quantiles, controlplane.sharing).
        summarized=thinned or level is Level.SHARED,
        sample_count=model.n_samples,
        drift_epoch=model.drift_epoch,
    )
    return model_pb2.WatchSnapshotsResponse(models=[message]).SerializeToString()


class SnapshotPayloads:
    """Per-tenant caches of serialized models; thread-safe for different tenants."""

    def __init__(self, lock_slice_s: float = 0.002, max_bytes: int = MAX_SNAPSHOT_BYTES) -> None:
        self.lock_slice_s = lock_slice_s
        self.max_bytes = max_bytes
        self.encodings = 0  # replies joined (the server builds one per tenant and version)
        self._entries: dict[str, dict[inspection.ModelKey, _Entry]] = {}

    def build(
        self,
        state: ModelState,
        lock: threading.RLock,
        tenant: str,
        share: bool,
        rollout: StoredRollout | None = None,
    ) -> tuple[int, bytes]:
        """``(version, serialized WatchSnapshotsResponse)`` of ``tenant``'s models and
        ``rollout`` (its row in the :class:`RolloutBoard`).

        The version is read first, so the reply holds at least that version's models.
        Raises ``OverloadedError`` if the reply would pass ``max_bytes``.
        """
        with lock:
            keys = inspection.snapshot_keys(state, tenant, share)
            stats = state.models.workload(tenant)
            header = model_pb2.WatchSnapshotsResponse(
                version=_version(state, tenant, share, rollout),
                eta=stats.eta.get(),
                queue_delay=duration(stats.queue.get(), "queue_delay"),
                min_samples=state.models.durations.min_samples,
                signature_rules=signature_rules(state),
                rollout=rollout_message(rollout.rollout if rollout is not None else None),
            )
        points = points_per_model(len(keys))
        old = self._entries.get(tenant, {})
        new: dict[inspection.ModelKey, _Entry] = {}
        parts = [header.SerializeToString()]

        def add(key: inspection.ModelKey) -> None:
            model = inspection.stored_model(state, tenant, key)
            if model is None:
                return
            entry = old.get(key)
            if entry is None or entry[0] is not model or entry[1:3] != (model.n_seen, points):
                entry = (model, model.n_seen, points, _model_field(key, model, points))
            new[key] = entry
            parts.append(entry[3])

        in_slices(lock, keys, add, self.lock_slice_s)
        self._entries[tenant] = new
        size = sum(map(len, parts))
        if size > self.max_bytes:
            raise OverloadedError(
                f"snapshot: {len(new)} models make {size} bytes, over the limit of "
                f"{self.max_bytes} bytes per message"
            )
        self.encodings += 1
        return header.version, b"".join(parts)

    def forget(self, tenant: str) -> int:
        """Drop a tenant's cache (its last stream ended); the serialized bytes it held."""
        entries = self._entries.pop(tenant, {})
        return sum(len(entry[3]) for entry in entries.values())

    def held_bytes(self) -> int:
        """Serialized bytes the caches hold, all tenants (a reply joins them: one copy
        per tenant's version, ``controlplane.rpc.servicer``)."""
        return sum(len(e[3]) for entries in list(self._entries.values()) for e in entries.values())


def dumps_off_process(
    state: ModelState, lock: threading.RLock, timeout_s: float = CHILD_TIMEOUT_S
) -> tuple[bytes, int, int]:
    """``state.dumps(lock)``, pickled by a forked child: ``(payload, tool_seq, end_seq)``.

    The child is forked under ``lock`` (so its image holds whole batches) and writes
    the pickle to a pipe; this process only reads it (``os.read`` releases the GIL).
    The child touches nothing but the state and the pipe and leaves with ``os._exit``
    (no finalizers, no sockets closed). Where ``fork`` is missing, or the child fails or
    passes ``timeout_s``, the state is pickled here, a slice at a time, as before.
    """
    if not hasattr(os, "fork"):
        return state.dumps(lock)
    read_fd, write_fd = os.pipe()
    with lock:
        seqs = state.tool_seq, state.end_seq
        pid = os.fork()
    if pid == 0:  # the child: pickle, write, leave
        status = 1
        try:
            os.close(read_fd)
            with os.fdopen(write_fd, "wb") as out:
                out.write(state.dumps()[0])
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    payload = _read_child(read_fd, pid, timeout_s)
    if payload is None:
        log.warning("snapshot child failed or timed out; pickling in this process")
        return state.dumps(lock)
    return payload, *seqs


def _read_child(fd: int, pid: int, timeout_s: float) -> bytes | None:
    """Everything the child writes to ``fd``; None if it fails or passes ``timeout_s``."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    return b"".join(chunks) if status == 0 else None


# -- compact snapshots and deltas -----------------------------------------------------------


@dataclass
class _Published:
    """One model's summary as the table last published it."""

    model: DurationModel  # the model object last checked, and its n_seen then
    seen: int
    points: np.ndarray
    count: int
    epoch: int
    version: int  # the table version that published it
    field: bytes  # serialized WatchSnapshotsResponse(models=[its ToolModel])


def signature_rules(state: ModelState) -> tuple[str, ...]:
    """The operator's signature rules of ``state``'s models, as every reply carries them."""
    return state.models.durations.signatures.key[1]


@dataclass
class _Table:
    """A tenant's published summaries: deltas build on any version from ``start`` on."""

    lineage: int
    start: int
    version: int = -1
    #: η, T, min_samples, the signature rules, the tenant's rollout.
    header: tuple[float, float, int, tuple[str, ...], Rollout | None] = (1.0, 0.0, 0, (), None)
    entries: dict[inspection.ModelKey, _Published] = field(default_factory=dict)
    replies: dict[int, bytes] = field(default_factory=dict)  # base (0: full) -> reply


class CompactSnapshots:
    """Per-tenant tables of compact model summaries, and the full or delta replies
    built from them; thread-safe for different tenants (one :meth:`update` at a time per
    tenant, :meth:`reply` from any thread).

    A model is summarised by ``points`` samples (:mod:`estimator.sketch`: its CDF is below
    the window's by less than 1/K; on the wire as steps of a grid, rounded up by less than
    a factor 1 + 2⁻¹⁰) and published again only when the window has moved
    more than ``resend`` from the summary engines hold (sup |H − F|, checked whenever the
    model learned), when its drift epoch changes, or when it crosses the back-off
    threshold. So every engine's CDF, before the wire's rounding, stays within
    ``resend`` of the server's, and its decisions within (2·resend + 2⁻¹⁰)·B of the
    raw-duration optimum. A delta holds the models
    published after the client's base version; the header (η, T, the threshold) rides in
    every reply.
    """

    def __init__(
        self, lock_slice_s: float = 0.002, points: int = DEFAULT_POINTS, resend: float = RESEND
    ) -> None:
        if resend < 1.0 / points:
            raise ValueError(f"resend must be >= 1/points = {1.0 / points:g}, got {resend!r}")
        self.lock_slice_s = lock_slice_s
        self.points = points
        self.resend = resend
        self._tables: dict[str, _Table] = {}

    def update(
        self,
        state: ModelState,
        lock: threading.RLock,
        tenant: str,
        share: bool,
        rollout: StoredRollout | None = None,
    ) -> int:
        """Bring ``tenant``'s table up to the models' version now and ``rollout`` (its
        row in the :class:`RolloutBoard`); that version."""
        with lock:
            version = _version(state, tenant, share, rollout)
            keys = inspection.snapshot_keys(state, tenant, share)
            stats = state.models.workload(tenant)
            header = (
                stats.eta.get(),
                stats.queue.get(),
                state.models.durations.min_samples,
                signature_rules(state),
                rollout.rollout if rollout is not None else None,
            )
        old = self._tables.get(tenant)
        if old is not None and old.version == version and old.header == header:
            return version
        if old is None:
            old = _Table(lineage=secrets.randbits(53) or 1, start=version)
        entries: dict[inspection.ModelKey, _Published] = {}
        threshold = header[2]

        def check(key: inspection.ModelKey) -> None:
            model = inspection.stored_model(state, tenant, key)
            if model is None:
                return
            entry = old.entries.get(key)
            if entry is not None and entry.model is model and entry.seen == model.n_seen:
                entries[key] = entry
                return
            samples, n = model.sorted_samples(), model.n_samples
            if (
                entry is not None
                and entry.epoch == model.drift_epoch
                and (entry.count > threshold) == (n > threshold)
                and cdf_distance(entry.points, entry.count, samples, self.points) <= self.resend
            ):
                entries[key] = replace(entry, model=model, seen=model.n_seen)
                return
            points = sketch_points(samples, self.points)
            wire = _compact_field(key, model, encode_points(points))
            entries[key] = _Published(
                model, model.n_seen, points, n, model.drift_epoch, version, wire
            )

        in_slices(lock, keys, check, self.lock_slice_s)
        start = old.start if old.entries.keys() <= entries.keys() else version
        self._tables[tenant] = _Table(old.lineage, start, version, header, entries)
        return version

    def reply(self, tenant: str, after: int, lineage: int) -> tuple[int, int, bytes] | None:
        """``(version, lineage, serialized reply)`` for a client holding ``after`` of
        ``lineage``: a delta when the table builds on it, else a full snapshot; None
        when there is nothing newer (or no table yet)."""
        table = self._tables.get(tenant)
        if table is None:
            return None
        same = lineage == table.lineage and table.start <= after <= table.version
        if same and after == table.version:
            return None
        if not same and after > table.version:
            return None  # a replica behind the client: wait until it catches up
        base = after if same else 0
        reply = table.replies.get(base)
        if reply is None:
            reply = self._serialize(table, base, same)
            if len(reply) > MAX_SNAPSHOT_BYTES:
                raise OverloadedError(
                    f"snapshot: {len(table.entries)} compact models make {len(reply)} bytes, "
                    f"over the limit of {MAX_SNAPSHOT_BYTES} bytes per message"
                )
            if len(table.replies) > 64:
                table.replies.clear()
            table.replies[base] = reply
        return table.version, table.lineage, reply

    def _serialize(self, table: _Table, base: int, delta: bool) -> bytes:
        eta, queue, min_samples, rules, rollout = table.header
        header = model_pb2.WatchSnapshotsResponse(
            version=table.version,
            eta=eta,
            queue_delay=duration(queue, "queue_delay"),
            min_samples=min_samples,
            delta=delta,
            base_version=base,
            lineage=table.lineage,
            cdf_error=self.resend,
            signature_rules=rules,
            rollout=rollout_message(rollout),
        )
        parts = [header.SerializeToString()]
        parts += [e.field for e in table.entries.values() if not delta or e.version > base]
        return b"".join(parts)

    def version(self, tenant: str) -> int:
        """The version ``tenant``'s table was last brought to (-1: no table)."""
        table = self._tables.get(tenant)
        return table.version if table is not None else -1

    def lineage(self, tenant: str) -> int:
        """The lineage of ``tenant``'s table (0: none yet)."""
        table = self._tables.get(tenant)
        return table.lineage if table is not None else 0

    def forget(self, tenant: str) -> int:
        """Drop a tenant's table (its last stream ended); the next one has a new lineage.
        The serialized bytes it held."""
        table = self._tables.pop(tenant, None)
        return 0 if table is None else _table_bytes(table)

    def held_bytes(self) -> int:
        """Serialized bytes the tables hold (models and replies), all tenants."""
        return sum(_table_bytes(table) for table in list(self._tables.values()))


def _table_bytes(table: _Table) -> int:
    fields = sum(len(e.field) for e in list(table.entries.values()))
    return fields + sum(len(reply) for reply in list(table.replies.values()))


def _compact_field(key: inspection.ModelKey, model: DurationModel, steps: list[int]) -> bytes:
    level, tool, signature = key
    message = model_pb2.ToolModel(
        tool_name=tool,
        signature=signature,
        level=level.value,
        log_steps=steps,
        summarized=model.n_samples > len(steps) or level is Level.SHARED,
        sample_count=model.n_samples,
        drift_epoch=model.drift_epoch,
        quantile_sketch=True,
    )
    return model_pb2.WatchSnapshotsResponse(models=[message]).SerializeToString()
