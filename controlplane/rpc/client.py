"""A small synchronous client of the control plane, for engine hooks, simulators and scripts.

Example (``token`` printed by ``cachettl tenants create NAME``)::

    from controlplane.rpc.client import ControlPlaneClient, ToolCall

    with ControlPlaneClient("127.0.0.1:50051", token) as cp:
        cp.record_tool_calls([ToolCall("ev-1", "prog-7", "bash", "pytest -x", 6.2)])
        cp.record_program_end("prog-7", total_turns=12)
        ttl_s = cp.decide_ttl("bash", "pytest -x", context_tokens=30_000).ttl_s

Every method blocks for at most ``timeout_s`` and raises ``grpc.RpcError`` on failure
(its ``code()`` is INVALID_ARGUMENT for bad input, UNAUTHENTICATED / PERMISSION_DENIED for
a bad token, RESOURCE_EXHAUSTED when the server is overloaded, UNAVAILABLE when it or its
database is down). Retrying ``record_tool_calls`` with the same ``event_id``s is safe:
repeats are counted as duplicates and ignored; so is retrying ``record_program_end`` with
the same ``program_id`` and ``finished_at`` (another ``finished_at`` is another run of the
program id, recorded too). Thread-safe (one channel, shared).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from controlplane._gen.cachettl.v1 import (
    cluster_pb2,
    cluster_pb2_grpc,
    events_pb2,
    events_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    ttl_pb2,
    ttl_pb2_grpc,
)
from controlplane.kvhints import envelope_from_proto
from controlplane.records import MissReason, ToolCall, TurnCache
from controlplane.snapshots import MAX_SNAPSHOT_BYTES
from controlplane.wire import duration, seconds, timestamp
from estimator import RequestFacts

__all__ = [
    "ClientTls",
    "ControlPlaneClient",
    "RecordResult",
    "ToolCall",
    "TtlDecision",
    "to_decide_request",
    "to_event",
]


@dataclass(frozen=True, slots=True)
class TtlDecision:
    """The answer of ``decide_ttl`` (seconds throughout). ``kv_hints``: the decision as a
    KV-hint envelope in its JSON form (one ``cachettl.retention`` action with ``ttl_s``),
    to forward to an engine as is (``controlplane.kvhints``); ``None`` from a server that
    does not send one. Two decisions are equal when they decide the same: the envelope
    is left out of the comparison (its ``message_id`` is unique to each answer, and its
    payload restates ``ttl_s``)."""

    ttl_s: float
    return_probability: float
    expected_benefit_s: float
    basis: str
    model_version: int
    benefit_s: float
    kv_hints: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RecordResult:
    """The acknowledgement of a committed batch."""

    accepted: int
    duplicates: int
    model_version: int


@dataclass(frozen=True)
class ClientTls:
    """Server CA (PEM) and, for mutual TLS, the client's own certificate and key."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


def to_event(call: ToolCall) -> events_pb2.ToolCallEvent:
    """The wire form of a tool call (raises ValueError on NaN/infinite durations)."""
    event = events_pb2.ToolCallEvent(
        event_id=call.event_id,
        program_id=call.program_id,
        tool_name=call.tool,
        tool_args=call.tool_args,
        duration=duration(call.duration_s, "duration_s"),
        turn_index=call.turn_index,
        pin_outcome=int(call.pin_outcome),  # type: ignore[arg-type]
        shadow=call.shadow,
    )
    if call.finished_at is not None:
        event.finished_at.CopyFrom(timestamp(call.finished_at))
    if call.chosen_ttl_s is not None:
        event.chosen_ttl.CopyFrom(duration(call.chosen_ttl_s, "chosen_ttl_s"))
    if call.admission_delay_s is not None:
        event.admission_delay.CopyFrom(duration(call.admission_delay_s, "admission_delay_s"))
    _cache_fields(event, call.cache)
    return event


def _cache_fields(event: events_pb2.ToolCallEvent, cache: TurnCache) -> None:
    """The returning turn's cache report on the wire (fields not observed stay unset)."""
    event.miss_reason = int(cache.reason)  # type: ignore[assignment]
    event.not_pinned_cause = int(cache.not_pinned_cause)  # type: ignore[assignment]
    if cache.expired_by_s is not None:
        event.expired_by.CopyFrom(duration(cache.expired_by_s, "expired_by_s"))
    for name, value in (
        ("diverged_at_token", cache.diverged_at),
        ("hit_tokens", cache.hit_tokens),
        ("reusable_tokens", cache.reusable_tokens),
    ):
        if value is not None:
            setattr(event, name, value)


