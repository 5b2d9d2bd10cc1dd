"""``PinCoherenceService`` on the wire: engines report turn arrivals, and the engine a program
moved away from hears it on its ``WatchMoves`` stream (:mod:`controlplane.coherence`).

Served from the event loop, from memory: an arrival costs a dictionary update and, on a
move, one message queued per watcher of the engine the program left. A watcher that does not
keep up loses the oldest moves past :data:`WATCH_QUEUE` (counted in ``moves_dropped``): the pin
it would have dropped then lives until its TTL, as it would have without this service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import cached_property

import grpc

from controlplane._gen.cachettl.v1 import cluster_pb2
from controlplane._gen.cachettl.v1.cluster_pb2 import WatchMovesResponse
from controlplane.coherence import ProgramLocations
from controlplane.errors import InvalidInputError
from controlplane.records import LIMITS, Tenant
from controlplane.validation import check_known, check_name, timestamp_s
from controlplane.wire import timestamp

__all__ = ["WATCH_QUEUE", "CoherenceHub", "CoherenceMethods", "arrivals"]

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
    """The locations and the watching streams, per tenant and engine."""

    def __init__(self, locations: ProgramLocations | None = None) -> None:
        self.locations = locations or ProgramLocations()
        self._watchers: dict[tuple[str, str], set[asyncio.Queue[WatchMovesResponse]]]
        self._watchers = {}
        self.moves_sent = 0
        self.moves_dropped = 0

    def report(self, tenant: str, engine: str, arrived: list[tuple[str, float]]) -> int:
        """Apply a checked report; returns how many arrivals were moves."""
        moved = 0
        for program, at in arrived:
            left = self.locations.arrived(tenant, engine, program, at)
            if left is None:
                continue
            moved += 1
            message = WatchMovesResponse(
                program_id=program, to_engine_id=engine, arrived_at=timestamp(at)
            )
            for queue in self._watchers.get((tenant, left), ()):
                if queue.full():
                    queue.get_nowait()
                    self.moves_dropped += 1
                queue.put_nowait(message)
                self.moves_sent += 1
        return moved

    async def watch(self, tenant: str, engine: str) -> AsyncIterator[WatchMovesResponse]:
        """The moves away from ``engine``, as they happen, until the caller stops."""
        queue: asyncio.Queue[WatchMovesResponse] = asyncio.Queue(WATCH_QUEUE)
        key = (tenant, engine)
        self._watchers.setdefault(key, set()).add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            watchers = self._watchers.get(key)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[key]


class CoherenceMethods:
    """The ``PinCoherenceService`` methods, mixed into the servicer."""

    @cached_property
    def coherence(self) -> CoherenceHub:
        return CoherenceHub()

    async def ReportArrivals(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        request: cluster_pb2.ReportArrivalsRequest,
        context: grpc.aio.ServicerContext,
    ) -> cluster_pb2.ReportArrivalsResponse:
        engine, arrived = arrivals(request, time.time())
        return cluster_pb2.ReportArrivalsResponse(
            moved=self.coherence.report(tenant.name, engine, arrived)
        )

    async def WatchMoves(  # noqa: N802
        self,
        tenant: Tenant,
        request: cluster_pb2.WatchMovesRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[WatchMovesResponse]:
        engine = _engine_id("engine_id", request.engine_id)
        async for moved in self.coherence.watch(tenant.name, engine):
            yield moved
