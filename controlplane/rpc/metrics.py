"""Prometheus metrics of one server (its own registry, so servers in a test don't mix)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from controlplane.learning import LearningCounters, RetentionCounters
    from controlplane.storage.outages import Outages

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class Metrics:
    """RPC counts and latencies, events ingested, decisions by basis, model versions."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, fds
        self.rpcs = Counter("cachettl_rpc_total", "RPCs answered", ["method", "code"], registry=r)
        self.latency = Histogram(
            "cachettl_rpc_latency_seconds",
            "RPC latency",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ingested = Counter(
            "cachettl_events_ingested_total", "Tool-call events stored", registry=r
        )
        self.duplicates = Counter(
            "cachettl_events_duplicate_total", "Repeated events ignored", registry=r
        )
        self.decisions = Counter("cachettl_decisions_total", "TTL decisions", ["basis"], registry=r)
        self.model_version = Gauge(
            "cachettl_model_version", "Log positions applied to the models", registry=r
        )
        self.snapshot_version = Gauge(
            "cachettl_snapshot_version", "Version of the last snapshot streamed", registry=r
        )
        self.slow_streams = Counter(
            "cachettl_slow_streams_dropped_total",
            "Streams ended because their client took no message for the slow-reader timeout",
            ["method"],
            registry=r,
        )

    def track_learning(self, counters: LearningCounters) -> None:
        """Export ``counters``: ``cachettl_events_unlearned_total{reason}`` (committed
        rows learning skipped) and ``cachettl_batches_refused_total{limit}`` (batches
        refused for a per-tenant bound on names)."""
        self.registry.register(_LearningCollector(counters))

    def track_database(self, outages: Outages) -> None:
        """Export the background loops' database outages: ``cachettl_database_outages_total
        {loop}``, ``cachettl_database_failed_rounds_total{loop}`` and the gauge
        ``cachettl_database_reachable`` (0 while a loop's outage is open)."""
        self.registry.register(_DatabaseCollector(outages))

    def track_retention(self, counters: RetentionCounters) -> None:
        """Export the log's compactions by this server: ``cachettl_log_compactions_total``,
        ``cachettl_log_rows_deleted_total{log}``, ``cachettl_log_compaction_reloads_total``
        (the models started again from a snapshot), and of the latest, the gauges
        ``cachettl_log_compaction_position{log}``, ``cachettl_log_compaction_timestamp_seconds``
        and ``cachettl_log_rows_kept{log}`` (rows the log held when it finished)."""
        self.registry.register(_RetentionCollector(counters))

    def track_streams(self, servicer: Any) -> None:
        """Export the pin-coherence counters of ``servicer.coherence`` and the streams its
        gate ended: ``cachettl_moves_told_total``, ``cachettl_moves_coalesced_total``,
        ``cachettl_moves_dropped_total``, ``cachettl_move_streams_dropped_total`` (slow
        readers), ``cachettl_arrivals_refused_total``, ``cachettl_moves_unread`` and
        ``cachettl_streams_revoked_total``."""
        self.registry.register(_StreamCollector(servicer))

    def observe_rpc(self, method: str, code: Any, seconds: float) -> None:
        name = getattr(code, "name", str(code))
        self.rpcs.labels(method, name).inc()
        self.latency.labels(method).observe(seconds)

    def events(self, accepted: int, duplicates: int) -> None:
        self.ingested.inc(accepted)
        self.duplicates.inc(duplicates)

    def decision(self, basis: str) -> None:
        self.decisions.labels(basis).inc()

    def snapshot_sent(self, version: int) -> None:
        self.snapshot_version.set(version)

    def serve(self, host: str, port: int) -> int:
        """Expose ``/metrics`` over HTTP; returns the bound port."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def stop(self) -> None:
        """Stop the HTTP endpoint, if one was started."""
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()


class _LearningCollector(Collector):
    def __init__(self, counters: LearningCounters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[CounterMetricFamily]:
        unlearned = CounterMetricFamily(
            "cachettl_events_unlearned",
            "Committed tool calls and program ends the models could not learn (skipped)",
            labels=["reason"],
        )
        for reason, count in sorted(self.counters.unlearned.items()):
            unlearned.add_metric([reason], count)
        refused = CounterMetricFamily(
            "cachettl_batches_refused",
            "Batches refused whole for a per-tenant bound on distinct names",
            labels=["limit"],
        )
        for limit in ("tools", "signatures"):
            refused.add_metric([limit], self.counters.refused[limit])
        yield unlearned
        yield refused
        yield CounterMetricFamily(
            "cachettl_group_commits",
            "Store commits of tool-call batches (batches waiting meanwhile go in one)",
            value=self.counters.commits,
        )
        yield CounterMetricFamily(
            "cachettl_group_commit_batches",
            "Tool-call batches committed by those commits",
            value=self.counters.batches_committed,
        )


class _DatabaseCollector(Collector):
    def __init__(self, outages: Outages) -> None:
        self.outages = outages

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        o = self.outages
        opened = CounterMetricFamily(
            "cachettl_database_outages",
            "Outages of the database seen by a background loop (logged once each)",
            labels=["loop"],
        )
        failed = CounterMetricFamily(
            "cachettl_database_failed_rounds",
            "Rounds of a background loop that failed",
            labels=["loop"],
        )
        for loop in ("tail", "snapshot", "compact", "listen", "locations"):
            opened.add_metric([loop], o.opened[loop])
            failed.add_metric([loop], o.failed_rounds[loop])
        yield opened
        yield failed
        yield GaugeMetricFamily(
            "cachettl_database_reachable",
            "1 unless a background loop's database outage is open",
            value=1 if o.reachable else 0,
        )


class _RetentionCollector(Collector):
    def __init__(self, counters: RetentionCounters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self.counters
        yield CounterMetricFamily(
            "cachettl_log_compactions", "Compactions of the event log", value=c.compactions
        )
        deleted = CounterMetricFamily(
            "cachettl_log_rows_deleted",
            "Event-log rows deleted by compaction (covered by a snapshot, beyond the horizon)",
            labels=["log"],
        )
        for name, count in c.deleted.items():
            deleted.add_metric([name], count)
        yield deleted
        yield CounterMetricFamily(
            "cachettl_log_compaction_reloads",
            "Times the models started again from a snapshot: the log was compacted past them",
            value=c.reloads,
        )
        done = c.latest
        if done is None:
            return
        position = GaugeMetricFamily(
            "cachettl_log_compaction_position",
            "Log position through which the latest compaction may have deleted rows",
            labels=["log"],
        )
        kept = GaugeMetricFamily(
            "cachettl_log_rows_kept",
            "Rows the log held after the latest compaction",
            labels=["log"],
        )
        for name, at, rows in (
            ("tool_calls", done.tool_seq, done.tool_rows_kept),
            ("program_ends", done.end_seq, done.end_rows_kept),
        ):
            position.add_metric([name], at)
            kept.add_metric([name], rows)
        yield position
        yield kept
        yield GaugeMetricFamily(
            "cachettl_log_compaction_timestamp_seconds",
            "When the latest compaction finished (Unix time)",
            value=done.finished_at or done.started_at,
        )


class _StreamCollector(Collector):
    _COUNTERS = (
        ("cachettl_moves_told", "moves_sent", "Moves queued for WatchMoves streams"),
        ("cachettl_moves_coalesced", "moves_coalesced", "Moves superseding an unread one"),
        ("cachettl_moves_dropped", "moves_dropped", "Moves never told (slow readers)"),
        (
            "cachettl_move_streams_dropped",
            "streams_dropped",
            "WatchMoves streams dropped for not reading their moves",
        ),
        ("cachettl_arrivals_refused", "arrivals_refused", "Arrivals refused one by one"),
        ("cachettl_moves_late", "moves_late", "Moves queued over 1 s after their arrival"),
    )

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        hub = self.servicer.coherence
        for name, attribute, what in self._COUNTERS:
            yield CounterMetricFamily(name, what, value=getattr(hub, attribute))
        yield GaugeMetricFamily("cachettl_moves_unread", "Moves queued, unread", value=hub.unread)
        yield CounterMetricFamily(
            "cachettl_streams_revoked",
            "Streams ended because their token was revoked or replaced",
            value=self.servicer.gate.streams_revoked,
        )
        yield from _memory(self.servicer)


def _memory(servicer: Any) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """Snapshot streams and the memory they hold (controlplane.rpc.sends, .heap)."""
    sends, trimmer = servicer.sends, servicer.trimmer
    yield GaugeMetricFamily(
        "cachettl_snapshot_streams", "WatchSnapshots streams open", value=servicer.snapshot_streams
    )
    yield GaugeMetricFamily(
        "cachettl_snapshot_payload_bytes",
        "Bytes of serialized snapshots kept, one copy per tenant shared by its streams",
        value=servicer.payload_bytes(),
    )
    yield GaugeMetricFamily(
        "cachettl_send_bytes_held",
        "Bytes of snapshots handed to gRPC and not yet written (the send budget in use)",
        value=sends.held,
    )
    yield GaugeMetricFamily(
        "cachettl_send_bytes_abandoned",
        "Bytes of snapshots of streams ended as slow readers, still in gRPC's buffers",
        value=sends.abandoned,
    )
    yield GaugeMetricFamily(
        "cachettl_send_waiting", "Snapshot writes waiting for the send budget", value=sends.waiting
    )
    yield CounterMetricFamily(
        "cachettl_send_waits", "Snapshot writes that waited for the send budget", value=sends.waits
    )
    yield CounterMetricFamily(
        "cachettl_heap_trims",
        "Times freed memory was given back to the system",
        value=trimmer.trims,
    )
    yield CounterMetricFamily(
        "cachettl_heap_trimmed_bytes",
        "Resident bytes those times gave back, in all",
        value=trimmer.freed,
    )
