"""Where the hook's events go: nowhere, a JSON Lines file, or the control plane.

:func:`build_sink` picks from the hook's config. Every sink's ``submit`` returns at once;
nothing network-bound runs on the caller's thread.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from enginehook.tracker import ProgramEndEvent, ToolCallEvent, event_record

if TYPE_CHECKING:
    from enginehook.config import HookConfig
    from enginehook.decide import TtlDecider

__all__ = ["EventSink", "JsonlSink", "NullSink", "build_sink", "event_record"]

Event = ToolCallEvent | ProgramEndEvent


class EventSink(Protocol):
    """Receives the hook's events; ``submit`` must not block."""

    def submit(self, event: Event) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Drops events (no control plane, no log)."""

    def submit(self, event: Event) -> None:
        """Drop ``event``."""

    def close(self) -> None:
        """Nothing to close."""


class JsonlSink:
    """Appends each event as one JSON line (line-buffered, local disk only)."""

    def __init__(self, path: str | Path, inner: EventSink | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()
        self._inner = inner

    def submit(self, event: Event) -> None:
        """Write ``event`` and pass it on."""
        with self._lock:
            self._file.write(json.dumps(event_record(event)) + "\n")
        if self._inner is not None:
            self._inner.submit(event)

    def close(self) -> None:
        """Close the file (and the inner sink)."""
        with self._lock:
            self._file.close()
        if self._inner is not None:
            self._inner.close()


def build_sink(config: HookConfig, decider: TtlDecider, engine_id: str) -> EventSink:
    """The sink the config asks for (control plane link and/or event log)."""
    sink: EventSink = NullSink()
    if config.control_plane:
        import importlib

        cplink = importlib.import_module("enginehook.cplink")
        sink = cplink.ControlPlaneLink.from_config(config, decider, engine_id)
    if config.event_log:
        sink = JsonlSink(config.event_log, inner=sink)
    return sink
