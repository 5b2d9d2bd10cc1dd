"""Serialized ``WatchSnapshots`` replies, built incrementally and a slice at a time.

A tenant's snapshot is its models (``inspection.snapshot_keys``) as ``ToolModel``
messages. Each model's message is serialized once and kept until the model changes
(same object, same ``n_seen``); a reply is the header's bytes followed by every model's
bytes, which protobuf parses as one message (concatenated messages merge, repeated
fields append). The model lock is held for about ``lock_slice_s`` at a time, so a
snapshot of a tenant with ten thousand tools never stalls decisions.
"""

from __future__ import annotations

import threading

from controlplane import inspection
from controlplane._gen.cachettl.v1 import model_pb2
from controlplane.state import ModelState, in_slices
from controlplane.wire import duration
from estimator import DurationModel

__all__ = ["SnapshotPayloads", "in_slices"]

_Entry = tuple[DurationModel, int, bytes]  # (model, its n_seen, serialized ToolModel field)


def _model_field(key: inspection.ModelKey, model: DurationModel) -> bytes:
    v = inspection.model_view(key, model)
    message = model_pb2.ToolModel(
        tool_name=v.tool_name,
        signature=v.signature,
        level=v.level,
        sorted_durations_seconds=v.sorted_durations_s,
        summarized=v.summarized,
        sample_count=v.sample_count,
        drift_epoch=v.drift_epoch,
    )
    return model_pb2.WatchSnapshotsResponse(models=[message]).SerializeToString()


class SnapshotPayloads:
    """Per-tenant caches of serialized models; thread-safe for different tenants."""

    def __init__(self, lock_slice_s: float = 0.002) -> None:
        self.lock_slice_s = lock_slice_s
        self._entries: dict[str, dict[inspection.ModelKey, _Entry]] = {}

    def build(
        self, state: ModelState, lock: threading.RLock, tenant: str, share: bool
    ) -> tuple[int, bytes]:
        """``(version, serialized WatchSnapshotsResponse)`` of ``tenant``'s models.

        The version is read first, so the reply holds at least that version's models.
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
        old = self._entries.get(tenant, {})
        new: dict[inspection.ModelKey, _Entry] = {}
        parts = [header.SerializeToString()]

        def add(key: inspection.ModelKey) -> None:
            model = inspection.stored_model(state, tenant, key)
            if model is None:
                return
            entry = old.get(key)
            if entry is None or entry[0] is not model or entry[1] != model.n_seen:
                entry = (model, model.n_seen, _model_field(key, model))
            new[key] = entry
            parts.append(entry[2])

        in_slices(lock, keys, add, self.lock_slice_s)
        self._entries[tenant] = new
        return header.version, b"".join(parts)

    def forget(self, tenant: str) -> None:
        """Drop a tenant's cache (its last stream ended)."""
        self._entries.pop(tenant, None)
