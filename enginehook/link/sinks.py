"""Where the hook's events go: nowhere, a JSON Lines file, or the control plane.

:func:`build_sink` picks from the hook's config. Every sink's ``submit`` returns at once;
no file or network I/O runs on the caller's thread.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import json
import logging
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from enginehook.core.tracker import event_record
from enginehook.link.base import Event, EventSink, SinkCounter

if TYPE_CHECKING:
    from enginehook.config import HookConfig
    from enginehook.link.decide import TtlDecider

__all__ = ["JsonlSink", "NullSink", "build_sink"]

logger = logging.getLogger("enginehook.link.sinks")

#: Most events the event log's writer takes from its queue for one write.
_BATCH_EVENTS = 1000


class NullSink:
    """Drops events (no control plane, no log)."""

    def submit(self, event: Event) -> None:
        """Drop ``event``."""

    def counters(self) -> list[SinkCounter]:
        """None: nothing is kept."""
        return []

    def close(self) -> None:
        """Nothing to close."""


class JsonlSink:
    """Appends each event as one JSON line to ``path``, written by a daemon thread.

    ``submit`` queues the event (up to ``max_queued`` not yet written; past that, or
    after :meth:`close`, it is dropped and counted in ``dropped``) and passes it to
    ``inner`` (until closed). The writer opens ``path`` itself, so a stalled disk or a
    FIFO without a reader stalls only the writer. It writes what is queued in batches,
    unbuffered, so a reader sees each batch at once. A failed open or write (``OSError``)
    is logged once per run of failures, its events count as dropped, and the file is
    reopened for the next batch.
    """

    def __init__(
        self, path: str | Path, inner: EventSink | None = None, *, max_queued: int = 10_000
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"JsonlSink max_queued must be >= 1, got {max_queued}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_queued = max_queued
        #: Events written to the file.
        self.written = 0
        #: Events lost: the queue was full, the sink closed, or their write failed.
        self.dropped = 0
        self._inner = inner
        self._queue: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        self._queued = 0  # submitted, neither written nor dropped yet
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._full = False  # a queue-full warning was logged; reset by the next queued event
        self._failing = False  # a write error was logged; reset by the next good write
        self._torn = False  # a failed write left part of a line
        self._file: io.FileIO | None = None
        self._writer = threading.Thread(
            target=self._write_loop, name="cachettl-event-log", daemon=True
        )
        self._writer.start()

    @property
    def queued(self) -> int:
        """Events submitted and not yet written or dropped."""
        with self._lock:
            return self._queued

    def counters(self) -> list[SinkCounter]:
        """Events written, dropped and queued, then the inner sink's counters."""
        with self._lock:
            own = [
                ("cachettl_event_log_written_total", "counter", self.written),
                ("cachettl_event_log_dropped_total", "counter", self.dropped),
                ("cachettl_event_log_queued", "gauge", self._queued),
            ]
        return own + (self._inner.counters() if self._inner is not None else [])

    # -- the caller's side -------------------------------------------------------------
    def submit(self, event: Event) -> None:
        """Queue ``event`` for the file (or drop it) and pass it on; never blocks on I/O."""
        with self._lock:
            closed = self._closed
            if closed or self._queued >= self.max_queued:
                self.dropped += 1
                warn, self._full = not self._full and not closed, True
            else:
                self._queued += 1
                self._queue.put(event)
                warn, self._full = False, False
        if warn:
            logger.warning(
                "event log %s: %d events queued, dropping events until the writer catches up",
                self.path,
                self.max_queued,
            )
        if self._inner is not None and not closed:
            self._inner.submit(event)

    # -- the writer thread -------------------------------------------------------------
    def _write_loop(self) -> None:
        self._open()
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH_EVENTS and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            events = [e for e in batch if e is not None]
            if events:
                try:
                    written = self._write(events)
                except Exception:  # never end the thread: later events still get written
                    logger.exception("event log %s: %d events not written", self.path, len(events))
                    written = 0
                with self._idle:
                    self.written += written
                    self.dropped += len(events) - written
                    self._queued -= len(events)
                    self._idle.notify_all()
            if stop:
                break
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _open(self) -> bool:
        if self._file is None:
            try:
                self._file = self.path.open("ab", buffering=0)
            except OSError as exc:
                self._failed(exc)
                return False
        return True

    def _write(self, events: list[Event]) -> int:
        """Write ``events``' lines; how many reached the file whole."""
        lines = [(json.dumps(event_record(e)) + "\n").encode() for e in events]
        if not self._open():
            return 0
        assert self._file is not None
        prefix = b"\n" if self._torn else b""  # end the line a failed write left torn
        data = prefix + b"".join(lines)
        done = 0
        try:
            while done < len(data):
                done += self._file.write(data[done:])
        except OSError as exc:
            self._failed(exc)
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None  # reopened for the next batch
            body = max(0, done - len(prefix))
            ends = list(itertools.accumulate(len(line) for line in lines))
            whole = bisect.bisect_right(ends, body)
            started = body > (ends[whole - 1] if whole else 0)
            self._torn = started or (self._torn and done < len(prefix))
            return whole
        self._torn = self._failing = False
        return len(events)

    def _failed(self, exc: OSError) -> None:
        if not self._failing:
            logger.error("event log %s: %s; dropping events until writes succeed", self.path, exc)
        self._failing = True

    # -- lifetime ----------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued event was written or dropped (True) or ``timeout_s``
        passed (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, close the file and stop the writer (waiting up to
        ``timeout_s``), then close the inner sink. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            logger.warning(
                "event log %s: writer still blocked after %.1fs, %d events not written",
                self.path,
                timeout_s,
                self.queued,
            )
        if self._inner is not None:
            self._inner.close()


def build_sink(config: HookConfig, decider: TtlDecider, engine_id: str) -> EventSink:
    """The sink the config asks for (control plane link and/or event log)."""
    sink: EventSink = NullSink()
    if config.control_plane:
        from enginehook.link.remote import ControlPlaneLink

        sink = ControlPlaneLink.from_config(config, decider, engine_id)
    if config.event_log:
        sink = JsonlSink(config.event_log, inner=sink)
    return sink
