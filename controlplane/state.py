"""The server's in-memory models: ``estimator.Models`` plus pin statistics and log positions.

State is a pure function of the log: applying the same tool calls and program ends in
``seq`` order gives the same models, whether from an empty start, from a snapshot plus the
log's tail, or on another server tailing the same database.

Versions are per tenant (``tenant_version``): a tenant's own calls and program ends
learned, plus, for a sharing tenant, the publications of shared models (see
``controlplane.sharing``), so no tenant can read another's ingest volume from a version.
"""

from __future__ import annotations

import contextvars
import copyreg
import io
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from controlplane.records import PinOutcome, StoredProgramEnd, StoredToolCall
from controlplane.sharing import SharedModels, SharingRules
from controlplane.storage.base import Compaction
from estimator import DEFAULT_PROFILE, DurationModel, Models, TtlPolicy
from estimator.signatures import SignatureRegistry, SignatureRule

__all__ = ["END_WINDOW_S", "ModelState", "PinCounts", "differences"]

#: Outcomes after which the returning turn waited for its cache to be rebuilt: their
#: admission delays feed T.
_RELEASED = (PinOutcome.EXPIRED, PinOutcome.RELEASED_UNDER_PRESSURE, PinOutcome.NOT_PINNED)
#: Layout of the state; a snapshot of another layout is not reused (the log is replayed).
FORMAT = 3
#: Two ends of one program (tenant, program id) whose times are at most this far apart are
#: one end seen by two engines (each stamps its own clock: a last turn retried on another
#: engine, a program that moved and was also taken for abandoned where it had been). Reruns
#: of a program id end further apart: a run takes longer than this (a rerun's end within it
#: would be taken for the first). Ends without a time are not compared.
END_WINDOW_S = 5.0

#: Recent timed ends remembered per tenant to tell another engine's view of an end (one
#: tenant's ends never push another's out).
RECENT_ENDS = 4096
#: How long pickling holds the owner's lock at a time (one model more at most).
LOCK_SLICE_S = 0.0005
T = TypeVar("T")


@dataclass
class PinCounts:
    """How often one tool's pins paid off."""

    hits: int = 0
    expired: int = 0
    released_under_pressure: int = 0
    not_pinned: int = 0
    #: Pins released because the program's next turn went to another engine.
    moved: int = 0

    def add(self, outcome: PinOutcome) -> None:
        if outcome is PinOutcome.HIT:
            self.hits += 1
        elif outcome is PinOutcome.EXPIRED:
            self.expired += 1
        elif outcome is PinOutcome.RELEASED_UNDER_PRESSURE:
            self.released_under_pressure += 1
        elif outcome is PinOutcome.NOT_PINNED:
            self.not_pinned += 1
        elif outcome is PinOutcome.MOVED:
            self.moved += 1

    @property
    def hit_rate(self) -> float:
        """hits / pins (pins = hits + expired + released); 0.0 without pins. A moved pin
        is left out: where the program went was the router's choice, not the TTL's."""
        pins = self.hits + self.expired + self.released_under_pressure
        return self.hits / pins if pins else 0.0


