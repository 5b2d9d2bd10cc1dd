"""The engine's link to the control plane: events out in batches, snapshots in.

Nothing here runs on the scheduler's thread except :meth:`ControlPlaneLink.submit`, which
puts the event on a queue and returns. A sender thread moves queued events into the
:class:`~enginehook.link.spill.EventBuffer` (memory, then spill segments on local disk)
and delivers batches through a :class:`Transport` (``RecordToolCalls`` /
``RecordProgramEnd``), retrying with back-off while the control plane is down; an event
leaves the buffer only once the server acknowledged it, and the server drops repeats by
event id, so delivery has no loss and no duplicates. A watcher thread follows
``WatchSnapshots`` and installs each snapshot in the engine's decider.

The send rule: while the control plane answers, a batch goes every ``send_interval_s``
(1 s by default), or as soon as ``batch_events`` wait: the control plane's CPU is mostly
per call, so an engine at a few events a second sends a few events a call rather than
one (``docs/sizing.md``). The flush rule: while the control plane answers, events wait
in memory (at most
``memory_events``; past that they go to disk). The first failed send puts every event in
memory on disk, and from then on until the spill is delivered the sender appends what the
scheduler handed over to the spill and ``fsync`` s it every ``flush_interval_s`` (0.2 s by
default), also between retries. So once the control plane is unreachable, a crash of the
engine loses at most the events of the last ``flush_interval_s``; the next start with the
same spill folder delivers the rest. The same deadline holds while a send hangs (a control
plane that accepts connections and never answers): a watchdog thread puts what waits in
memory on disk once a send has been out ``flush_interval_s``; a batch moved so is
delivered again from the disk (the control plane drops repeats by event id).

The transport, its gRPC implementation and the conversion of the hook's events to the
control plane's records are in :mod:`enginehook.link.transport`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from controlplane.errors import retry_after_s
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from enginehook.link.snapshot import models_from_snapshot
from enginehook.link.spill import EventBuffer, claim_spill_dir, default_spill_dir
from enginehook.link.transport import (
    GrpcTransport,
    PermanentError,
    Transport,
    tls_from_config,
)

if TYPE_CHECKING:
    from enginehook.config import HookConfig
    from enginehook.link.base import SinkCounter
    from enginehook.link.decide import TtlDecider

__all__ = [
    "ControlPlaneLink",
    # Kept for enginehook.link.coherence, which imports it from here.
]

logger = logging.getLogger("enginehook.link.remote")

Event = ToolCallReport | ProgramEndReport

#: Event ids remembered as settled while the watchdog had moved them to disk (past that
#: they are sent again; the control plane drops repeats by event id).
_MAX_SETTLED = 100_000


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
        send_interval_s: float = 1.0,
        max_backoff_s: float = 5.0,
        watch_snapshots: bool = True,
    ) -> None:
        self.transport = transport
        self.buffer = buffer
        self.decider = decider
        self.batch_events = batch_events
        self.flush_interval_s = flush_interval_s
        self.send_interval_s = send_interval_s
        self.max_backoff_s = max_backoff_s
        self.delivered = 0
        self.rejected = 0
        self.failures = 0
        self.snapshots = 0
        self.snapshot_failures = 0
        self.snapshot_version = 0
        self._incoming: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock: IO[bytes] | None = None  # the spill folder's lock, held while open
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sending_since: float | None = None  # monotonic start of the send under way
        self._settled: set[str] = set()  # settled, then moved to disk by the watchdog
        self._sender = threading.Thread(target=self._send_loop, name="cachettl-events", daemon=True)
        self._sender.start()
        self._deadline = threading.Thread(
            target=self._deadline_loop, name="cachettl-spill-deadline", daemon=True
        )
        self._deadline.start()
        self._watcher: threading.Thread | None = None
        if watch_snapshots and decider is not None:
            self._watcher = threading.Thread(
                target=self._watch_loop, name="cachettl-snapshots", daemon=True
            )
            self._watcher.start()

    @classmethod
    def from_config(
        cls, config: HookConfig, decider: TtlDecider, engine_id: str, key: str = ""
    ) -> ControlPlaneLink:
        """A gRPC link to ``config.control_plane`` with ``config.token`` (and TLS when
        ``tls_ca_file`` is set); its spill in ``config.spill_dir`` or, unset, in the
        stable :func:`~enginehook.link.spill.default_spill_dir` for ``key`` (the engine's
        model), claimed against other live engines."""
        transport = GrpcTransport(
            config.control_plane,
            config.token,
            tls=tls_from_config(config),
            allow_plaintext_token=config.allow_plaintext_token,
        )
        token = config.token
        base = Path(
            config.spill_dir or default_spill_dir(config.control_plane, config.tenant, key, token)
        )
        folder, lock = claim_spill_dir(base, token)
        buffer = EventBuffer(folder, max_bytes=config.spill_max_bytes, token=token)
        if len(buffer):
            logger.info("%d undelivered events found in %s", len(buffer), folder)
        link = cls(transport, buffer, decider)
        link._lock = lock
        return link

    # -- the scheduler's side ----------------------------------------------------------
    def submit(self, event: Event) -> None:
        """Queue one event for delivery; never blocks on the network or the disk."""
        self._incoming.put(event)
        if self._incoming.qsize() >= self.batch_events:
            self._wake.set()

    def counters(self) -> list[SinkCounter]:
        """Events delivered, refused and waiting; failed sends; snapshots received."""
        return [
            ("cachettl_control_plane_events_delivered_total", "counter", self.delivered),
            ("cachettl_control_plane_events_rejected_total", "counter", self.rejected),
            ("cachettl_control_plane_events_pending", "gauge", self.pending()),
            ("cachettl_control_plane_spill_bytes", "gauge", self.buffer.spilled_bytes),
            ("cachettl_control_plane_spill_dropped_total", "counter", self.buffer.dropped),
            ("cachettl_control_plane_send_failures_total", "counter", self.failures),
            ("cachettl_control_plane_snapshots_total", "counter", self.snapshots),
            ("cachettl_control_plane_snapshot_failures_total", "counter", self.snapshot_failures),
            ("cachettl_control_plane_snapshot_version", "gauge", self.snapshot_version),
        ]

    def pending(self) -> int:
        """Events handed over and not delivered yet (queued, in memory and spilled)."""
        return self._incoming.qsize() + len(self.buffer)

    # -- the sender thread -------------------------------------------------------------
    def _take_incoming(self, down: bool) -> None:
        """Move what the scheduler handed over into the buffer; while the control plane
        is down, onto the disk (synced)."""
        took = False
        while True:
            try:
                event = self._incoming.get_nowait()
            except queue.Empty:
                break
            self.buffer.put(event)
            took = True
        if took and down:
            self.buffer.spill_all()
            self.buffer.sync()

    def _send_loop(self) -> None:
        backoff, retry_at, down = self.flush_interval_s, 0.0, False
        while True:
            stopping = self._stop.is_set()
            self._take_incoming(down)
            if time.monotonic() >= retry_at:
                try:
                    sent = self._send_once()
                except Exception as exc:  # the control plane is down or slow: keep the events
                    self.failures += 1
                    logger.debug("control plane unreachable (%s); retrying in %.1fs", exc, backoff)
                    if not down:
                        down = True
                        self.buffer.spill_all()
                        self.buffer.sync()
                    if stopping:
                        return
                    # A server refusing for this tenant's share says how long to wait.
                    retry_at = time.monotonic() + max(backoff, retry_after_s(exc) or 0.0)
                    backoff = min(self.max_backoff_s, backoff * 2)
                    self._stop.wait(min(self.flush_interval_s, backoff))
                    continue
                backoff, retry_at, down = self.flush_interval_s, 0.0, False
                if sent:
                    continue
            if stopping:
                return
            self._wake.wait(self.flush_interval_s if down else self.send_interval_s)
            self._wake.clear()

    def _deadline_loop(self) -> None:
        """Every ``flush_interval_s``: once a send has been out that long, what waits in
        memory (and what the scheduler handed over) goes on disk, synced."""
        while not self._stop.wait(self.flush_interval_s):
            since = self._sending_since
            if since is not None and time.monotonic() - since >= self.flush_interval_s:
                self._take_incoming(down=False)
                if self.buffer.spill_all() or self.buffer.spilled_bytes:
                    self.buffer.sync()

    def _send_once(self) -> bool:
        """Deliver one batch; True if anything was delivered or dropped."""
        self._sending_since = time.monotonic()
        try:
            return self._send_batch()
        finally:
            self._sending_since = None

    def _send_batch(self) -> bool:
        epoch = self.buffer.epoch
        batch = self.buffer.peek(self.batch_events)
        if not batch:
            return False
        settled = 0  # events settled before the watchdog moved them to disk: not sent again
        while settled < len(batch) and batch[settled].event_id in self._settled:
            self._settled.discard(batch[settled].event_id)
            settled += 1
        if settled:
            self.buffer.drop(settled, epoch)
            return True
        calls: list[ToolCallReport] = []
        for event in batch:
            if isinstance(event, ProgramEndReport) or event.event_id in self._settled:
                break
            calls.append(event)
        if calls:
            self._deliver_calls(calls)
            self._dropped(calls, epoch)
            return True
        end = batch[0]
        assert isinstance(end, ProgramEndReport)
        try:
            self.transport.send_program_end(end)
            self.delivered += 1
        except PermanentError as exc:
            self.rejected += 1
            logger.warning("control plane refused %s: %s", end.event_id, exc)
        self._dropped([end], epoch)
        return True

    def _dropped(self, events: Sequence[Event], epoch: int) -> None:
        """``events`` were settled (delivered or refused): out of the buffer, or, when the
        watchdog moved them to disk meanwhile, remembered so they are not sent again."""
        if epoch == self.buffer.epoch:
            self.buffer.drop(len(events), epoch)
            return
        if len(self._settled) < _MAX_SETTLED:
            self._settled.update(e.event_id for e in events)

    def _deliver_calls(self, calls: list[ToolCallReport]) -> None:
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
                    self.decider.rollout.remote = snap.rollout  # None: the engine's own
                    self.snapshot_version = snap.version
                    self.snapshots += 1
                    backoff = self.flush_interval_s
                    if self._stop.is_set():
                        return
            except Exception as exc:
                self.snapshot_failures += 1
                logger.warning("snapshot stream failed, retrying: %s", str(exc)[:300])
            self._stop.wait(backoff)
            backoff = min(self.max_backoff_s, backoff * 2)

    # -- lifetime ----------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued event was delivered (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline:
            self._wake.set()
            self._stop.wait(0.05)
        return self.pending() == 0

    def close(self, timeout_s: float = 5.0) -> None:
        """Try to deliver what is queued (up to ``timeout_s``), stop the threads, and
        spill whatever is left so that the next start with the same spill folder
        delivers it."""
        self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        self._sender.join(timeout_s)
        self._deadline.join(timeout_s)
        if not self._sender.is_alive():
            self._take_incoming(down=False)
            left = self.buffer.spill_all()
            self.buffer.forget_memory()
            if left:
                logger.warning("%d undelivered events spilled to %s", left, self.buffer.spill_dir)
        self.buffer.close()
        self.transport.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None
