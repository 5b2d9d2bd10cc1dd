"""What every event sink is: the protocol :mod:`enginehook.link.sinks` and
:mod:`enginehook.link.remote` both implement, and the counters a sink reports."""

from __future__ import annotations

from typing import Protocol

from enginehook.core.tracker import ProgramEndReport, ToolCallReport

__all__ = ["Event", "EventSink", "SinkCounter"]

Event = ToolCallReport | ProgramEndReport

#: One figure of a sink for the metrics endpoint: Prometheus name, type, value.
SinkCounter = tuple[str, str, int]


class EventSink(Protocol):
    """Receives the hook's events; ``submit`` must not block."""

    def submit(self, event: Event) -> None: ...

    def counters(self) -> list[SinkCounter]:
        """What became of the events so far (read by the metrics endpoint's thread)."""
        ...

    def close(self) -> None: ...
