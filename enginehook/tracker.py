"""Tool-call tracking: tool durations, pin outcomes and admission delays, per program.

For each program the tracker follows one cycle per tool call::

    finished(turn k, tool f) ─► [pin released: outcome] ─► arrived(turn k+1) ─► admitted

- tool duration = next arrival − finish of the turn that called the tool (measured in the
  engine, as the paper does);
- outcome of the pin (:class:`controlplane.records.PinOutcome`, the one vocabulary of the
  hook, the simulator and the control plane): ``HIT`` when the pin was still held at
  admission, otherwise why it ended (``EXPIRED``, ``RELEASED_UNDER_PRESSURE``), or
  ``NOT_PINNED``; ``UNSPECIFIED`` when it ended for a reason that is no outcome;
- admission delay = admission − arrival of the returning turn. When its cache had been
  released by a known cause (``PinOutcome.feeds_queue_delay``: expired, under pressure,
  not pinned) the delay is a sample of T, the queueing delay of returning unpinned
  requests; the control plane applies the same rule to the same events.

``admitted`` returns a :class:`ToolCallEvent` with all of that; ``program_end`` a
:class:`ProgramEndEvent`. Event ids are ``<engine id>:<program>:<turn>`` (or ``:end``),
unique per engine instance, so a receiver can drop duplicates. ``event_record`` /
``event_from_record`` are the events' one JSON form (event log, spill files).

>>> t = ToolCallTracker(engine_id="e1")
>>> t.finished("p", 10.0, tool="bash", tool_args="ls", ttl_s=2.0, pinned=True)
0
>>> t.arrived("p", 10.5)
>>> ev = t.admitted("p", 10.6, pin_held=True)
>>> (ev.event_id, ev.duration_s, ev.outcome.label, round(ev.admission_delay_s, 3))
('e1:p:0', 0.5, 'hit', 0.1)
>>> ev.queue_delay_sample, event_from_record(event_record(ev)) == ev
(False, True)
>>> t.program_end("p", 20.0).total_turns
1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from controlplane.records import PinOutcome
from enginehook.pins import ReleaseReason

__all__ = [
    "PinOutcome",
    "ProgramEndEvent",
    "ToolCallEvent",
    "ToolCallTracker",
    "event_from_record",
    "event_record",
    "outcome_of_release",
]

_OF_RELEASE = {
    ReleaseReason.HIT: PinOutcome.HIT,
    ReleaseReason.TTL: PinOutcome.EXPIRED,
    ReleaseReason.PRESSURE: PinOutcome.RELEASED_UNDER_PRESSURE,
    ReleaseReason.BUDGET: PinOutcome.RELEASED_UNDER_PRESSURE,
}


def outcome_of_release(reason: ReleaseReason) -> PinOutcome:
    """The outcome recorded when a pin ends for ``reason`` before its program returns
    (``UNSPECIFIED`` for program end, replacement and shutdown)."""
    return _OF_RELEASE.get(reason, PinOutcome.UNSPECIFIED)


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    """One finished tool call, as reported to the control plane's ``RecordToolCalls``."""

    event_id: str
    program_id: str
    tenant: str
    tool_name: str
    tool_args: str | None
    duration_s: float
    finished_at: float
    turn_index: int
    ttl_s: float
    outcome: PinOutcome
    admission_delay_s: float
    basis: str = ""

    @property
    def queue_delay_sample(self) -> bool:
        """Whether ``admission_delay_s`` is a sample of T (``PinOutcome.feeds_queue_delay``)."""
        return self.outcome.feeds_queue_delay


@dataclass(frozen=True, slots=True)
class ProgramEndEvent:
    """A program ended after ``total_turns`` LLM calls (``RecordProgramEnd``)."""

    event_id: str
    program_id: str
    tenant: str
    total_turns: int
    ended_at: float


@dataclass(slots=True)
class _Pending:
    tool: str
    tool_args: str | None
    finished_at: float
    turn_index: int
    ttl_s: float
    basis: str
    outcome: PinOutcome
    arrived_at: float | None = None


