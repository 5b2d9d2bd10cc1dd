"""gRPC servicers: thin adapters that admit, decode, call ``ControlPlane`` and map errors.

Every method is served by a request-streaming handler so that admission
(``controlplane.rpc.gate``: the token first, then per-peer, per-tenant and server-wide
limits) runs when a call's headers arrive, before its message: a call without a valid
token holds nothing. Errors become status codes with ``await context.abort``: bad input
→ INVALID_ARGUMENT, missing/unknown token → UNAUTHENTICATED, revoked token →
PERMISSION_DENIED, a limit reached → RESOURCE_EXHAUSTED, no message in time →
DEADLINE_EXCEEDED, database down → UNAVAILABLE. Ingest, inspection and snapshots run in
worker threads (the model lock is held a slice at a time); decisions are answered in
the event loop from memory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message_factory import GetMessageClass

from controlplane import inspection, validation
from controlplane._gen.cachettl.v1 import events_pb2, inspect_pb2, model_pb2, ttl_pb2
from controlplane.errors import (
    RETRY_AFTER_KEY,
    RETRYABLE_KEY,
    AuthenticationError,
    InvalidInputError,
    NotFoundError,
    OverloadedError,
    RevokedError,
    SlowClientError,
    StorageError,
    clip,
)
from controlplane.kvhints import Retention, envelope_to_proto, retention_envelope
from controlplane.records import LIMITS, MISSES, Limits, MissQuery, Tenant
from controlplane.rpc import misses
from controlplane.rpc.auth import AuthOptions, TenantCache
from controlplane.rpc.coherence import CoherenceMethods
from controlplane.rpc.gate import Budgets, Gate, until
from controlplane.rpc.heap import HeapTrimmer
from controlplane.rpc.lanes import Lanes
from controlplane.rpc.metrics import Metrics
from controlplane.rpc.parsing import Malformed, Unparsed, parser, serializer
from controlplane.rpc.sends import SendBudget
from controlplane.service import ControlPlane
from controlplane.state import PinCounts
from controlplane.wire import duration

__all__ = ["Malformed", "Servicer", "generic_handlers"]

log = logging.getLogger(__name__)
R = TypeVar("R")

#: Status of each error the service raises on purpose.
_CODES: tuple[tuple[type[Exception], grpc.StatusCode, str], ...] = (
    (InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED, ""),
    (RevokedError, grpc.StatusCode.PERMISSION_DENIED, ""),
    (NotFoundError, grpc.StatusCode.NOT_FOUND, ""),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    (SlowClientError, grpc.StatusCode.DEADLINE_EXCEEDED, ""),
    (StorageError, grpc.StatusCode.UNAVAILABLE, "database unavailable: "),
)


def generic_handlers(servicer: Servicer, files: Sequence[FileDescriptor]) -> list[Any]:
    """One generic handler per service of ``files``, bound to ``servicer``'s methods.

    Requests are parsed here rather than by gRPC so that corrupt bytes are answered
    INVALID_ARGUMENT (gRPC's own parser would answer INTERNAL). Every method is served
    as request-streaming (same wire format) so that admission precedes the message.
    """
    handlers = []
    for file in files:
        for service in file.services_by_name.values():
            methods = {}
            for m in service.methods:
                body = getattr(servicer, m.name)
                if m.server_streaming:
                    behavior: Any = servicer.streaming(m.name, body)
                    make = grpc.stream_stream_rpc_method_handler
                else:
                    behavior = servicer.unary(m.name, body)
                    make = grpc.stream_unary_rpc_method_handler
                methods[m.name] = make(
                    behavior,
                    request_deserializer=parser(GetMessageClass(m.input_type)),
                    response_serializer=serializer(GetMessageClass(m.output_type)),
                )
            handlers.append(grpc.method_handlers_generic_handler(service.full_name, methods))
    return handlers


def _pins(p: PinCounts) -> inspect_pb2.PinStats:
    return inspect_pb2.PinStats(
        hits=p.hits,
        expired=p.expired,
        released_under_pressure=p.released_under_pressure,
        not_pinned=p.not_pinned,
        hit_rate=p.hit_rate,
        moved=p.moved,
    )


def _code(error: Exception) -> tuple[grpc.StatusCode, str]:
    for cls, code, prefix in _CODES:
        if isinstance(error, cls):
            return code, clip(f"{prefix}{error}")
    return grpc.StatusCode.INTERNAL, ""


def _trailer(error: Exception) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of an error answer: marks one that retrying cannot cure, and says
    how long to wait before retrying one refused for the tenant's share of the server."""
    if not getattr(error, "retryable", True):
        return ((RETRYABLE_KEY, "false"),)
    after = getattr(error, "retry_after_s", None)
    return () if after is None else ((RETRY_AFTER_KEY, str(round(after * 1000))),)


class Servicer(CoherenceMethods):
    """Implements every service of ``cachettl.v1`` over one ``ControlPlane`` (pin coherence
    in :mod:`controlplane.rpc.coherence`)."""

    def __init__(
        self,
        plane: ControlPlane,
        metrics: Metrics,
        limits: Limits = LIMITS,
        watch_interval_s: float = 0.5,
        budgets: Budgets | None = None,
        auth: AuthOptions | None = None,
    ) -> None:
        self.plane = plane
        self.metrics = metrics
        self.limits = limits
        self.watch_interval_s = watch_interval_s
        self.tenants = TenantCache(plane.store.tenant_by_token_hash, auth)
        self.gate = Gate(budgets or Budgets(), self.tenants, recheck_s=watch_interval_s)
        b = self.gate.budgets
        self.trimmer = HeapTrimmer()
        self.sends = SendBudget(b.send_bytes_per_tenant, b.send_bytes_total, self.trimmer.released)
        self.snapshot_streams = 0  # WatchSnapshots streams open
        self._builds: dict[str, asyncio.Future[tuple[int, bytes]]] = {}
        self._compact_builds: dict[str, asyncio.Future[int]] = {}
        # The doors' blocking work runs on lanes, least-served tenant first
        # (controlplane.rpc.lanes). Views (listings, distributions, snapshots) have one
        # thread of their own: they hold the model lock a slice at a time, and fewer
        # threads competing for the GIL keep those slices short.
        self.lanes = Lanes(b.lane_threads, max_wait_s=b.lane_wait_s)
        self.views = Lanes(1, max_wait_s=b.lane_wait_s)
        self._latest: dict[str, tuple[int, bytes]] = {}
        self._slow_logged: dict[str, float] = {}

    def snapshot_sent(self, tenant: str) -> int | None:
        """The newest snapshot version this server streamed to the tenant's engines."""
        latest = self._latest.get(tenant)
        return latest[0] if latest else None

    def payload_bytes(self) -> int:
        """Bytes of serialized snapshots this server keeps, shared by every stream of a
        tenant (the latest whole snapshot of each tenant with a stream, the compact replies
        and the per-model parts both are joined from)."""
        latest = sum(len(payload) for _, payload in self._latest.values())
        return latest + self.plane.snapshot_bytes()

    def close(self) -> None:
        if "coherence" in self.__dict__:  # created (cached_property) by a first call
            self.coherence.close()
        self.tenants.close()
        self.lanes.close()
        self.views.close()

    async def _view(self, tenant: str, fn: Callable[..., R], *args: Any) -> R:
        return await self.views.run(tenant, fn, *args)

    # -- plumbing ---------------------------------------------------------------------

    async def _call(
        self, method: str, context: grpc.aio.ServicerContext, body: Callable[[], Awaitable[R]]
    ) -> R:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await body()
        except (grpc.aio.AbortError, asyncio.CancelledError):
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except Exception as error:
            code, message = _code(error)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
                message = f"internal error in {method}"
            await context.abort(code, message, trailing_metadata=_trailer(error))
        finally:
            self.metrics.observe_rpc(method, code, time.perf_counter() - start)
        raise AssertionError("unreachable")  # abort() always raises

    async def _request(self, tenant: Tenant, requests: AsyncIterator[Any]) -> Any:
        request = await self.gate.message(requests)
        if isinstance(request, Unparsed):
            request = await self.lanes.run(tenant.name, request.parse)
        if isinstance(request, Malformed):
            raise InvalidInputError("request", f"malformed protobuf message: {request}")
        return request

    def unary(
        self, method: str, body: Callable[[Tenant, Any, grpc.aio.ServicerContext], Awaitable[R]]
    ) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], Awaitable[R]]:
        """The behavior serving a unary method: admit, read the one message, answer."""

        async def behavior(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> R:
            async def run() -> R:
                async with self.gate.call(context) as tenant:
                    return await body(tenant, await self._request(tenant, requests), context)

            return await self._call(method, context, run)

        return behavior

    def streaming(
        self,
        method: str,
        body: Callable[[Tenant, Any, grpc.aio.ServicerContext], AsyncIterator[object]],
    ) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], Awaitable[None]]:
        """The behavior serving a server-streaming method (stream budgets, not calls'; a
        client that stops reading is dropped, :meth:`_write`)."""

        async def behavior(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
            async with AsyncExitStack() as stack:

                async def admit() -> tuple[Tenant, Any]:
                    tenant = await stack.enter_async_context(self.gate.stream(context))
                    request = await self._request(tenant, requests)
                    validation.check_known("request", request)
                    return tenant, request

                tenant, request = await self._call(method, context, admit)
                closed = await stack.enter_async_context(self.gate.revocable(context))
                try:
                    async for item in until(body(tenant, request, context), closed):
                        if not await self._write(method, tenant, context, item, closed):
                            return
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as error:  # e.g. the tenant was revoked meanwhile
                    code, message = _code(error)
                    if code is grpc.StatusCode.INTERNAL:
                        log.exception("%s failed", method)
                        message = f"internal error in {method}"
                    await context.abort(code, message, trailing_metadata=_trailer(error))

        return behavior

    async def _write(
        self,
        method: str,
        tenant: Tenant,
        context: grpc.aio.ServicerContext,
        item: object,
        closed: asyncio.Future[Exception],
    ) -> bool:
        """Send a stream's message (a snapshot's ``bytes`` within the send budget,
        :mod:`controlplane.rpc.sends`); False if the call is gone meanwhile (its client
        left), ``OverloadedError`` once the client has taken none for
        ``Budgets.slow_reader_s`` (counted, logged once a minute per tenant). A write given
        up on is left to gRPC, which ends it with the call: its bytes stay counted until
        then, since they stay in gRPC's buffers. A revocation (``closed``) ends the wait
        for room or for the write."""
        if isinstance(item, bytes):
            room = asyncio.ensure_future(
                self.sends.send(tenant.name, len(item), lambda: context.write(item))
            )
            try:
                await asyncio.wait((room, closed), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # the call ended meanwhile: never start its write
                room.cancel()
                raise
            if not room.done():
                room.cancel()
                raise closed.result()
            write = room.result()
        else:
            write = asyncio.ensure_future(context.write(item))
            write.add_done_callback(_retrieve)
        await asyncio.wait(
            (write, closed),
            timeout=self.gate.budgets.slow_reader_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if closed.done() and not write.done():
            self.sends.abandon(write)
            raise closed.result()
        if write.done():
            try:
                write.result()
            except grpc.aio.InternalError:  # the batch failed in gRPC: the call is over
                return False
            return True
        self.sends.abandon(write)  # still in gRPC's buffers until the client reads or leaves
        raise self._slow_reader(method, tenant)

    def _slow_reader(self, method: str, tenant: Tenant) -> OverloadedError:
        """The error ending a stream whose client took no message for the slow-reader
        timeout (counted; logged once a minute per tenant)."""
        self.metrics.slow_streams.labels(method).inc()
        waited = self.gate.budgets.slow_reader_s
        now = time.monotonic()
        if now - self._slow_logged.get(tenant.name, float("-inf")) >= 60.0:
            self._slow_logged[tenant.name] = now
            log.warning(
                "tenant %r: a %s stream whose client took no message for %g s was ended",
                tenant.name,
                method,
                waited,
            )
        return OverloadedError(
            f"{method} stream ended: the client took no message for {waited:g} s "
            "(--slow-reader-timeout); read the stream, or reconnect"
        )

    # -- ToolEventService -------------------------------------------------------------

    async def RecordToolCalls(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        request: events_pb2.RecordToolCallsRequest,
        context: grpc.aio.ServicerContext,
    ) -> events_pb2.RecordToolCallsResponse:
        def work() -> events_pb2.RecordToolCallsResponse:
            calls = validation.tool_calls(request, self.limits)
            result = self.plane.record_tool_calls(tenant, calls)
            self.metrics.events(result.accepted, result.duplicates)
            return events_pb2.RecordToolCallsResponse(
                accepted=result.accepted,
                duplicates=result.duplicates,
                model_version=self.plane.tenant_version(tenant),
            )

        return await self.lanes.run(tenant.name, work)

    async def RecordProgramEnd(  # noqa: N802
        self,
        tenant: Tenant,
        request: events_pb2.RecordProgramEndRequest,
        context: grpc.aio.ServicerContext,
    ) -> events_pb2.RecordProgramEndResponse:
        end = validation.program_end(request)
        seq = await self.lanes.run(tenant.name, self.plane.record_program_end, tenant, end)
        return events_pb2.RecordProgramEndResponse(
            duplicate=seq is None, model_version=self.plane.tenant_version(tenant)
        )

    # -- TtlService -------------------------------------------------------------------

    async def DecideTtl(  # noqa: N802
        self, tenant: Tenant, request: ttl_pb2.DecideTtlRequest, context: grpc.aio.ServicerContext
    ) -> ttl_pb2.DecideTtlResponse:
        decision, version = self.plane.decide(
            tenant, validation.decide_request(request, self.limits)
        )
        self.metrics.decision(decision.basis)
        return ttl_pb2.DecideTtlResponse(
            ttl=duration(decision.ttl_s),
            return_probability=decision.return_probability,
            expected_benefit=duration(decision.expected_benefit_s),
            basis=decision.basis,
            model_version=version,
            benefit=duration(decision.benefit_s),
            kv_hints=envelope_to_proto(retention_envelope(Retention(ttl_s=decision.ttl_s))),
        )

    # -- InspectService ---------------------------------------------------------------

    async def ListTools(  # noqa: N802
        self,
        tenant: Tenant,
        request: inspect_pb2.ListToolsRequest,
        context: grpc.aio.ServicerContext,
    ) -> inspect_pb2.ListToolsResponse:
        validation.check_known("request", request)

        def work() -> inspect_pb2.ListToolsResponse:
            version = self.plane.tenant_version(tenant)
            tools = [
                inspect_pb2.ToolSummary(
                    tool_name=v.tool,
                    sample_count=v.sample_count,
                    seen_count=v.seen_count,
                    p50=duration(v.quantiles_s[0]),
                    p90=duration(v.quantiles_s[1]),
                    p99=duration(v.quantiles_s[2]),
                    drift_epoch=v.drift_epoch,
                    signatures=v.signatures,
                    pins=_pins(v.pins),
                )
                for v in self.plane.list_tools(tenant.name)
            ]
            return inspect_pb2.ListToolsResponse(tools=tools, model_version=version)

        return await self._view(tenant.name, work)

    async def GetToolDistribution(  # noqa: N802
        self,
        tenant: Tenant,
        request: inspect_pb2.GetToolDistributionRequest,
        context: grpc.aio.ServicerContext,
    ) -> inspect_pb2.GetToolDistributionResponse:
        tool, args, points = validation.distribution_request(request)
        version = self.plane.tenant_version(tenant)
        view = await self._view(
            tenant.name, self.plane.tool_distribution, tenant.name, tool, args, points
        )
        if view is None:
            raise NotFoundError(f"tool_name: no samples of tool {tool!r}")
        response = await self._view(tenant.name, _distribution, view, version)
        stats = await self.lanes.run(
            tenant.name, inspection.miss_stats, self.plane.store, tenant.name, tool
        )
        response.misses.CopyFrom(misses.miss_stats_proto(stats))
        return response

    async def ListMisses(  # noqa: N802
        self,
        tenant: Tenant,
        request: inspect_pb2.ListMissesRequest,
        context: grpc.aio.ServicerContext,
    ) -> inspect_pb2.ListMissesResponse:
        tool, program, reason, limit = validation.misses_request(request)
        reasons = frozenset({reason}) if reason is not None else MISSES
        query = MissQuery(tool, program, reasons, limit)
        view = await self.lanes.run(
            tenant.name, inspection.misses, self.plane.store, tenant.name, query
        )
        return misses.misses_response(view)

    async def GetWorkloadStats(  # noqa: N802
        self,
        tenant: Tenant,
        request: inspect_pb2.GetWorkloadStatsRequest,
        context: grpc.aio.ServicerContext,
    ) -> inspect_pb2.GetWorkloadStatsResponse:
        validation.check_known("request", request)
        v = self.plane.workload_stats(tenant.name)
        return inspect_pb2.GetWorkloadStatsResponse(
            eta=v.eta,
            queue_delay=duration(v.queue_delay_s),
            programs_completed=v.programs_completed,
            programs_in_window=v.programs_in_window,
            tool_calls=v.tool_calls,
            queue_samples=v.queue_samples,
            model_version=self.plane.tenant_version(tenant),
        )

    # -- ModelService -----------------------------------------------------------------

    async def WatchSnapshots(  # noqa: N802
        self,
        tenant: Tenant,
        request: model_pb2.WatchSnapshotsRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """Sends the tenant's snapshot whenever its version passes the last one sent;
        the token is checked again every ``watch_interval_s``, so a revocation ends the
        stream (PERMISSION_DENIED) within that plus the auth cache's ``fresh_s``. A
        ``compact`` request gets compact models and deltas (:meth:`_watch_compact`)."""
        await context.send_initial_metadata(())  # tells the client the stream is open
        after = request.after_version
        self.snapshot_streams += 1
        try:
            if request.compact:
                async for reply in self._watch_compact(tenant, request, context):
                    yield reply
            while not request.compact:
                tenant = await self.gate.authenticate(context)
                if self.plane.tenant_version(tenant) > after:
                    try:
                        version, payload = await self._snapshot(tenant)
                    except OverloadedError as error:
                        log.warning("tenant %r: %s", tenant.name, error)
                        raise
                    if version > after:
                        self.metrics.snapshot_sent(version)
                        yield payload  # the tenant's one copy, written within the budget
                        after = version
                    del payload  # a waiting stream holds no version it has sent
                await asyncio.sleep(self.watch_interval_s)
        finally:
            self.snapshot_streams -= 1
            if self.gate.streams_of(tenant.name) <= 1:  # the tenant's last stream
                dropped = self._latest.pop(tenant.name, None)
                if tenant.name not in self._builds and tenant.name not in self._compact_builds:
                    self.trimmer.released(self.plane.forget_snapshots(tenant))
                if dropped is not None:
                    self.trimmer.released(len(dropped[1]))

    async def _watch_compact(
        self,
        tenant: Tenant,
        request: model_pb2.WatchSnapshotsRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """A full compact snapshot first unless the client holds a version of the
        tenant's table (same lineage), then deltas (``controlplane.snapshots``)."""
        after, lineage = request.after_version, request.lineage
        compact = self.plane.compact
        while True:
            tenant = await self.gate.authenticate(context)
            if self.plane.tenant_version(tenant) > compact.version(tenant.name):
                await self._compact_update(tenant)
            got = compact.reply(tenant.name, after, lineage)
            if got is not None:
                after, lineage, payload = got
                self.metrics.snapshot_sent(after)
                yield payload
            await asyncio.sleep(self.watch_interval_s)

    async def _compact_update(self, tenant: Tenant) -> int:
        """One update of the tenant's compact table at a time, shared by its streams."""
        build = self._compact_builds.get(tenant.name)
        if build is None:
            build = asyncio.ensure_future(
                self._view(tenant.name, self.plane.update_compact, tenant)
            )
            self._compact_builds[tenant.name] = build
            build.add_done_callback(
                functools.partial(_forget_build, self._compact_builds, tenant.name)
            )
        return await asyncio.shield(build)

    async def _snapshot(self, tenant: Tenant) -> tuple[int, bytes]:
        """The tenant's latest serialized snapshot; one build at a time per tenant, in a
        worker thread, shared by all of the tenant's streams."""
        latest = self._latest.get(tenant.name)
        if latest is not None and latest[0] >= self.plane.tenant_version(tenant):
            return latest
        build = self._builds.get(tenant.name)
        if build is None:
            build = asyncio.ensure_future(
                self._view(tenant.name, self.plane.snapshot_payload, tenant)
            )
            self._builds[tenant.name] = build
            build.add_done_callback(functools.partial(self._built, tenant.name))
        return await asyncio.shield(build)

    def _built(self, name: str, build: asyncio.Future[tuple[int, bytes]]) -> None:
        self._builds.pop(name, None)
        if not build.cancelled() and build.exception() is None:
            self._latest[name] = build.result()


def _forget_build(builds: dict[str, Any], name: str, _: object) -> None:
    builds.pop(name, None)


def _retrieve(write: asyncio.Future[None]) -> None:
    """Retrieve a write's error (its handler reports it, if the handler is still there)."""
    if not write.cancelled():
        write.exception()


def _distribution(
    v: inspection.DistributionView, version: int
) -> inspect_pb2.GetToolDistributionResponse:
    return inspect_pb2.GetToolDistributionResponse(
        tool_name=v.tool,
        signature=v.signature,
        basis=v.basis,
        sample_count=v.sample_count,
        seen_count=v.seen_count,
        drift_epoch=v.drift_epoch,
        quantiles=[inspect_pb2.Quantile(q=q, value=duration(s)) for q, s in v.quantiles],
        cdf=[inspect_pb2.CdfPoint(duration=duration(s), probability=p) for s, p in v.cdf],
        pins=_pins(v.pins),
        model_version=version,
    )
