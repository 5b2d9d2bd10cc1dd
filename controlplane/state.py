"""The server's in-memory models: ``estimator.Models`` plus pin statistics and log positions.

State is a pure function of the log: applying the same tool calls and program ends in
``seq`` order gives the same models, whether from an empty start, from a snapshot plus the
log's tail, or on another server tailing the same database.

Versions are per tenant (``tenant_version``): a tenant's own calls and program ends
learned, plus, for a sharing tenant, the publications of shared models (see
``controlplane.sharing``), so no tenant can read another's ingest volume from a version.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from controlplane.records import PinOutcome, StoredProgramEnd, StoredToolCall
from controlplane.sharing import SharedModels, SharingRules
from estimator import DurationModel, Models, TtlPolicy

__all__ = ["ModelState", "PinCounts"]

#: Outcomes after which the returning turn waited for its cache to be rebuilt: their
#: admission delays feed T.
_RELEASED = (PinOutcome.EXPIRED, PinOutcome.RELEASED_UNDER_PRESSURE, PinOutcome.NOT_PINNED)
#: Layout of the state; a snapshot of another layout is not reused (the log is replayed).
FORMAT = 2
#: Models pickled per hold of the lock when writing a snapshot.
PICKLE_SLICE = 64


@dataclass
class PinCounts:
    """How often one tool's pins paid off."""

    hits: int = 0
    expired: int = 0
    released_under_pressure: int = 0
    not_pinned: int = 0

    def add(self, outcome: PinOutcome) -> None:
        if outcome is PinOutcome.HIT:
            self.hits += 1
        elif outcome is PinOutcome.EXPIRED:
            self.expired += 1
        elif outcome is PinOutcome.RELEASED_UNDER_PRESSURE:
            self.released_under_pressure += 1
        elif outcome is PinOutcome.NOT_PINNED:
            self.not_pinned += 1

    @property
    def hit_rate(self) -> float:
        """hits / pins (pins = hits + expired + released); 0.0 without pins."""
        pins = self.hits + self.expired + self.released_under_pressure
        return self.hits / pins if pins else 0.0