class ToolCallTracker:
    """Per-program bookkeeping of tool calls (engine-independent, times passed in)."""

    def __init__(self, engine_id: str, tenant: str = "default") -> None:
        if not engine_id:
            raise ValueError("engine_id must be a non-empty string")
        self.engine_id = engine_id
        self.tenant = tenant
        self._turns: dict[str, int] = {}
        self._pending: dict[str, _Pending] = {}

    def turns_served(self, program_id: str) -> int:
        """LLM calls of the program finished so far."""
        return self._turns.get(program_id, 0)

    def finished(
        self,
        program_id: str,
        now: float,
        *,
        tool: str | None,
        tool_args: str | None = None,
        ttl_s: float = 0.0,
        pinned: bool = False,
        basis: str = "",
    ) -> int:
        """A turn of the program finished; ``tool`` is the tool it called (``None``: no
        tool call). Returns the turn's index (0-based)."""
        turn = self._turns.get(program_id, 0)
        self._turns[program_id] = turn + 1
        if tool is None:
            self._pending.pop(program_id, None)
            return turn
        outcome = PinOutcome.HIT if pinned else PinOutcome.NOT_PINNED
        self._pending[program_id] = _Pending(tool, tool_args, now, turn, ttl_s, basis, outcome)
        return turn

    def pin_released(self, program_id: str, reason: ReleaseReason) -> None:
        """The program's pin ended before its next request was admitted."""
        pending = self._pending.get(program_id)
        pinned = pending is not None and pending.outcome is PinOutcome.HIT
        if pending is not None and pinned and reason is not ReleaseReason.HIT:
            pending.outcome = outcome_of_release(reason)

    def arrived(self, program_id: str, now: float) -> None:
        """The program's next request arrived (ends the tool call's duration)."""
        pending = self._pending.get(program_id)
        if pending is not None and pending.arrived_at is None:
            pending.arrived_at = max(now, pending.finished_at)

    def returning(self, program_id: str) -> bool:
        """Whether the program has a tool call waiting for its next turn's admission."""
        pending = self._pending.get(program_id)
        return pending is not None and pending.arrived_at is not None

    def admitted(self, program_id: str, now: float, *, pin_held: bool) -> ToolCallEvent | None:
        """The program's next request was admitted; ``pin_held``: its pin was still live.

        Returns the completed tool-call event, or ``None`` when no tool call was pending.
        """
        pending = self._pending.get(program_id)
        if pending is None or pending.arrived_at is None:
            return None
        del self._pending[program_id]
        outcome = pending.outcome
        if outcome is PinOutcome.HIT and not pin_held:
            outcome = PinOutcome.UNSPECIFIED  # released without our seeing why
        return ToolCallEvent(
            event_id=f"{self.engine_id}:{program_id}:{pending.turn_index}",
            program_id=program_id,
            tenant=self.tenant,
            tool_name=pending.tool,
            tool_args=pending.tool_args,
            duration_s=pending.arrived_at - pending.finished_at,
            finished_at=pending.finished_at,
            turn_index=pending.turn_index,
            ttl_s=pending.ttl_s,
            outcome=outcome,
            admission_delay_s=max(0.0, now - pending.arrived_at),
            basis=pending.basis,
        )

    def program_end(self, program_id: str, now: float) -> ProgramEndEvent | None:
        """The program ended; ``None`` if it never finished a turn here."""
        self._pending.pop(program_id, None)
        turns = self._turns.pop(program_id, 0)
        if turns == 0:
            return None
        return ProgramEndEvent(
            f"{self.engine_id}:{program_id}:end", program_id, self.tenant, turns, now
        )

    def forget_idle(self, now: float, idle_s: float) -> list[str]:
        """Drop programs whose last tool call finished over ``idle_s`` ago without a return
        (abandoned programs), so memory stays bounded. Returns their ids."""
        stale = [
            pid
            for pid, p in self._pending.items()
            if p.arrived_at is None and now - p.finished_at > idle_s
        ]
        for pid in stale:
            del self._pending[pid]
            self._turns.pop(pid, None)
        return stale

    def __len__(self) -> int:
        return len(self._turns)


def event_record(event: ToolCallEvent | ProgramEndEvent) -> dict[str, Any]:
    """The event as a JSON-ready dict with its ``kind`` (the outcome by its label)."""
    kind = "tool_call" if isinstance(event, ToolCallEvent) else "program_end"
    record: dict[str, Any] = {"kind": kind, **asdict(event)}
    if isinstance(event, ToolCallEvent):
        record["outcome"] = event.outcome.label
    return record


def event_from_record(record: Mapping[str, Any]) -> ToolCallEvent | ProgramEndEvent:
    """The inverse of :func:`event_record` (also reads records of earlier releases)."""
    data = dict(record)
    kind = data.pop("kind")
    if kind == "program_end":
        return ProgramEndEvent(**data)
    if kind != "tool_call":
        raise ValueError(f"kind must be 'tool_call' or 'program_end', got {kind!r}")
    data["outcome"] = PinOutcome.parse(data["outcome"])
    return ToolCallEvent(**data)
