"""``PinCoherenceService`` on the wire: engines report turn arrivals, and the engine a program
moved away from hears it on its ``WatchMoves`` stream (:mod:`controlplane.coherence`).

On SQLite (or ``memory://``) served from the event loop, from memory: an arrival costs a
dictionary update and, on a move, one message queued per watcher of the engine the program
left. On PostgreSQL the locations are the database's
(:class:`controlplane.storage.locations.SharedLocations`), so that replicas sharing it see
moves between engines linked to different replicas: a report is one statement, run in a
worker thread; its moves go at once to this replica's watchers, and through ``NOTIFY`` to
the other replicas, each of which listens (one connection, only while it has watchers) and
hands them to its own. A replica never tells its watchers a move twice: it skips the
notifications it published itself.

A watcher that does not keep up loses the oldest moves past :data:`WATCH_QUEUE` (counted in
``moves_dropped``): the pin it would have dropped then lives until its TTL, as it would have
without this service; so does one whose move was published while its replica's listening
connection was down (it reconnects with backoff).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from functools import cached_property

import grpc

from controlplane._gen.cachettl.v1 import cluster_pb2
from controlplane._gen.cachettl.v1.cluster_pb2 import WatchMovesResponse
from controlplane.coherence import ProgramLocations
from controlplane.errors import InvalidInputError
from controlplane.records import LIMITS, Move, Tenant
from controlplane.service import ControlPlane
from controlplane.storage.locations import RETRY_FIRST_S, SharedLocations, shared_locations
from controlplane.validation import check_known, check_name, timestamp_s
from controlplane.wire import timestamp

__all__ = ["WATCH_QUEUE", "CoherenceHub", "CoherenceMethods", "arrivals"]

log = logging.getLogger(__name__)

#: Moves queued per watching stream before the oldest are dropped.
WATCH_QUEUE = 10_000
#: Longest engine id (characters).
ENGINE_ID_CHARS = 64


def _engine_id(field: str, value: str) -> str:
    if not value or len(value) > ENGINE_ID_CHARS or not value.isprintable():
        raise InvalidInputError(
            field, f"must be 1..{ENGINE_ID_CHARS} printable characters, got {len(value)}"
        )
    return value


def arrivals(
    request: cluster_pb2.ReportArrivalsRequest, now: float
) -> tuple[str, list[tuple[str, float]]]:
    """The checked ``(engine_id, [(program_id, arrived_at), ...])`` of a report; a bad
    field raises ``InvalidInputError`` naming it, and nothing of the report is applied."""
    check_known("request", request)
    engine = _engine_id("engine_id", request.engine_id)
    if not 1 <= len(request.arrivals) <= LIMITS.batch_events:
        raise InvalidInputError(
            "arrivals", f"must hold 1..{LIMITS.batch_events} arrivals, got {len(request.arrivals)}"
        )
    checked = []
    for i, arrival in enumerate(request.arrivals):
        at = f"arrivals[{i}]"
        check_known(at, arrival)
        program = check_name(f"{at}.program_id", arrival.program_id, "program_id")
        when = (
            timestamp_s(f"{at}.arrived_at", arrival.arrived_at)
            if arrival.HasField("arrived_at")
            else now
        )
        checked.append((program, when))
    return engine, checked


class CoherenceHub:
    """The locations and the watching streams, per tenant and engine.

    ``shared``: the database's locations (PostgreSQL), else ``locations`` in memory.
    ``replica``: this server's name in what it publishes (random by default).
    """

    def __init__(
        self,
        locations: ProgramLocations | None = None,
        shared: SharedLocations | None = None,
        replica: str | None = None,
    ) -> None:
        self.locations = locations or ProgramLocations()
        self.shared = shared
        self.replica = replica or uuid.uuid4().hex
        self._watchers: dict[tuple[str, str], set[asyncio.Queue[WatchMovesResponse]]]
        self._watchers = {}
        self._listening: asyncio.Task[None] | None = None
        self.moves_sent = 0
        self.moves_dropped = 0

    async def report(self, tenant: Tenant, engine: str, arrived: list[tuple[str, float]]) -> int:
        """Apply a checked report and tell the watchers here; returns how many arrivals
        were moves. ``StorageError`` when the shared locations' database fails."""
        if self.shared is None:
            moves = self.locations.report(tenant.name, engine, arrived)
        else:
            report = self.shared.report
            moves = await asyncio.to_thread(report, tenant, engine, arrived, self.replica)
        self.tell(tenant.name, moves)
        return len(moves)

    def tell(self, tenant: str, moves: Iterable[Move]) -> None:
        """Queue each move for the watchers of the engine it left."""
        for move in moves:
            watchers = self._watchers.get((tenant, move.from_engine))
            if not watchers:
                continue
            message = WatchMovesResponse(
                program_id=move.program_id,
                to_engine_id=move.to_engine,
                arrived_at=timestamp(move.arrived_at),
            )
            for queue in watchers:
                if queue.full():
                    queue.get_nowait()
                    self.moves_dropped += 1
                queue.put_nowait(message)
                self.moves_sent += 1

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
        """The moves away from ``engine``, as they happen, until the caller stops."""
        queue: asyncio.Queue[WatchMovesResponse] = asyncio.Queue(WATCH_QUEUE)
        key = (tenant, engine)
        self._watchers.setdefault(key, set()).add(queue)
        if self.shared is not None and self._listening is None:
            self._listening = asyncio.create_task(self._listen())
        try:
            while True:
                yield await queue.get()
        finally:
            watchers = self._watchers.get(key)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[key]
            if not self._watchers and self._listening is not None:
                self._listening.cancel()  # the last watcher here left
                self._listening = None


class CoherenceMethods:
    """The ``PinCoherenceService`` methods, mixed into the servicer (over its ``plane``)."""

    plane: ControlPlane

    @cached_property
    def coherence(self) -> CoherenceHub:
        return CoherenceHub(shared=shared_locations(self.plane.store))

    async def ReportArrivals(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        request: cluster_pb2.ReportArrivalsRequest,
        context: grpc.aio.ServicerContext,
    ) -> cluster_pb2.ReportArrivalsResponse:
        engine, arrived = arrivals(request, time.time())
        moved = await self.coherence.report(tenant, engine, arrived)
        return cluster_pb2.ReportArrivalsResponse(moved=moved)

    async def WatchMoves(  # noqa: N802
        self,
        tenant: Tenant,
        request: cluster_pb2.WatchMovesRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[WatchMovesResponse]:
        engine = _engine_id("engine_id", request.engine_id)
        async for moved in self.coherence.watch(tenant.name, engine):
            yield moved
