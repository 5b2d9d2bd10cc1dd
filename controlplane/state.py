"""The server's in-memory models: ``estimator.Models`` plus pin statistics and log positions.

State is a pure function of the log: applying the same tool calls and program ends in
``seq`` order gives the same models, whether from an empty start, from a snapshot plus the
log's tail, or on another server tailing the same database.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field

from controlplane.records import PinOutcome, StoredProgramEnd, StoredToolCall
from estimator import Models, TtlPolicy

__all__ = ["ModelState", "PinCounts"]

#: Outcomes after which the returning turn waited for its cache to be rebuilt: their
#: admission delays feed T.
_RELEASED = (PinOutcome.EXPIRED, PinOutcome.RELEASED_UNDER_PRESSURE, PinOutcome.NOT_PINNED)


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
    tool_seq: int = 0
    end_seq: int = 0
    pins: dict[tuple[str, str], PinCounts] = field(default_factory=dict)
    tool_calls: dict[str, int] = field(default_factory=dict)
    programs: dict[str, int] = field(default_factory=dict)

    @classmethod
    def fresh(
        cls, policy: TtlPolicy, min_samples: int = 100, profile: str = "llama3.1-8b-h100"
    ) -> ModelState:
        """Empty models configured for ``policy`` and the hardware ``profile``."""
        models = policy.new_models(profile, min_samples=min_samples)
        return cls(models, config=(policy.name, profile, min_samples))

    @property
    def version(self) -> int:
        """Model version: log positions applied (equal versions ⇒ equal models)."""
        return self.tool_seq + self.end_seq

    def apply_tool_calls(self, rows: Iterable[StoredToolCall]) -> int:
        """Learn committed calls in order, skipping any at or below ``tool_seq``."""
        applied = 0
        for row in rows:
            if row.seq <= self.tool_seq:
                continue
            call = row.call
            self.models.record_tool_call(
                call.tool_name, call.tool_args or None, call.duration_s, row.tenant, row.shared
            )
            if call.pin_outcome is not PinOutcome.UNSPECIFIED:
                key = (row.tenant, call.tool_name)
                self.pins.setdefault(key, PinCounts()).add(call.pin_outcome)
            if call.admission_delay_s is not None and call.pin_outcome in _RELEASED:
                self.models.record_queue_delay(call.admission_delay_s, row.tenant)
            self.tool_calls[row.tenant] = self.tool_calls.get(row.tenant, 0) + 1
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

    def dumps(self) -> bytes:
        """Pickle (snapshots are written and read by this server's own code only)."""
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def loads(payload: bytes) -> ModelState:
        state = pickle.loads(payload)
        if not isinstance(state, ModelState):
            raise TypeError("snapshot payload is not a ModelState")
        return state
