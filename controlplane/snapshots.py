"""Serialized ``WatchSnapshots`` replies, built incrementally and a slice at a time.

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

A written snapshot (``dumps_off_process``) is pickled by a forked child process from its
copy-on-write image of the state, so the serving process's interpreter lock is held only
for the ``fork`` itself: decisions are not slowed by pickling thousands of models.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

import numpy as np

from controlplane import inspection
from controlplane._gen.cachettl.v1 import model_pb2
from controlplane.errors import OverloadedError
from controlplane.state import ModelState, in_slices
from controlplane.wire import duration
from estimator import DurationModel, Level

__all__ = [
    "MAX_SNAPSHOT_BYTES",
    "MIN_POINTS_PER_MODEL",
    "SNAPSHOT_POINTS",
    "SnapshotPayloads",
    "dumps_off_process",
    "in_slices",
    "points_per_model",
]

log = logging.getLogger(__name__)

#: The largest ``WatchSnapshotsResponse``: the server's send limit and the receive limit
#: of every ``ControlPlaneClient`` channel (gRPC's default receive limit is 4 MiB).
MAX_SNAPSHOT_BYTES = 32 * 1024 * 1024
#: Durations a snapshot holds at most over all its models (2 MiB of doubles).
SNAPSHOT_POINTS = 262_144
#: The fewest points a model with that many samples is sent with, however many models.
MIN_POINTS_PER_MODEL = 16

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
        self._entries: dict[str, dict[inspection.ModelKey, _Entry]] = {}

    def build(
        self, state: ModelState, lock: threading.RLock, tenant: str, share: bool
    ) -> tuple[int, bytes]:
        """``(version, serialized WatchSnapshotsResponse)`` of ``tenant``'s models.

        The version is read first, so the reply holds at least that version's models.
        Raises ``OverloadedError`` if the reply would pass ``max_bytes``.
        """
        with lock:
            keys = inspection.snapshot_keys(state, tenant, share)
            stats = state.models.workload(tenant)
            header = model_pb2.WatchSnapshotsResponse(
                version=state.tenant_version(tenant, share),
                eta=stats.eta.get(),
                queue_delay=duration(stats.queue.get(), "queue_delay"),
                min_samples=state.models.durations.min_samples,
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
        return header.version, b"".join(parts)

    def forget(self, tenant: str) -> None:
        """Drop a tenant's cache (its last stream ended)."""
        self._entries.pop(tenant, None)


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