@dataclass
class ModelState:
    """Everything decisions and inspection read; not thread-safe (the owner locks)."""

    models: Models
    #: What the models were built with; a snapshot built otherwise is not reused.
    #: (policy, profile, min_samples, the signature rules' ``SignatureRegistry.key``).
    config: tuple[object, ...] = ("", "", 0, ())
    #: How the state is laid out and what sharing rules built it (also compared on load).
    layout: tuple[int, SharingRules | None] = (FORMAT, None)
    tool_seq: int = 0
    end_seq: int = 0
    pins: dict[tuple[str, str], PinCounts] = field(default_factory=dict)
    tool_calls: dict[str, int] = field(default_factory=dict)
    programs: dict[str, int] = field(default_factory=dict)
    #: Ends that corrected an earlier end's count (per tenant): they change the models.
    revisions: dict[str, int] = field(default_factory=dict)
    #: tenant -> program id -> (finished_at, turns learned) of its last RECENT_ENDS ends.
    recent_ends: dict[str, dict[str, tuple[float, int]]] = field(default_factory=dict)
    #: tenant -> tool -> argument signatures seen (linear listings, per-tenant snapshots).
    index: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    shared: SharedModels = field(default_factory=SharedModels)

    @classmethod
    def fresh(
        cls,
        policy: TtlPolicy,
        min_samples: int = 100,
        profile: str = DEFAULT_PROFILE,
        sharing: SharingRules | None = None,
        signature_rules: Sequence[SignatureRule] = (),
    ) -> ModelState:
        """Empty models configured for ``policy`` and the hardware ``profile``, keying
        invocations by the built-in signature rules and the operator's ``signature_rules``."""
        models = policy.new_models(profile, min_samples=min_samples)
        models.durations.signatures = SignatureRegistry(rules=signature_rules)
        rules = sharing or SharingRules()
        config = (policy.name, profile, min_samples, models.durations.signatures.key)
        return cls(models, config, layout=(FORMAT, rules), shared=SharedModels(rules))

    def reusable_as(self, fresh: ModelState) -> bool:
        """Whether this (restored) state was built exactly as ``fresh`` would be."""
        return self.config == fresh.config and self.layout == fresh.layout

    def under_signatures_of(self, fresh: ModelState, mark: Compaction) -> ModelState | None:
        """This (restored) state under ``fresh``'s signature rules, when only those differ
        and it covers the compaction ``mark``, else None: its invocation models are
        dropped (no other level depends on signatures) and learn again from the next
        calls. For a log compacted past what a replay needs; else the log is replayed."""
        if self.config[:3] != fresh.config[:3] or self.layout != fresh.layout:
            return None
        if self.tool_seq < mark.tool_seq or self.end_seq < mark.end_seq:
            return None
        durations = self.models.durations
        durations.forget_invocations()
        durations.signatures = fresh.models.durations.signatures
        for tools in self.index.values():
            for signatures in tools.values():
                signatures.clear()
        self.config = fresh.config
        return self

    @property
    def version(self) -> int:
        """Log positions applied, all tenants (equal versions ⇒ equal models)."""
        return self.tool_seq + self.end_seq

    def tenant_version(self, tenant: str, share: bool) -> int:
        """What ``tenant`` is told: its own events learned, plus shared publications if
        it shares (equal versions ⇒ equal models as that tenant sees them)."""
        own = self.tool_calls.get(tenant, 0) + self.programs.get(tenant, 0)
        own += self.revisions.get(tenant, 0)
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
            self.models.record_tool_call(call.tool, args, call.duration_s, tenant)
            if row.shared:
                self.shared.record(durations, call.tool, tenant, call.duration_s)
            signatures = self.index.setdefault(tenant, {}).setdefault(call.tool, set())
            if args is not None:  # the hierarchy just computed it: a cache hit
                signature = durations.signatures.signature(call.tool, args)
                if signature:
                    signatures.add(signature)
            if call.pin_outcome is not PinOutcome.UNSPECIFIED and not call.shadow:
                key = (tenant, call.tool)  # a shadow call's pin was never made: no statistic
                self.pins.setdefault(key, PinCounts()).add(call.pin_outcome)
            if call.admission_delay_s is not None and call.pin_outcome in _RELEASED:
                self.models.record_queue_delay(call.admission_delay_s, tenant)
            self.tool_calls[tenant] = self.tool_calls.get(tenant, 0) + 1
            self.tool_seq = row.seq
            applied += 1
        return applied

    def apply_program_ends(self, rows: Iterable[StoredProgramEnd]) -> int:
        """Learn committed program ends in order, skipping any at or below ``end_seq``.

        An end within ``END_WINDOW_S`` of a recent end of the same program is that run
        seen by another engine (the store keeps every end with its own time): with more
        turns it corrects the count learned, in its place; it is no program of its own.
        """
        applied = 0
        for row in rows:
            if row.seq <= self.end_seq:
                continue
            self._learn_end(row)
            self.end_seq = row.seq
            applied += 1
        return applied

    def _learn_end(self, row: StoredProgramEnd) -> None:
        tenant, end = row.tenant, row.end
        recent = self.recent_ends.setdefault(tenant, {})  # bounded per tenant
        seen = recent.get(end.program_id)
        at = end.finished_at
        if seen is not None and at is not None and abs(seen[0] - at) <= END_WINDOW_S:
            if end.total_turns > seen[1]:
                self.models.revise_program_end(seen[1], end.total_turns, tenant)
                recent[end.program_id] = (seen[0], end.total_turns)
                self.revisions[tenant] = self.revisions.get(tenant, 0) + 1
            return
        self.models.record_program_end(end.total_turns, tenant)
        self.programs[tenant] = self.programs.get(tenant, 0) + 1
        if at is not None:
            recent.pop(end.program_id, None)
            recent[end.program_id] = (at, end.total_turns)
            if len(recent) > RECENT_ENDS:
                del recent[next(iter(recent))]

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

        With ``lock`` (the owner's), each duration model is first pickled on its own,
        holding the lock about ``LOCK_SLICE_S`` at a time; one last hold pickles the
        rest, embedding those blobs (models changed meanwhile are pickled again). So
        learning and decisions wait for a slice at a time, never for the whole state.
        """
        blobs: dict[int, tuple[DurationModel, int, bytes]] = {}

        def blob(model: DurationModel) -> None:
            blobs[id(model)] = (model, model.n_seen, pickle.dumps(model, _PROTOCOL))

        if lock is None:
            lock = threading.RLock()
        else:
            with lock:
                models = self._duration_models()
            in_slices(lock, models, blob, LOCK_SLICE_S, pause_s=LOCK_SLICE_S)
        parts: list[bytes] = []
        with lock:
            skeleton = self._dumps_with(blobs, parts)
            tool_seq, end_seq = self.tool_seq, self.end_seq
        # The models' bytes join the payload outside the lock.
        return pickle.dumps((_MAGIC, skeleton, parts), _PROTOCOL), tool_seq, end_seq

    def _duration_models(self) -> list[DurationModel]:
        found = [model for _, model in self.models.durations.items()]
        found += [shared.raw for shared in self.shared.tools.values()]
        return found

    def _dumps_with(
        self, blobs: dict[int, tuple[DurationModel, int, bytes]], parts: list[bytes]
    ) -> bytes:
        """The state with each duration model replaced by its index in ``parts``."""

        def reduce(model: DurationModel) -> tuple[Callable[[int], DurationModel], tuple[int]]:
            cached = blobs.get(id(model))
            if cached is not None and cached[0] is model and cached[1] == model.n_seen:
                parts.append(cached[2])
            else:  # changed since its slice: pickled again, now
                parts.append(pickle.dumps(model, _PROTOCOL))
            return _part, (len(parts) - 1,)

        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, _PROTOCOL)
        # Only DurationModels go through ``reduce`` (a dispatch table, not a hook that
        # every object of the state would pass through).
        pickler.dispatch_table = {**copyreg.dispatch_table, DurationModel: reduce}
        pickler.dump(self)
        return buffer.getvalue()

    @staticmethod
    def loads(payload: bytes) -> ModelState:
        loaded = pickle.loads(payload)
        if isinstance(loaded, tuple) and len(loaded) == 3 and loaded[0] == _MAGIC:
            token = _PARTS.set(loaded[2])
            try:
                loaded = pickle.loads(loaded[1])
            finally:
                _PARTS.reset(token)
        state = loaded
        if not isinstance(state, ModelState):
            raise TypeError("snapshot payload is not a ModelState")
        if not hasattr(state, "layout"):  # written before FORMAT 2: never reused
            state.layout = (1, None)
        return state


def differences(a: ModelState, b: ModelState) -> list[str]:
    """How two states' models differ (empty: equal): log positions, per-tenant counts of
    calls, programs and corrected ends, pin counts, and every duration model's count,
    drift epoch and window of samples. What "the live models equal a restore" checks."""
    found = [
        name
        for name in ("tool_seq", "end_seq", "tool_calls", "programs", "revisions", "pins")
        if getattr(a, name) != getattr(b, name)
    ]
    models_a, models_b = dict(a.models.durations.items()), dict(b.models.durations.items())
    if models_a.keys() != models_b.keys():
        found.append(f"models {sorted(map(str, models_a.keys() ^ models_b.keys()))[:5]}")
    for key in models_a.keys() & models_b.keys():
        one, other = models_a[key], models_b[key]
        same = (one.n_seen, one.drift_epoch) == (other.n_seen, other.drift_epoch)
        if not same or one.recent_samples().tolist() != other.recent_samples().tolist():
            found.append(f"model {key}")
    return found


def in_slices(
    lock: threading.RLock,
    items: Sequence[T],
    work: Callable[[T], None],
    slice_s: float,
    pause_s: float = 0.0,
) -> None:
    """``work(item)`` for each item in order, holding ``lock`` about ``slice_s`` at a time
    (one item more at most), so that others waiting for it wait about that long. Between
    slices the thread sleeps ``pause_s`` (0: it only yields the GIL), so that background
    work leaves the event loop the interpreter most of the time."""
    i = 0
    while i < len(items):
        with lock:
            deadline = time.perf_counter() + slice_s
            while i < len(items):
                work(items[i])
                i += 1
                if time.perf_counter() >= deadline:
                    break
        time.sleep(pause_s)


_PROTOCOL = pickle.HIGHEST_PROTOCOL
_MAGIC = "cachettl-state-parts"
#: The pickled models of the snapshot being loaded (see ``ModelState.dumps``).
_PARTS: contextvars.ContextVar[list[bytes]] = contextvars.ContextVar("_PARTS")


def _part(index: int) -> DurationModel:
    model = pickle.loads(_PARTS.get()[index])
    assert isinstance(model, DurationModel)
    return model
