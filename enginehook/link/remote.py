"""The engine's link to the control plane: events out in batches, snapshots in.

Nothing here runs on the scheduler's thread except :meth:`ControlPlaneLink.submit`, which
appends to a bounded in-memory buffer (and, past ``memory_events``, to spill files on
local disk) and returns. A sender thread delivers batches through a :class:`Transport`
(``RecordToolCalls`` / ``RecordProgramEnd``), retrying with back-off while the control
plane is down; an event leaves the buffer only once the server acknowledged it, and the
server drops repeats by event id, so delivery has no loss and no duplicates. A watcher
thread follows ``WatchSnapshots`` and installs each snapshot in the engine's decider.

:func:`to_tool_call` and :func:`to_program_end` are the one conversion of the hook's events
to the control plane's records; the simulator's demo reports through them too.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from controlplane.records import ProgramEnd, ToolCall
from enginehook.core.tracker import ProgramEndEvent, ToolCallEvent, event_from_record, event_record
from enginehook.link.snapshot import SnapshotData, models_from_snapshot

if TYPE_CHECKING:
    from enginehook.core.config import HookConfig
    from enginehook.core.decide import TtlDecider
    from enginehook.link.sinks import SinkCounter

__all__ = [
    "ControlPlaneLink",
    "EventBuffer",
    "PermanentError",
    "Transport",
    "to_program_end",
    "to_tool_call",
]

logger = logging.getLogger("enginehook.link.remote")

Event = ToolCallEvent | ProgramEndEvent


class PermanentError(Exception):
    """The control plane refused an event for good (bad input, or a limit it marks final,
    such as a tenant's bound on distinct tool names): retrying cannot help."""


class Transport(Protocol):
    """How batches reach the control plane; every call may raise on failure."""

    def send_tool_calls(self, events: Sequence[ToolCallEvent]) -> None: ...

    def send_program_end(self, event: ProgramEndEvent) -> None: ...

    def watch(self, after_version: int) -> Iterator[SnapshotData]: ...

    def close(self) -> None: ...


def to_tool_call(event: ToolCallEvent) -> ToolCall:
    """The control plane's record of a hook's tool-call event (``RecordToolCalls``).

    Every field travels but ``tenant`` (the server takes it from the token) and ``basis``;
    the returning turn's cache report (miss reason and details) too.
    The admission delay is sent whatever the outcome: the server, like the hook's own
    learner, counts it as a sample of T only when ``PinOutcome.feeds_queue_delay``.
    """
    return ToolCall(
        event_id=event.event_id,
        program_id=event.program_id,
        tool_name=event.tool_name,
        tool_args=event.tool_args or "",
        duration_s=event.duration_s,
        finished_at=event.finished_at,
        turn_index=event.turn_index,
        chosen_ttl_s=event.ttl_s,
        pin_outcome=event.outcome,
        admission_delay_s=event.admission_delay_s,
        cache=event.cache,
    )


def to_program_end(event: ProgramEndEvent) -> ProgramEnd:
    """The control plane's record of a hook's program end (``RecordProgramEnd``)."""
    return ProgramEnd(event.program_id, event.total_turns, event.ended_at)


def _to_json(event: Event) -> str:
    return json.dumps(event_record(event))


def _count_lines(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def _from_json(line: str) -> Event:
    return event_from_record(json.loads(line))


class EventBuffer:
    """FIFO of undelivered events: up to ``memory_events`` in memory, the rest in spill
    segment files of ``segment_events`` lines under ``spill_dir``. Segments left by an
    earlier process in ``spill_dir`` are picked up. Thread-safe."""

    def __init__(
        self, spill_dir: str | Path, memory_events: int = 10_000, segment_events: int = 1000
    ) -> None:
        if memory_events < 1 or segment_events < 1:
            raise ValueError("memory_events and segment_events must be >= 1")
        self.spill_dir = Path(spill_dir)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.memory_events = memory_events
        self.segment_events = segment_events
        self._memory: deque[Event] = deque()
        self._lock = threading.Lock()
        self._segments: deque[Path] = deque(sorted(self.spill_dir.glob("spill-*.jsonl")))
        self._open_lines = self.segment_events  # never append to an earlier process's file
        self._seq = int(self._segments[-1].stem.split("-")[1]) if self._segments else 0
        self._spilled = sum(_count_lines(p) for p in self._segments)

    def put(self, event: Event) -> None:
        """Queue ``event`` (in memory, or spilled once memory is full or spill is pending)."""
        with self._lock:
            if len(self._memory) < self.memory_events and not self._segments:
                self._memory.append(event)
                return
            self._spill(event)

    def _spill(self, event: Event) -> None:
        if not self._segments or self._open_lines >= self.segment_events:
            self._seq += 1
            self._segments.append(self.spill_dir / f"spill-{self._seq:09d}.jsonl")
            self._open_lines = 0
        with self._segments[-1].open("a", encoding="utf-8") as f:
            f.write(_to_json(event) + "\n")
        self._open_lines += 1
        self._spilled += 1

    def peek(self, n: int) -> list[Event]:
        """Up to ``n`` oldest events (refilling memory from the oldest spill segment)."""
        with self._lock:
            if not self._memory and self._segments:
                self._refill()
            return [self._memory[i] for i in range(min(n, len(self._memory)))]

    def _refill(self) -> None:
        segment = self._segments.popleft()
        if not self._segments:
            self._open_lines = self.segment_events
        lines = segment.read_text(encoding="utf-8").splitlines() if segment.exists() else []
        events = [_from_json(line) for line in lines if line.strip()]
        self._memory.extend(events)
        self._spilled -= len(events)
        segment.unlink(missing_ok=True)

    def spill_all(self) -> int:
        """Move every in-memory event to spill files (at shutdown); returns how many."""
        with self._lock:
            moved = list(self._memory)
            self._memory.clear()
            self._open_lines = self.segment_events
            for event in moved:
                self._spill(event)
            return len(moved)

    def drop(self, n: int) -> None:
        """Remove the ``n`` oldest events (after they were delivered)."""
        with self._lock:
            for _ in range(min(n, len(self._memory))):
                self._memory.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._memory) + self._spilled

    @property
    def in_memory(self) -> int:
        """Events held in memory."""
        with self._lock:
            return len(self._memory)


class ControlPlaneLink:
    """Background delivery of events and snapshots (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        buffer: EventBuffer,
        decider: TtlDecider | None = None,
        *,
        batch_events: int = 500,
        flush_interval_s: float = 0.2,
        max_backoff_s: float = 5.0,
        watch_snapshots: bool = True,
    ) -> None:
        self.transport = transport
        self.buffer = buffer
        self.decider = decider
        self.batch_events = batch_events
        self.flush_interval_s = flush_interval_s
        self.max_backoff_s = max_backoff_s
        self.delivered = 0
        self.rejected = 0
        self.failures = 0
        self.snapshots = 0
        self.snapshot_version = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="cachettl-events", daemon=True)
        self._sender.start()
        self._watcher: threading.Thread | None = None
        if watch_snapshots and decider is not None:
            self._watcher = threading.Thread(
                target=self._watch_loop, name="cachettl-snapshots", daemon=True
            )
            self._watcher.start()

    @classmethod
    def from_config(
        cls, config: HookConfig, decider: TtlDecider, engine_id: str
    ) -> ControlPlaneLink:
        """A gRPC link to ``config.control_plane`` with ``config.token``."""
        spill = config.spill_dir or tempfile.mkdtemp(prefix=f"cachettl-spill-{engine_id}-")
        return cls(GrpcTransport(config.control_plane, config.token), EventBuffer(spill), decider)

    # -- the scheduler's side ----------------------------------------------------------
    def submit(self, event: Event) -> None:
        """Queue one event for delivery; never blocks on the network."""
        self.buffer.put(event)
        if self.buffer.in_memory >= self.batch_events:
            self._wake.set()

    def counters(self) -> list[SinkCounter]:
        """Events delivered, refused and waiting; failed sends; snapshots received."""
        return [
            ("cachettl_control_plane_events_delivered_total", "counter", self.delivered),
            ("cachettl_control_plane_events_rejected_total", "counter", self.rejected),
            ("cachettl_control_plane_events_pending", "gauge", len(self.buffer)),
            ("cachettl_control_plane_send_failures_total", "counter", self.failures),
            ("cachettl_control_plane_snapshots_total", "counter", self.snapshots),
            ("cachettl_control_plane_snapshot_version", "gauge", self.snapshot_version),
        ]

    # -- the sender thread -------------------------------------------------------------
    def _send_loop(self) -> None:
        backoff = self.flush_interval_s
        while True:
            stopping = self._stop.is_set()
            try:
                sent = self._send_once()
            except Exception as exc:  # the control plane is down or slow: keep the events
                self.failures += 1
                logger.debug("control plane unreachable (%s); retrying in %.1fs", exc, backoff)
                if stopping:
                    return
                self._stop.wait(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)
                continue
            backoff = self.flush_interval_s
            if sent:
                continue
            if stopping:
                return
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()

    def _send_once(self) -> bool:
        """Deliver one batch; True if anything was delivered or dropped."""
        batch = self.buffer.peek(self.batch_events)
        if not batch:
            return False
        calls: list[ToolCallEvent] = []
        for event in batch:
            if isinstance(event, ProgramEndEvent):
                break
            calls.append(event)
        if calls:
            self._deliver_calls(calls)
            self.buffer.drop(len(calls))
            return True
        end = batch[0]
        assert isinstance(end, ProgramEndEvent)
        try:
            self.transport.send_program_end(end)
            self.delivered += 1
        except PermanentError as exc:
            self.rejected += 1
            logger.warning("control plane refused %s: %s", end.event_id, exc)
        self.buffer.drop(1)
        return True

    def _deliver_calls(self, calls: list[ToolCallEvent]) -> None:
        try:
            self.transport.send_tool_calls(calls)
            self.delivered += len(calls)
        except PermanentError as exc:
            if len(calls) == 1:
                self.rejected += 1
                logger.warning("control plane refused %s: %s", calls[0].event_id, exc)
                return
            for call in calls:  # find the bad one; the server drops repeats by event id
                self._deliver_calls([call])

    # -- the snapshot thread -----------------------------------------------------------
    def _watch_loop(self) -> None:
        assert self.decider is not None
        backoff = self.flush_interval_s
        while not self._stop.is_set():
            try:
                for snap in self.transport.watch(self.snapshot_version):
                    models = models_from_snapshot(
                        snap,
                        self.decider.policy,
                        tenant=self.decider.tenant,
                        base=self.decider.models,
                    )
                    self.decider.replace_models(models, str(snap.version))
                    self.snapshot_version = snap.version
                    self.snapshots += 1
                    backoff = self.flush_interval_s
                    if self._stop.is_set():
                        return
            except Exception as exc:
                logger.debug("snapshot stream ended (%s)", exc)
            self._stop.wait(backoff)
            backoff = min(self.max_backoff_s, backoff * 2)

    # -- lifetime ----------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued event was delivered (True) or ``timeout_s`` passed."""
        done = threading.Event()
        deadline = threading.Timer(timeout_s, done.set)
        deadline.start()
        try:
            while len(self.buffer) and not done.is_set():
                self._wake.set()
                done.wait(0.05)
            return len(self.buffer) == 0
        finally:
            deadline.cancel()

    def close(self, timeout_s: float = 5.0) -> None:
        """Try to deliver what is queued (up to ``timeout_s``), stop the threads, and
        spill whatever is left so that the next start with the same ``spill_dir``
        delivers it."""
        self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        self._sender.join(timeout_s)
        left = self.buffer.spill_all()
        if left:
            logger.warning("%d undelivered events spilled to %s", left, self.buffer.spill_dir)
        self.transport.close()


class GrpcTransport:
    """:class:`Transport` over ``controlplane.rpc.client.ControlPlaneClient``."""

    def __init__(self, target: str, token: str, timeout_s: float = 5.0) -> None:
        from controlplane.rpc.client import ControlPlaneClient

        self._client = ControlPlaneClient(target, token, timeout_s=timeout_s)

    @staticmethod
    def _check(exc: Exception) -> None:
        """Raise :class:`PermanentError` for an answer that retrying cannot cure: bad input,
        or a limit the server marks final (a tenant's name bound)."""
        import grpc

        from controlplane.errors import RETRYABLE_KEY

        if not isinstance(exc, grpc.RpcError):
            return
        trailer = dict(exc.trailing_metadata() or ())
        final = trailer.get(RETRYABLE_KEY) == "false"
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT or final:
            raise PermanentError(str(exc.details())) from exc

    def send_tool_calls(self, events: Sequence[ToolCallEvent]) -> None:
        try:
            self._client.record_tool_calls([to_tool_call(e) for e in events])
        except Exception as exc:
            self._check(exc)
            raise

    def send_program_end(self, event: ProgramEndEvent) -> None:
        end = to_program_end(event)
        try:
            self._client.record_program_end(end.program_id, end.total_turns, end.finished_at)
        except Exception as exc:
            self._check(exc)
            raise

    def watch(self, after_version: int) -> Iterator[SnapshotData]:
        from enginehook.link.snapshot import SnapshotModel

        for r in self._client.watch_snapshots(after_version):
            models = [
                SnapshotModel(
                    m.tool_name,
                    m.signature,
                    m.level,
                    list(m.sorted_durations_seconds),
                    m.sample_count,
                )
                for m in r.models
            ]
            delay = r.queue_delay.seconds + r.queue_delay.nanos / 1e9
            yield SnapshotData(r.version, models, r.eta, delay, r.min_samples)

    def close(self) -> None:
        self._client.close()
