"""``PinCoherenceService`` on the wire: engines report turn arrivals, and the engine a program
moved away from hears it on its ``WatchMoves`` stream (:mod:`controlplane.coherence`).

The watching streams, and how moves reach them across replicas, are
:mod:`controlplane.rpc.moves` (:class:`CoherenceHub`); this module checks reports and serves
the two methods.

Reports are checked arrival by arrival: a bad program id, or an arrival time more than
:data:`AHEAD_S` ahead of the server's clock (a clock set ahead would otherwise become a
tool's duration on the engine told of the move: ``now + 20 h`` as 72,000 s), is refused
alone and named in the answer; the rest of the report is applied. An arrival time up to
:data:`AHEAD_S` ahead counts as the server's now, so no move is ever told as arriving
after the server heard of it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cached_property

import grpc

from controlplane._gen.cachettl.v1 import cluster_pb2
from controlplane._gen.cachettl.v1.cluster_pb2 import WatchMovesResponse
from controlplane.errors import InvalidInputError
from controlplane.records import LIMITS, Tenant
from controlplane.rpc.gate import Gate
from controlplane.rpc.lanes import Lanes
from controlplane.rpc.moves import CoherenceHub
from controlplane.service import ControlPlane
from controlplane.storage.locations import shared_locations
from controlplane.validation import check_known, check_name, timestamp_s

__all__ = [
    "AHEAD_S",
    "CoherenceMethods",
    "Report",
    "arrivals",
]

#: An arrival time may be this far ahead of the server's clock (counted as the server's now).
AHEAD_S = 5.0
#: Refusals named in one answer (the count covers them all).
REFUSALS_NAMED = 16
#: Longest engine id (characters).
ENGINE_ID_CHARS = 64


def _engine_id(field: str, value: str) -> str:
    if not value or len(value) > ENGINE_ID_CHARS or not value.isprintable():
        raise InvalidInputError(
            field, f"must be 1..{ENGINE_ID_CHARS} printable characters, got {len(value)}"
        )
    return value


@dataclass(frozen=True, slots=True)
class Report:
    """A checked report: the engine, the arrivals kept, and those refused
    (``(index, reason)``, the reason naming the field)."""

    engine_id: str
    arrived: list[tuple[str, float]]
    refused: list[tuple[int, str]]


def _arrival(i: int, arrival: cluster_pb2.Arrival, now: float) -> tuple[str, float]:
    at = f"arrivals[{i}]"
    check_known(at, arrival)
    program = check_name(f"{at}.program_id", arrival.program_id, "program_id")
    if not arrival.HasField("arrived_at"):
        return program, now
    when = timestamp_s(f"{at}.arrived_at", arrival.arrived_at)
    if when > now + AHEAD_S:
        raise InvalidInputError(
            f"{at}.arrived_at",
            f"{when - now:.0f} s ahead of the server's clock (at most {AHEAD_S:g} s: "
            "is the engine's clock set?)",
        )
    return program, min(when, now)


def arrivals(request: cluster_pb2.ReportArrivalsRequest, now: float) -> Report:
    """The checked report. A bad engine id, count or unknown field of the request raises
    ``InvalidInputError`` naming it (nothing applied); a bad arrival is refused alone."""
    check_known("request", request)
    engine = _engine_id("engine_id", request.engine_id)
    if not 1 <= len(request.arrivals) <= LIMITS.batch_events:
        raise InvalidInputError(
            "arrivals", f"must hold 1..{LIMITS.batch_events} arrivals, got {len(request.arrivals)}"
        )
    checked, refused = [], []
    for i, arrival in enumerate(request.arrivals):
        try:
            checked.append(_arrival(i, arrival, now))
        except InvalidInputError as error:
            refused.append((i, str(error)))
    return Report(engine, checked, refused)


class CoherenceMethods:
    """The ``PinCoherenceService`` methods, mixed into the servicer (over its ``plane``)."""

    plane: ControlPlane
    gate: Gate
    lanes: Lanes

    @cached_property
    def coherence(self) -> CoherenceHub:
        hub = CoherenceHub(shared=shared_locations(self.plane.store))
        hub.off_loop = self.lanes.run  # the tenant's share of the server, as other doors
        return hub

    async def ReportArrivals(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        request: cluster_pb2.ReportArrivalsRequest,
        context: grpc.aio.ServicerContext,
    ) -> cluster_pb2.ReportArrivalsResponse:
        self.gate.arrivals(tenant.name, len(request.arrivals))
        # Checking a full report takes milliseconds: off the event loop, where decisions run.
        report = await self.lanes.run(tenant.name, arrivals, request, time.time())
        moved = await self.coherence.report(tenant, report.engine_id, report.arrived)
        self.coherence.arrivals_refused += len(report.refused)
        return cluster_pb2.ReportArrivalsResponse(
            moved=moved,
            refused=len(report.refused),
            refusals=[
                cluster_pb2.RefusedArrival(index=i, reason=reason)
                for i, reason in report.refused[:REFUSALS_NAMED]
            ],
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
