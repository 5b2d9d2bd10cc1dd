"""gRPC servicers: thin adapters that decode, call ``ControlPlane`` and map errors.

Errors become status codes with ``await context.abort``: bad input → INVALID_ARGUMENT,
missing/unknown token → UNAUTHENTICATED, revoked token → PERMISSION_DENIED, database down
→ UNAVAILABLE. Database work runs in worker threads; decisions are answered in the event
loop from memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from controlplane import inspection, validation
from controlplane._gen.cachettl.v1 import events_pb2, inspect_pb2, model_pb2, ttl_pb2
from controlplane.errors import InvalidInputError, StorageError
from controlplane.metrics import Metrics
from controlplane.records import LIMITS, Limits, Tenant
from controlplane.service import ControlPlane
from controlplane.state import PinCounts

__all__ = ["Malformed", "Servicer", "generic_handlers"]

log = logging.getLogger(__name__)
R = TypeVar("R")


class Malformed:
    """Stands for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __str__(self) -> str:
        return str(self.error)


def _parser(cls: type[Message]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return cls.FromString(data)
        except DecodeError as error:
            return Malformed(error)

    return parse


def generic_handlers(servicer: Servicer, files: Sequence[FileDescriptor]) -> list[Any]:
    """One generic handler per service of ``files``, bound to ``servicer``'s methods.

    Requests are parsed here rather than by gRPC so that corrupt bytes are answered
    INVALID_ARGUMENT (gRPC's own parser would answer INTERNAL).
    """
    handlers = []
    for file in files:
        for service in file.services_by_name.values():
            methods = {}
            for m in service.methods:
                response = GetMessageClass(m.output_type).SerializeToString
                make = (
                    grpc.unary_stream_rpc_method_handler
                    if m.server_streaming
                    else grpc.unary_unary_rpc_method_handler
                )
                methods[m.name] = make(
                    getattr(servicer, m.name),
                    request_deserializer=_parser(GetMessageClass(m.input_type)),
                    response_serializer=response,
                )
            handlers.append(grpc.method_handlers_generic_handler(service.full_name, methods))
    return handlers


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def _pins(p: PinCounts) -> inspect_pb2.PinStats:
    return inspect_pb2.PinStats(
        hits=p.hits,
        expired=p.expired,
        released_under_pressure=p.released_under_pressure,
        not_pinned=p.not_pinned,
        hit_rate=p.hit_rate,
    )


class Servicer:
    """Implements all four services of ``cachettl.v1`` over one ``ControlPlane``."""

    def __init__(
        self,
        plane: ControlPlane,
        metrics: Metrics,
        limits: Limits = LIMITS,
        watch_interval_s: float = 0.5,
    ) -> None:
        self.plane = plane
        self.metrics = metrics
        self.limits = limits
        self.watch_interval_s = watch_interval_s

    # -- plumbing ---------------------------------------------------------------------

    async def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        token = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() != "bearer":
                    token = ""
        if not token:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization: missing bearer token (metadata 'authorization: Bearer TOKEN')",
            )
        found, tenant = self.plane.cached_tenant(token)
        if not found:
            tenant = await asyncio.to_thread(self.plane.authenticate, token)
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown token")
        assert tenant is not None
        if tenant.revoked_at is not None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"authorization: the token of tenant {tenant.name!r} was revoked",
            )
        return tenant

    async def _call(
        self,
        method: str,
        request: object,
        context: grpc.aio.ServicerContext,
        body: Callable[[Tenant], Awaitable[R]],
    ) -> R:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            tenant = await self._tenant(context)
            if isinstance(request, Malformed):
                raise InvalidInputError("request", f"malformed protobuf message: {request}")
            return await body(tenant)
        except InvalidInputError as error:
            code = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(error))
        except StorageError as error:
            code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"database unavailable: {error}")
        except (grpc.aio.AbortError, asyncio.CancelledError):
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except Exception:
            log.exception("%s failed", method)
            code = grpc.StatusCode.INTERNAL
            await context.abort(code, f"internal error in {method}")
        finally:
            self.metrics.observe_rpc(method, code, time.perf_counter() - start)
        raise AssertionError("unreachable")  # abort() always raises

    # -- ToolEventService -------------------------------------------------------------

    async def RecordToolCalls(  # noqa: N802 - gRPC method name
        self, request: events_pb2.RecordToolCallsRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.RecordToolCallsResponse:
        async def body(tenant: Tenant) -> events_pb2.RecordToolCallsResponse:
            calls = validation.tool_calls(request, self.limits)
            result = await asyncio.to_thread(self.plane.record_tool_calls, tenant, calls)
            self.metrics.events(result.accepted, result.duplicates)
            return events_pb2.RecordToolCallsResponse(
                accepted=result.accepted,
                duplicates=result.duplicates,
                model_version=self.plane.version,
            )

        return await self._call("RecordToolCalls", request, context, body)

    async def RecordProgramEnd(  # noqa: N802
        self, request: events_pb2.RecordProgramEndRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.RecordProgramEndResponse:
        async def body(tenant: Tenant) -> events_pb2.RecordProgramEndResponse:
            end = validation.program_end(request)
            seq = await asyncio.to_thread(self.plane.record_program_end, tenant, end)
            return events_pb2.RecordProgramEndResponse(
                duplicate=seq is None, model_version=self.plane.version
            )

        return await self._call("RecordProgramEnd", request, context, body)

    # -- TtlService -------------------------------------------------------------------

    async def DecideTtl(  # noqa: N802
        self, request: ttl_pb2.DecideTtlRequest, context: grpc.aio.ServicerContext
    ) -> ttl_pb2.DecideTtlResponse:
        async def body(tenant: Tenant) -> ttl_pb2.DecideTtlResponse:
            decision, version = self.plane.decide(
                tenant, validation.decide_request(request, self.limits)
            )
            self.metrics.decision(decision.basis)
            return ttl_pb2.DecideTtlResponse(
                ttl=_duration(decision.ttl_s),
                return_probability=decision.return_probability,
                expected_benefit=_duration(decision.expected_benefit_s),
                basis=decision.basis,
                model_version=version,
                benefit=_duration(decision.benefit_s),
            )

        return await self._call("DecideTtl", request, context, body)

    # -- InspectService ---------------------------------------------------------------

    async def ListTools(  # noqa: N802
        self, request: inspect_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> inspect_pb2.ListToolsResponse:
        async def body(tenant: Tenant) -> inspect_pb2.ListToolsResponse:
            validation.check_known("request", request)
            tools = [
                inspect_pb2.ToolSummary(
                    tool_name=v.tool_name,
                    sample_count=v.sample_count,
                    seen_count=v.seen_count,
                    p50=_duration(v.quantiles_s[0]),
                    p90=_duration(v.quantiles_s[1]),
                    p99=_duration(v.quantiles_s[2]),
                    drift_epoch=v.drift_epoch,
                    signatures=v.signatures,
                    pins=_pins(v.pins),
                )
                for v in self.plane.list_tools(tenant.name)
            ]
            return inspect_pb2.ListToolsResponse(tools=tools, model_version=self.plane.version)

        return await self._call("ListTools", request, context, body)

    async def GetToolDistribution(  # noqa: N802
        self, request: inspect_pb2.GetToolDistributionRequest, context: grpc.aio.ServicerContext
    ) -> inspect_pb2.GetToolDistributionResponse:
        async def body(tenant: Tenant) -> inspect_pb2.GetToolDistributionResponse:
            tool, args, points = validation.distribution_request(request)
            view = self.plane.tool_distribution(tenant.name, tool, args, points)
            if view is None:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"tool_name: no samples of tool {tool!r}"
                )
            assert view is not None
            return _distribution(view, self.plane.version)

        return await self._call("GetToolDistribution", request, context, body)

    async def GetWorkloadStats(  # noqa: N802
        self, request: inspect_pb2.GetWorkloadStatsRequest, context: grpc.aio.ServicerContext
    ) -> inspect_pb2.GetWorkloadStatsResponse:
        async def body(tenant: Tenant) -> inspect_pb2.GetWorkloadStatsResponse:
            validation.check_known("request", request)
            v = self.plane.workload_stats(tenant.name)
            return inspect_pb2.GetWorkloadStatsResponse(
                eta=v.eta,
                queue_delay=_duration(v.queue_delay_s),
                programs_completed=v.programs_completed,
                programs_in_window=v.programs_in_window,
                tool_calls=v.tool_calls,
                queue_samples=v.queue_samples,
                model_version=self.plane.version,
            )

        return await self._call("GetWorkloadStats", request, context, body)

    # -- ModelService -----------------------------------------------------------------

    async def WatchSnapshots(  # noqa: N802
        self, request: model_pb2.WatchSnapshotsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[model_pb2.WatchSnapshotsResponse]:
        async def body(tenant: Tenant) -> Tenant:
            validation.check_known("request", request)
            return tenant

        tenant = await self._call("WatchSnapshots", request, context, body)
        await context.send_initial_metadata(())  # tells the client the stream is open
        after = request.after_version
        while True:
            if self.plane.version > after:
                view = self.plane.snapshot_for(tenant.name, tenant.share)
                self.metrics.snapshot_sent(view.version)
                yield _snapshot(view)
                after = view.version
            await asyncio.sleep(self.watch_interval_s)


def _distribution(
    v: inspection.DistributionView, version: int
) -> inspect_pb2.GetToolDistributionResponse:
    return inspect_pb2.GetToolDistributionResponse(
        tool_name=v.tool_name,
        signature=v.signature,
        basis=v.basis,
        sample_count=v.sample_count,
        seen_count=v.seen_count,
        drift_epoch=v.drift_epoch,
        quantiles=[inspect_pb2.Quantile(q=q, value=_duration(s)) for q, s in v.quantiles],
        cdf=[inspect_pb2.CdfPoint(duration=_duration(s), probability=p) for s, p in v.cdf],
        pins=_pins(v.pins),
        model_version=version,
    )


def _snapshot(v: inspection.SnapshotView) -> model_pb2.WatchSnapshotsResponse:
    models: list[Any] = [
        model_pb2.ToolModel(
            tool_name=m.tool_name,
            signature=m.signature,
            level=m.level,
            sorted_durations_seconds=m.sorted_durations_s,
            summarized=m.summarized,
            sample_count=m.sample_count,
            drift_epoch=m.drift_epoch,
        )
        for m in v.models
    ]
    return model_pb2.WatchSnapshotsResponse(
        version=v.version,
        models=models,
        eta=v.eta,
        queue_delay=_duration(v.queue_delay_s),
        min_samples=v.min_samples,
    )