def to_decide_request(facts: RequestFacts) -> ttl_pb2.DecideTtlRequest:
    """The wire form of ``facts`` (``controlplane.validation.decide_request`` reverses it;
    ``tenant`` and ``share`` do not travel: the server takes them from the token)."""
    request = ttl_pb2.DecideTtlRequest(
        program_id=facts.program_id or "",
        tool_name=facts.tool,
        tool_args=facts.tool_args or "",
        context_tokens=facts.context_tokens,
        turns_served=facts.turns_served,
        offload=facts.offload,
        waiting_tokens=facts.waiting_tokens,
        free_tokens=facts.free_tokens,
        offloaded_tokens=facts.offloaded_tokens,
    )
    if facts.reload_cost_s is not None:
        request.reload_cost.CopyFrom(duration(facts.reload_cost_s, "reload_cost_s"))
    if facts.queue_delay_s is not None:
        request.queue_delay.CopyFrom(duration(facts.queue_delay_s, "queue_delay_s"))
    return request


class ControlPlaneClient:
    """Calls the control plane at ``target`` ("host:port") as the tenant owning ``token``."""

    def __init__(
        self,
        target: str,
        token: str,
        timeout_s: float = 5.0,
        tls: ClientTls | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        # Snapshots may pass gRPC's default receive limit of 4 MiB (controlplane.snapshots).
        options = [("grpc.max_receive_message_length", MAX_SNAPSHOT_BYTES)]
        if tls is None:
            self._channel = grpc.insecure_channel(target, options)
        else:
            self._channel = grpc.secure_channel(target, tls.credentials(), options)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._events: Any = events_pb2_grpc.ToolEventServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._ttl: Any = ttl_pb2_grpc.TtlServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._inspect: Any = inspect_pb2_grpc.InspectServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._models: Any = model_pb2_grpc.ModelServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._cluster: Any = cluster_pb2_grpc.PinCoherenceServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def _kw(self) -> dict[str, Any]:
        return {"timeout": self.timeout_s, "metadata": self._metadata}

    # -- ingest -----------------------------------------------------------------------

    def record_tool_calls(self, calls: Sequence[ToolCall]) -> RecordResult:
        """Store a batch (1..1000 calls); returns once the server has committed it."""
        request = events_pb2.RecordToolCallsRequest(events=[to_event(c) for c in calls])
        reply = self._events.RecordToolCalls(request, **self._kw())
        return RecordResult(reply.accepted, reply.duplicates, reply.model_version)

    def record_program_end(
        self, program_id: str, total_turns: int, finished_at: float | None = None
    ) -> bool:
        """Record a program's end; False if this end had been recorded before.

        An end is (``program_id``, ``finished_at``): a rerun of the program id that ends
        at another time is recorded too; resending the same end (a retry) is not.
        """
        request = events_pb2.RecordProgramEndRequest(program_id=program_id, total_turns=total_turns)
        if finished_at is not None:
            request.finished_at.CopyFrom(timestamp(finished_at))
        return not self._events.RecordProgramEnd(request, **self._kw()).duplicate

    # -- decisions --------------------------------------------------------------------

    def decide_ttl(
        self,
        tool_name: str,
        tool_args: str = "",
        context_tokens: int = 0,
        *,
        program_id: str = "",
        turns_served: int = 0,
        reload_cost_s: float | None = None,
        queue_delay_s: float | None = None,
        offload: bool = False,
        waiting_tokens: int | None = None,
        free_tokens: int | None = None,
        offloaded_tokens: int | None = None,
    ) -> TtlDecision:
        """The server policy's TTL for a finished turn that called ``tool_name``.

        ``waiting_tokens`` / ``free_tokens``: the engine's load now (KV demand of waiting
        requests, free KV capacity); ``offloaded_tokens``: how much of the context a CPU
        tier holds. ``None`` means "not known"; without both load signals the server
        prices holding as if the queue were full. Bad values raise ``ValueError`` naming
        the argument (see :class:`estimator.RequestFacts`).
        """
        facts = RequestFacts(
            tool=tool_name,
            tool_args=tool_args or None,
            context_tokens=context_tokens,
            program_id=program_id or None,
            turns_served=turns_served,
            reload_cost_s=reload_cost_s,
            queue_delay_s=queue_delay_s,
            offload=offload,
            waiting_tokens=waiting_tokens,
            free_tokens=free_tokens,
            offloaded_tokens=offloaded_tokens,
        )
        return self.decide(facts)

    def decide(self, facts: RequestFacts) -> TtlDecision:
        """``decide_ttl`` for facts already gathered (their ``tenant`` and ``share`` are
        ignored: the server takes both from the token)."""
        r = self._ttl.DecideTtl(to_decide_request(facts), **self._kw())
        return TtlDecision(
            seconds(r.ttl),
            r.return_probability,
            seconds(r.expected_benefit),
            r.basis,
            r.model_version,
            seconds(r.benefit),
            envelope_from_proto(r.kv_hints) if r.HasField("kv_hints") else None,
        )

    # -- inspection and snapshots (wire messages, see proto/cachettl/v1/) -------------

    def list_tools(self) -> inspect_pb2.ListToolsResponse:
        return self._inspect.ListTools(inspect_pb2.ListToolsRequest(), **self._kw())  # type: ignore[no-any-return]

    def tool_distribution(
        self, tool_name: str, tool_args: str = "", cdf_points: int = 0
    ) -> inspect_pb2.GetToolDistributionResponse:
        request = inspect_pb2.GetToolDistributionRequest(
            tool_name=tool_name, tool_args=tool_args, cdf_points=cdf_points
        )
        return self._inspect.GetToolDistribution(request, **self._kw())  # type: ignore[no-any-return]

    def list_misses(
        self,
        tool_name: str = "",
        program_id: str = "",
        reason: MissReason = MissReason.UNSPECIFIED,
        limit: int = 0,
    ) -> inspect_pb2.ListMissesResponse:
        """Recent missed turns, newest first, and the summary by reason (``ListMisses``)."""
        request = inspect_pb2.ListMissesRequest(
            tool_name=tool_name,
            program_id=program_id,
            reason=int(reason),  # type: ignore[arg-type]
            limit=limit,
        )
        return self._inspect.ListMisses(request, **self._kw())  # type: ignore[no-any-return]

    def workload_stats(self) -> inspect_pb2.GetWorkloadStatsResponse:
        request = inspect_pb2.GetWorkloadStatsRequest()
        return self._inspect.GetWorkloadStats(request, **self._kw())  # type: ignore[no-any-return]

    def watch_snapshots(
        self,
        after_version: int = 0,
        timeout_s: float | None = None,
        *,
        compact: bool = False,
        lineage: int = 0,
    ) -> Iterator[model_pb2.WatchSnapshotsResponse]:
        """Snapshots newer than ``after_version``, as the server publishes them.

        The stream runs until ``timeout_s`` (default: none) or the caller stops iterating;
        to resume after a disconnect pass the last ``version`` received. With ``compact``,
        compact models and deltas: pass the last reply's ``lineage`` too (0: a full
        snapshot first); a delta whose ``base_version`` is not the version held calls for
        a new stream with lineage 0.
        """
        request = model_pb2.WatchSnapshotsRequest(
            after_version=after_version, compact=compact, lineage=lineage
        )
        stream = self._models.WatchSnapshots(request, timeout=timeout_s, metadata=self._metadata)
        try:
            yield from stream
        finally:
            stream.cancel()

    # -- pin coherence ----------------------------------------------------------------

    def report_arrivals(self, engine_id: str, arrivals: Sequence[tuple[str, float]]) -> int:
        """Report turn arrivals ``(program_id, arrived_at)`` at ``engine_id`` (1..1000);
        returns how many were programs last seen on another engine."""
        return int(self.report_arrivals_answer(engine_id, arrivals).moved)

    def report_arrivals_answer(
        self, engine_id: str, arrivals: Sequence[tuple[str, float]]
    ) -> cluster_pb2.ReportArrivalsResponse:
        """:meth:`report_arrivals`, answering whole: the moves, and the arrivals refused
        one by one (``refused``; the first named in ``refusals`` with their reasons)."""
        request = cluster_pb2.ReportArrivalsRequest(
            engine_id=engine_id,
            arrivals=[
                cluster_pb2.Arrival(program_id=program, arrived_at=timestamp(at))
                for program, at in arrivals
            ],
        )
        answer: cluster_pb2.ReportArrivalsResponse = self._cluster.ReportArrivals(
            request, **self._kw()
        )
        return answer

    def watch_moves(
        self, engine_id: str, timeout_s: float | None = None
    ) -> Iterator[cluster_pb2.WatchMovesResponse]:
        """The programs that move away from ``engine_id`` (their turns arrive at another
        engine), as they move, until ``timeout_s`` or the caller stops iterating."""
        request = cluster_pb2.WatchMovesRequest(engine_id=engine_id)
        stream = self._cluster.WatchMoves(request, timeout=timeout_s, metadata=self._metadata)
        try:
            yield from stream
        finally:
            stream.cancel()

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlPlaneClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
