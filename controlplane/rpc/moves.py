"""The watching side of pin coherence: each ``WatchMoves`` stream's queue of moves, and the
fan-out of a report's moves to the streams of the engines the programs left, on this replica
and, through PostgreSQL, on the others (:mod:`controlplane.coherence`; the wire's side,
checking reports, is :mod:`controlplane.rpc.coherence`).

On SQLite (or ``memory://``) served from memory: a report is checked and applied in a
worker thread (an arrival costs a dictionary update), and its moves are queued on the event
loop a slice at a time (one entry per watcher of the engine the program left), so that a
flood of reports does not hold the loop where decisions are answered. On PostgreSQL the
locations are the database's (:class:`controlplane.storage.locations.SharedLocations`), so
that replicas sharing it see moves between engines linked to different replicas: a report
is one statement, run in a worker thread; its moves go at once to this replica's watchers,
and through ``NOTIFY`` to the other replicas, each of which listens (one connection, while
it has watchers and :data:`RESUME_S` after the last left) and hands them to its own. A
replica never tells its watchers a move twice: it skips the notifications it published
itself.

Memory is bounded whatever the watchers read. A watcher's unread moves are kept per program,
the newest superseding an older one of the same program (coalesced), at most
:data:`STREAM_MOVES` programs per stream, :data:`TENANT_MOVES` per tenant and
:data:`SERVER_MOVES` in all. A move that would pass a bound drops the slowest watcher instead
(the tenant's, or anyone's, with the most unread moves): its unread moves are freed, it is
told nothing more, and its call ends RESOURCE_EXHAUSTED as soon as it reads again; counted
(``streams_dropped``, ``moves_dropped``), and logged once per tenant per minute. An engine
whose stream is dropped reconnects; the pins it was not told of live until their TTL, as
they would without this service; so do those whose move was published while the replica's
listening connection was down (it reconnects with backoff).

A stream that ends otherwise (a broken connection, an engine reconnecting) costs its engine
nothing if it is back within :data:`RESUME_S`: the moves away from it meanwhile are kept
(:mod:`controlplane.rpc.kept`) and are the first its next stream here reads; the replica
keeps listening to the others for as long. Kept moves count toward the tenant's and the
server's bounds and give way first: at a bound a move for an engine away is not kept, and a
watching stream's move frees the oldest kept one before any stream is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from controlplane._gen.cachettl.v1.cluster_pb2 import WatchMovesResponse
from controlplane.coherence import ProgramLocations
from controlplane.errors import OverloadedError
from controlplane.records import Move, Tenant
from controlplane.rpc.kept import RESUME_S, KeptMoves
from controlplane.storage.locations import RETRY_FIRST_S, SharedLocations
from controlplane.wire import timestamp

__all__ = ["SERVER_MOVES", "STREAM_MOVES", "TENANT_MOVES", "CoherenceHub"]

log = logging.getLogger(__name__)

#: Programs with an unread move kept per watching stream (a newer move of the same program
#: replaces the older one): four full reports, since one report's moves are queued before
#: a watcher that keeps up can take any.
STREAM_MOVES = 4096
#: Unread moves kept per tenant, over all its streams on this server.
TENANT_MOVES = 16_384
#: Unread moves kept on this server, over all tenants.
SERVER_MOVES = 65_536
#: A move queued this long after its arrival (by the reporting engine's clock) is late.
LATE_S = 1.0
#: Seconds between two log lines about one tenant's dropped streams (or late moves).
LOG_EVERY_S = 60.0
#: Seconds between two rounds of the shared locations' upkeep (pruning, per-tenant bounds).
MAINTAIN_EVERY_S = 1.0
#: Moves queued per turn of the event loop (a full report is queued in slices, so that
#: other calls, decisions above all, are answered in between).
TELL_SLICE = 100


class _Watcher:
    """One ``WatchMoves`` stream: its unread moves by program, oldest first."""

    __slots__ = ("dropped", "key", "unread", "wake")

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.unread: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.wake = asyncio.Event()
        self.dropped: str | None = None


class CoherenceHub:
    """The locations and the watching streams, per tenant and engine.

    ``shared``: the database's locations (PostgreSQL), else ``locations`` in memory.
    ``replica``: this server's name in what it publishes (random by default). The bounds
    default to the module's.
    """

    def __init__(
        self,
        locations: ProgramLocations | None = None,
        shared: SharedLocations | None = None,
        replica: str | None = None,
        stream_moves: int = STREAM_MOVES,
        tenant_moves: int = TENANT_MOVES,
        server_moves: int = SERVER_MOVES,
    ) -> None:
        self.locations = locations or ProgramLocations()
        self.shared = shared
        self.replica = replica or uuid.uuid4().hex
        self.stream_moves = stream_moves
        self.tenant_moves = tenant_moves
        self.server_moves = server_moves
        self._watchers: dict[tuple[str, str], set[_Watcher]] = {}
        self._kept = KeptMoves(stream_moves)  # for engines whose last stream here ended
        self._of_tenant: dict[str, set[_Watcher]] = {}
        self._unread: dict[str, int] = {}  # per tenant
        self._unread_total = 0
        self._logged: dict[str, float] = {}
        self._listening: asyncio.Task[None] | None = None
        self._maintaining: asyncio.Task[None] | None = None
        self._here_lock = threading.Lock()
        #: Runs a report's blocking part, ``off_loop(tenant, fn, *args)`` (the server sets
        #: its fair lanes, :mod:`controlplane.rpc.lanes`; alone, a worker thread).
        self.off_loop: Callable[..., Awaitable[Any]] = _to_thread
        self._late_logged = float("-inf")
        #: Moves told to a watching engine, per (tenant, engine the program left).
        self.told: Counter[tuple[str, str]] = Counter()
        self.moves_sent = 0
        self.moves_late = 0
        self.moves_coalesced = 0
        self.moves_dropped = 0
        self.streams_dropped = 0
        self.arrivals_refused = 0

    def watching(self, tenant: str) -> dict[str, int]:
        """The tenant's engines watching for moves on this server, with their streams."""
        return {e: len(w) for (t, e), w in list(self._watchers.items()) if t == tenant}

    def told_to(self, tenant: str) -> dict[str, int]:
        """Moves told to the tenant's watching engines here, per engine the program left."""
        return {e: n for (t, e), n in list(self.told.items()) if t == tenant}

    def programs_here(self, tenant: str) -> Counter[str] | None:
        """Programs last seen on each of the tenant's engines (``None`` where the locations
        are the database's, which this server does not hold)."""
        if self.shared is not None:
            return None
        with self._here_lock:
            return self.locations.engines(tenant)

    @property
    def unread(self) -> int:
        """Moves queued for watchers on this server."""
        return self._unread_total

    async def report(self, tenant: Tenant, engine: str, arrived: list[tuple[str, float]]) -> int:
        """Apply a checked report and tell the watchers here; returns how many arrivals
        were moves. ``StorageError`` when the shared locations' database fails."""
        if not arrived:
            return 0
        if self.shared is None:
            moves = await self.off_loop(
                tenant.name, self._report_here, tenant.name, engine, arrived
            )
        else:
            if self._maintaining is None:
                self._maintaining = asyncio.create_task(self._maintain())
            report = self.shared.report
            moves = await self.off_loop(tenant.name, report, tenant, engine, arrived, self.replica)
        for start in range(0, len(moves), TELL_SLICE):  # other calls run in between
            self.tell(tenant.name, moves[start : start + TELL_SLICE])
            await asyncio.sleep(0)
        return len(moves)

    def _report_here(
        self, tenant: str, engine: str, arrived: list[tuple[str, float]]
    ) -> list[Move]:
        with self._here_lock:  # the in-memory locations are single-threaded
            return self.locations.report(tenant, engine, arrived)

    def tell(self, tenant: str, moves: Iterable[Move]) -> None:
        """Queue each move for the watchers of the engine it left (module docstring:
        coalesced per program, bounded, the slowest watcher dropped at a bound). A move
        queued more than :data:`LATE_S` after its arrival is logged (once per
        :data:`LOG_EVERY_S`) with where the time went, so that a pin released late can be
        traced to the report, the database or the notification."""
        now = time.time()
        for move in moves:
            watchers = self._watchers.get((tenant, move.from_engine))
            if not watchers:
                self._keep(tenant, move)
                continue
            self.told[tenant, move.from_engine] += 1
            late = now - move.arrived_at
            if late > LATE_S:
                self.moves_late += 1
                if now - self._late_logged >= LOG_EVERY_S:
                    self._late_logged = now
                    log.warning(
                        "pin coherence: tenant %r: move of a program to %r queued %.2f s "
                        "after its arrival there (%d such moves so far)",
                        tenant,
                        move.to_engine,
                        late,
                        self.moves_late,
                    )
            for watcher in list(watchers):
                if watcher.dropped is None:
                    self._queue(tenant, watcher, move)

    def _keep(self, tenant: str, move: Move) -> None:
        """Keep ``move`` for the next stream of the engine it left, if that engine's last
        stream here ended less than :data:`RESUME_S` ago and the bounds allow (module
        docstring)."""
        key = (tenant, move.from_engine)
        if not self._kept.keeping(key):
            return
        room = (
            self._unread.get(tenant, 0) + self._kept.of(tenant) < self.tenant_moves
            and self._unread_total + self._kept.total < self.server_moves
        )
        if not self._kept.keep(key, move.program_id, (move.to_engine, move.arrived_at), room):
            self.moves_dropped += 1

    @property
    def kept(self) -> int:
        """Moves kept on this server for engines whose stream ended (:data:`RESUME_S`)."""
        return self._kept.total

    def _resumed(self, watcher: _Watcher) -> None:
        """Queue for ``watcher`` the moves kept since its engine's last stream ended."""
        tenant = watcher.key[0]
        for program, (to, at) in self._kept.resume(watcher.key).items():
            if watcher.dropped is None:
                self._queue(tenant, watcher, Move(program, watcher.key[1], to, at))

    def _queue(self, tenant: str, watcher: _Watcher, move: Move) -> None:
        unread = watcher.unread
        entry = (move.to_engine, move.arrived_at)
        if move.program_id in unread:  # the newer move supersedes the older one
            unread[move.program_id] = entry
            unread.move_to_end(move.program_id)
            self.moves_coalesced += 1
            watcher.wake.set()
            return
        while True:
            if len(unread) >= self.stream_moves:
                self._drop(watcher, f"{len(unread)} moves unread (limit {self.stream_moves})")
            elif self._unread.get(tenant, 0) + self._kept.of(tenant) >= self.tenant_moves:
                if self._kept.shed(tenant):
                    self.moves_dropped += 1
                    continue
                self._drop(
                    self._slowest(self._of_tenant[tenant]),
                    f"the tenant's streams hold {self.tenant_moves} unread moves (limit)",
                )
            elif self._unread_total + self._kept.total >= self.server_moves:
                if self._kept.shed(None):
                    self.moves_dropped += 1
                    continue
                everyone = [w for ws in self._of_tenant.values() for w in ws]
                self._drop(
                    self._slowest(everyone),
                    f"the server holds {self.server_moves} unread moves (limit)",
                )
            else:
                break
            if watcher.dropped is not None:
                self.moves_dropped += 1
                return
        unread[move.program_id] = entry
        self._unread[tenant] = self._unread.get(tenant, 0) + 1
        self._unread_total += 1
        self.moves_sent += 1
        watcher.wake.set()

    @staticmethod
    def _slowest(watchers: Iterable[_Watcher]) -> _Watcher:
        return max(watchers, key=lambda w: len(w.unread))

    def _take(self, watcher: _Watcher) -> tuple[str, tuple[str, float]]:
        program, entry = watcher.unread.popitem(last=False)
        self._forget(watcher.key[0], 1)
        return program, entry

    def _forget(self, tenant: str, n: int) -> None:
        left = self._unread.get(tenant, 0) - n
        if left > 0:
            self._unread[tenant] = left
        else:
            self._unread.pop(tenant, None)
        self._unread_total -= n

    def _drop(self, watcher: _Watcher, why: str) -> None:
        """Stop telling ``watcher`` and free its unread moves (a slow reader)."""
        tenant, engine = watcher.key
        n = len(watcher.unread)
        watcher.dropped = f"WatchMoves of engine {engine!r} dropped: {why}; reconnect"
        watcher.unread.clear()
        self._forget(tenant, n)
        self._detach(watcher)
        self.moves_dropped += n
        self.streams_dropped += 1
        watcher.wake.set()
        now = time.monotonic()
        if now - self._logged.get(tenant, float("-inf")) >= LOG_EVERY_S:
            self._logged[tenant] = now
            log.warning(
                "pin coherence: tenant %r: a stream that does not read its moves was "
                "dropped (%s; %d dropped in all so far); its engine's pins live until "
                "their TTL",
                tenant,
                why,
                self.streams_dropped,
            )

    def _detach(self, watcher: _Watcher) -> None:
        tenant = watcher.key[0]
        here = self._watchers.get(watcher.key)
        if here is not None:
            here.discard(watcher)
            if not here:
                del self._watchers[watcher.key]
        mine = self._of_tenant.get(tenant)
        if mine is not None:
            mine.discard(watcher)
            if not mine:
                del self._of_tenant[tenant]

    async def _maintain(self) -> None:
        """The shared locations' upkeep, in a worker thread every :data:`MAINTAIN_EVERY_S`,
        never inside a report (:meth:`SharedLocations.maintain`); an outage is logged once
        at its start and once at its end (:mod:`controlplane.storage.outages`)."""
        assert self.shared is not None
        health = self.shared.outages.loop(
            "locations",
            "pin coherence: pruning program locations",
            log,
            f"tried again every {MAINTAIN_EVERY_S:g} s",
        )
        while True:
            await asyncio.sleep(MAINTAIN_EVERY_S)
            try:
                await asyncio.to_thread(self.shared.maintain)
            except Exception as error:
                health.failed(error)
            else:
                health.succeeded()

    def close(self) -> None:
        """Stop the background tasks (the server is stopping)."""
        for task in (self._maintaining, self._listening):
            if task is not None:
                task.cancel()
        self._maintaining = self._listening = None

    async def _listen(self) -> None:
        """Tell the watchers here the moves other replicas publish, for as long as any
        watches: a listener that fails for any reason (a lost connection is handled inside
        :meth:`SharedLocations.listen`) is logged and started again, never left dead."""
        assert self.shared is not None
        while True:
            try:
                async for published in self.shared.listen():
                    if published.replica != self.replica:
                        self.tell(published.tenant, published.moves)
            except Exception:
                log.exception("moves between replicas: the listener failed; starting it again")
            await asyncio.sleep(RETRY_FIRST_S)

    async def watch(self, tenant: str, engine: str) -> AsyncIterator[WatchMovesResponse]:
        """The moves away from ``engine``, as they happen, until the caller stops;
        ``OverloadedError`` once the stream was dropped as a slow reader."""
        key = (tenant, engine)
        watcher = _Watcher(key)
        self._watchers.setdefault(key, set()).add(watcher)
        self._of_tenant.setdefault(tenant, set()).add(watcher)
        self._resumed(watcher)
        if self.shared is not None and self._listening is None:
            self._listening = asyncio.create_task(self._listen())
        try:
            while True:
                if watcher.dropped is not None:
                    raise OverloadedError(watcher.dropped)
                if not watcher.unread:
                    watcher.wake.clear()
                    await watcher.wake.wait()
                    continue
                program, (to, at) = self._take(watcher)
                yield WatchMovesResponse(
                    program_id=program, to_engine_id=to, arrived_at=timestamp(at)
                )
        finally:
            if watcher.dropped is None:
                unread = watcher.unread.copy()
                self._forget(tenant, len(unread))
                watcher.unread.clear()
                self._detach(watcher)
                if key not in self._watchers:
                    self._kept.left(key, unread)
            if not self._watchers and self._listening is not None:
                # the last watcher here left: listen on while its engine may come back
                asyncio.get_running_loop().call_later(RESUME_S, self._stop_listening)

    def _stop_listening(self) -> None:
        """Stop listening to the other replicas if no stream came back meanwhile."""
        if not self._watchers and self._listening is not None:
            self._listening.cancel()
            self._listening = None


async def _to_thread(tenant: str, fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)
