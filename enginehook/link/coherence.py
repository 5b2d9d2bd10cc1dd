"""The engine's side of pin coherence: report turn arrivals, hear which programs moved away.

Behind a router that moves a program (a session-blind policy, a rebalance, an engine added
or removed), the engine the program left would hold its pin until the TTL and, if the
program ever came back, count the whole absence as one long tool call. The control plane
sees every engine's arrivals (:mod:`controlplane.coherence`) and tells the engine a program
left; the hook then drops the pin at once and reports the tool call with the duration it
really had (:meth:`enginehook.core.lifecycle.PinController.moved_away`).

Cost on the scheduler's thread: :meth:`CoherenceLink.arrived` is one ``deque.append`` and
:meth:`CoherenceLink.moved` one truthiness test when nothing moved. A reporter thread sends
arrivals in batches every :attr:`~CoherenceLink.interval_s`; a watcher thread follows
``WatchMoves`` and reconnects with back-off. Arrivals are hints: when the control plane is
down they are dropped (counted; a failed report is tried once more first), never buffered
without bound, and the engine falls back to what it does without coherence (the pin lives
until its TTL).

Refusal is per arrival: an arrival whose program id the control plane would refuse (empty,
over its length limit, with NUL, or not encodable as UTF-8) is left out of its batch and
counted (``refused``), and a batch the server still refuses as invalid is split until the
refused arrivals are found: one bad program id never costs the others their report. An
arrival the control plane refuses alone in a report it applied (a time ahead of its clock)
is counted apart (``server_refused``) and not as reported.
:meth:`CoherenceLink.counters` gives the counters to the hook's ``/metrics``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc

from controlplane._gen.cachettl.v1.cluster_pb2 import ReportArrivalsResponse, WatchMovesResponse
from controlplane.records import LIMITS
from controlplane.wire import timestamp_seconds

if TYPE_CHECKING:
    from enginehook.config import HookConfig

__all__ = ["BATCH", "CoherenceClient", "CoherenceLink", "Moved", "departed"]

logger = logging.getLogger("enginehook.link.coherence")

#: Most arrivals in one report (the server's bound).
BATCH = 1000
#: A program that moved: its id and when its turn arrived at the other engine.
Moved = tuple[str, float]


def departed(moved: Iterable[Moved], here: Mapping[str, float]) -> tuple[list[Moved], int]:
    """The moves that take a program's pin on this engine, and how many are stale.

    ``here``: the latest arrival of each program among the requests the engine holds. A
    move is stale when a turn of its program arrived here at or after the turn elsewhere
    (the program came back: its pin, if any, is that turn's). A request here that arrived
    *before* the turn elsewhere does not keep the pin: the program moved on from it (a
    client that gave up on this engine and asked another), and the pin would otherwise
    outlive it if it is aborted before admission.

    >>> departed([("a", 10.0), ("b", 10.0), ("c", 10.0)], {"b": 12.0, "c": 9.0})
    ([('a', 10.0), ('c', 10.0)], 1)
    """
    gone, stale = [], 0
    for program, arrived_at in moved:
        if here.get(program, -math.inf) >= arrived_at:
            stale += 1
        else:
            gone.append((program, arrived_at))
    return gone, stale


class CoherenceClient(Protocol):
    """What the link needs of ``controlplane.rpc.client.ControlPlaneClient``."""

    def report_arrivals_answer(
        self, engine_id: str, arrivals: Sequence[tuple[str, float]]
    ) -> ReportArrivalsResponse: ...

    def watch_moves(
        self, engine_id: str, timeout_s: float | None = None
    ) -> Iterator[WatchMovesResponse]: ...

    def close(self) -> None: ...


class CoherenceLink:
    """Arrivals out, moves in, for one engine (``engine_id``) over ``client``.

    ``on_moved`` (optional) is called on the watcher thread after a move is queued, so the
    host can wake an idle engine loop to apply it. ``max_pending``: arrivals kept while the
    reporter is behind or the control plane is down (the oldest go first, counted).
    """

    def __init__(
        self,
        client: CoherenceClient,
        engine_id: str,
        *,
        interval_s: float = 0.25,
        max_pending: int = 100_000,
        retry_s: float = 1.0,
        on_moved: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.engine_id = engine_id
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.on_moved = on_moved
        self._arrivals: deque[tuple[str, float]] = deque(maxlen=max_pending)
        self._moved: deque[Moved] = deque()
        self._stop = threading.Event()
        #: Arrivals reported; lost (the control plane down, or the reporter behind);
        #: refused (a program id the control plane refuses, left out here or split out);
        #: refused by the server one by one in a report it applied (an arrival time ahead
        #: of its clock...); moves received; moves found stale (a turn of the program
        #: arrived here since).
        self.reported = 0
        self.dropped = 0
        self.refused = 0
        self.server_refused = 0
        self.received = 0
        self.stale = 0
        self._refusal_logged = False
        self._server_refusal_logged = False
        self._threads = [
            threading.Thread(target=self._report_loop, name="cachettl-arrivals", daemon=True),
            threading.Thread(target=self._watch_loop, name="cachettl-moves", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def from_config(
        cls, config: HookConfig, engine_id: str, on_moved: Callable[[], None] | None = None
    ) -> CoherenceLink:
        """A link to the hook's ``control_plane`` with its token and TLS settings."""
        from enginehook.link.transport import client_from_config

        return cls(client_from_config(config), engine_id, on_moved=on_moved)

    # -- the scheduler's thread ------------------------------------------------------------
    def arrived(self, program_id: str, at: float) -> None:
        """A turn of ``program_id`` arrived here at ``at`` (seconds since the epoch)."""
        if len(self._arrivals) == self._arrivals.maxlen:
            self.dropped += 1
        self._arrivals.append((program_id, at))

    @property
    def pending(self) -> bool:
        """Whether moves wait to be taken (any thread; one truthiness test)."""
        return bool(self._moved)

    def moved(self) -> list[Moved]:
        """The programs that moved away since the last call (usually none)."""
        if not self._moved:
            return []
        taken = []
        while self._moved:
            taken.append(self._moved.popleft())
        return taken

    def departures(self, moved: Iterable[Moved], here: Mapping[str, float]) -> list[Moved]:
        """:func:`departed`, the stale moves counted."""
        gone, stale = departed(moved, here)
        self.stale += stale
        return gone

    # -- background threads ------------------------------------------------------------------
    def _take(self) -> list[tuple[str, float]]:
        batch: list[tuple[str, float]] = []
        while self._arrivals and len(batch) < BATCH:
            batch.append(self._arrivals.popleft())
        return batch

    def counters(self) -> list[tuple[str, str, int]]:
        """``(name, type, value)`` for the hook's ``/metrics``."""
        return [
            ("cachettl_coherence_arrivals_reported_total", "counter", self.reported),
            ("cachettl_coherence_arrivals_dropped_total", "counter", self.dropped),
            ("cachettl_coherence_arrivals_refused_total", "counter", self.refused),
            ("cachettl_coherence_arrivals_refused_by_server_total", "counter", self.server_refused),
            ("cachettl_coherence_arrivals_pending", "gauge", len(self._arrivals)),
            ("cachettl_coherence_moves_received_total", "counter", self.received),
            ("cachettl_coherence_moves_stale_total", "counter", self.stale),
        ]

    def _report_loop(self) -> None:
        """Report what arrived every :attr:`interval_s`. A batch whose report fails is tried
        once more after :attr:`retry_s` (a dropped arrival hides the program's next move
        for good: its pin would live until its TTL), then dropped (counted)."""
        failing, retry = False, list[tuple[str, float]]()
        while not self._stop.wait(self.retry_s if retry else self.interval_s):
            while batch := retry or self._take():
                again, retry = bool(retry), []
                if not again:
                    batch = self._acceptable(batch)
                try:
                    self._report(batch)
                except Exception as exc:
                    if again:
                        self.dropped += len(batch)
                    else:
                        retry = batch
                    if not failing:
                        logger.warning(
                            "CacheTTL pin coherence: arrivals not reported (%s); tried once "
                            "more, then dropped",
                            exc,
                        )
                    failing = True
                    break
                failing = False

    def _acceptable(self, batch: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """``batch`` without the arrivals whose program id the control plane refuses
        (counted, logged once)."""
        kept = [a for a in batch if _valid_program(a[0])]
        if len(kept) < len(batch):
            self._refused(len(batch) - len(kept), "a program id the control plane refuses")
        return kept

    def _report(self, batch: list[tuple[str, float]]) -> None:
        """Report ``batch``; one the server refuses as invalid is split in halves until
        each refused arrival is alone (refused and counted), the rest reported."""
        if not batch:
            return
        try:
            answer = self.client.report_arrivals_answer(self.engine_id, batch)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.INVALID_ARGUMENT:
                raise
            if len(batch) == 1:
                self._refused(1, str(exc.details())[:200])
                return
            half = len(batch) // 2
            self._report(batch[:half])
            self._report(batch[half:])
            return
        if answer.refused:
            self._server_refused(answer)
        self.reported += len(batch) - answer.refused
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "pin coherence: %d arrival(s) reported, the oldest %.3f s after it arrived",
                len(batch) - answer.refused,
                time.time() - min(at for _, at in batch),
            )

    def _server_refused(self, answer: ReportArrivalsResponse) -> None:
        """Count the arrivals the control plane refused one by one in a report it applied
        (the first time, logged with the first reason it named)."""
        self.server_refused += answer.refused
        if not self._server_refusal_logged:
            self._server_refusal_logged = True
            why = answer.refusals[0].reason if answer.refusals else "no reason named"
            logger.warning(
                "CacheTTL pin coherence: the control plane refused %d arrival(s) of a report "
                "(%s); further refusals are counted only",
                answer.refused,
                why[:200],
            )

    def _refused(self, n: int, why: str) -> None:
        self.refused += n
        if not self._refusal_logged:
            self._refusal_logged = True
            logger.warning(
                "CacheTTL pin coherence: %d arrival(s) refused (%s); the rest of their batch "
                "is reported; further refusals are counted only",
                n,
                why,
            )

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow(self.client.watch_moves(self.engine_id))
            except Exception as exc:
                if self._stop.is_set():
                    return
                logger.warning("CacheTTL pin coherence: move stream lost (%s); retrying", exc)
            self._stop.wait(self.retry_s)

    def _follow(self, stream: Iterable[WatchMovesResponse]) -> None:
        for moved in stream:
            arrived_at = timestamp_seconds(moved.arrived_at)
            self._moved.append((moved.program_id, arrived_at))
            self.received += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "pin coherence: move of %r to %r heard %.3f s after its arrival there",
                    moved.program_id,
                    moved.to_engine_id,
                    time.time() - arrived_at,
                )
            if self.on_moved is not None:
                self.on_moved()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop both threads (arrivals not yet reported are dropped: they are hints)."""
        self._stop.set()
        self.client.close()
        for thread in self._threads:
            thread.join(timeout_s)


def _valid_program(program_id: str) -> bool:
    """Whether the control plane takes ``program_id`` (``check_name``'s rule, and UTF-8)."""
    if not program_id or len(program_id) > LIMITS.program_id or "\x00" in program_id:
        return False
    try:
        program_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