@dataclass
class ModelState:
    """Everything decisions and inspection read; not thread-safe (the owner locks)."""

    models: Models
    #: What the models were built with; a snapshot built otherwise is not reused.
    config: tuple[str, str, int] = ("", "", 0)  # (policy, profile, min_samples)
    #: How the state is laid out and what sharing rules built it (also compared on load).
    layout: tuple[int, SharingRules | None] = (FORMAT, None)
    tool_seq: int = 0
    end_seq: int = 0
    pins: dict[tuple[str, str], PinCounts] = field(default_factory=dict)
    tool_calls: dict[str, int] = field(default_factory=dict)
    programs: dict[str, int] = field(default_factory=dict)
    #: tenant -> tool -> argument signatures seen (linear listings, per-tenant snapshots).
    index: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    shared: SharedModels = field(default_factory=SharedModels)

    @classmethod
    def fresh(
        cls,
        policy: TtlPolicy,
        min_samples: int = 100,
        profile: str = "llama3.1-8b-h100",
        sharing: SharingRules | None = None,
    ) -> ModelState:
        """Empty models configured for ``policy`` and the hardware ``profile``."""
        models = policy.new_models(profile, min_samples=min_samples)
        rules = sharing or SharingRules()
        config = (policy.name, profile, min_samples)
        return cls(models, config, layout=(FORMAT, rules), shared=SharedModels(rules))

    def reusable_as(self, fresh: ModelState) -> bool:
        """Whether this (restored) state was built exactly as ``fresh`` would be."""
        return self.config == fresh.config and self.layout == fresh.layout

    @property
    def version(self) -> int:
        """Log positions applied, all tenants (equal versions ⇒ equal models)."""
        return self.tool_seq + self.end_seq

    def tenant_version(self, tenant: str, share: bool) -> int:
        """What ``tenant`` is told: its own events learned, plus shared publications if
        it shares (equal versions ⇒ equal models as that tenant sees them)."""
        own = self.tool_calls.get(tenant, 0) + self.programs.get(tenant, 0)
        return own + self.shared.publications if share else own

    def apply_tool_calls(self, rows: Iterable[StoredToolCall]) -> int:
        """Learn committed calls in order, skipping any at or below ``tool_seq``."""
        applied = 0
        durations = self.models.durations
        for row in rows:
            if row.seq <= self.tool_seq:
                continue
            call, tenant = row.call, row.tenant
            args = call.tool_args or None
            self.models.record_tool_call(call.tool_name, args, call.duration_s, tenant)
            if row.shared:
                self.shared.record(durations, call.tool_name, tenant, call.duration_s)
            signatures = self.index.setdefault(tenant, {}).setdefault(call.tool_name, set())
            if args is not None:  # the hierarchy just computed it: a cache hit
                signature = durations.signatures.signature(call.tool_name, args)
                if signature:
                    signatures.add(signature)
            if call.pin_outcome is not PinOutcome.UNSPECIFIED:
                key = (tenant, call.tool_name)
                self.pins.setdefault(key, PinCounts()).add(call.pin_outcome)
            if call.admission_delay_s is not None and call.pin_outcome in _RELEASED:
                self.models.record_queue_delay(call.admission_delay_s, tenant)
            self.tool_calls[tenant] = self.tool_calls.get(tenant, 0) + 1
            self.tool_seq = row.seq
            applied += 1
        return applied

    def apply_program_ends(self, rows: Iterable[StoredProgramEnd]) -> int:
        """Learn committed program ends in order, skipping any at or below ``end_seq``."""
        applied = 0
        for row in rows:
            if row.seq <= self.end_seq:
                continue
            self.models.record_program_end(row.end.total_turns, row.tenant)
            self.programs[row.tenant] = self.programs.get(row.tenant, 0) + 1
            self.end_seq = row.seq
            applied += 1
        return applied

    def pin_counts(self, tenant: str, tool: str) -> PinCounts:
        return self.pins.get((tenant, tool), PinCounts())

    def tools_of(self, tenant: str) -> list[str]:
        """The tenant's tool names, sorted."""
        return sorted(self.index.get(tenant, ()))

    def signatures_of(self, tenant: str, tool: str) -> list[str]:
        return sorted(self.index.get(tenant, {}).get(tool, ()))

    # -- snapshots (pickle) -----------------------------------------------------------

    def dumps(self, lock: threading.RLock | None = None) -> tuple[bytes, int, int]:
        """Pickle the state; returns ``(payload, tool_seq, end_seq)`` of what it holds.

        With ``lock`` (the owner's), duration models are pickled ``PICKLE_SLICE`` at a
        time, each slice under the lock, and the rest (with those changed meanwhile
        pickled again) under one last hold: learning and decisions wait for a slice at
        a time, never for the whole state.
        """
        blobs: dict[int, tuple[int, bytes]] = {}
        if lock is not None:
            with lock:
                models = self._duration_models()
            for start in range(0, len(models), PICKLE_SLICE):
                with lock:
                    for model in models[start : start + PICKLE_SLICE]:
                        blobs[id(model)] = (model.n_seen, pickle.dumps(model, _PROTOCOL))
        with lock or threading.RLock():
            return self._dumps_skeleton(blobs), self.tool_seq, self.end_seq

    def _duration_models(self) -> list[DurationModel]:
        found = [model for _, model in self.models.durations.items()]
        found += [shared.raw for shared in self.shared.tools.values()]
        return found

    def _dumps_skeleton(self, blobs: dict[int, tuple[int, bytes]]) -> bytes:
        import io

        parts: list[bytes] = []
        keep: list[DurationModel] = []  # ids stay valid while pickling
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, _PROTOCOL)

        def persistent_id(obj: object) -> int | None:
            if not isinstance(obj, DurationModel):
                return None
            cached = blobs.get(id(obj))
            fresh = cached is not None and cached[0] == obj.n_seen
            parts.append(cached[1] if fresh and cached else pickle.dumps(obj, _PROTOCOL))
            keep.append(obj)
            return len(parts) - 1

        pickler.persistent_id = persistent_id  # type: ignore[method-assign]
        pickler.dump(self)
        return pickle.dumps((_MAGIC, buffer.getvalue(), parts), _PROTOCOL)

    @staticmethod
    def loads(payload: bytes) -> ModelState:
        import io

        loaded: Any = pickle.loads(payload)
        if not (isinstance(loaded, tuple) and len(loaded) == 3 and loaded[0] == _MAGIC):
            return _legacy(loaded)
        _, skeleton, parts = loaded
        unpickler = pickle.Unpickler(io.BytesIO(skeleton))
        unpickler.persistent_load = lambda pid: pickle.loads(parts[pid])  # type: ignore[method-assign]
        state = unpickler.load()
        if not isinstance(state, ModelState):
            raise TypeError("snapshot payload is not a ModelState")
        return state


_PROTOCOL = pickle.HIGHEST_PROTOCOL
_MAGIC = "cachettl-model-state"


def _legacy(state: object) -> ModelState:
    """A snapshot written before ``FORMAT`` 2: its config never matches (log replayed)."""
    if not isinstance(state, ModelState):
        raise TypeError("snapshot payload is not a ModelState")
    state.layout = (1, None)
    return state
