"""`cachettl bench controlplane`: DecideTtl latency and rate, ingest rate, on loopback.

Starts its own server process (`cachettl serve`, one process, so one core for the
server's Python) on a fresh database, then measures from this process:

- DecideTtl latency p50/p99 at a paced 500 requests/s (target p99 <= 2 ms), alone,
  with 1,000 events/s of ingest (batches of 100 every 0.1 s, another tenant, from another
  process) into the same server alongside, and, as a control, with that ingest going to
  a second server process (the same load on the machine, none on the server timed);
- the maximum DecideTtl rate with 64 requests in flight (target >= 2,000/s);
- ingest rate, batches of 100 events, 4 batches in flight, into SQLite and PostgreSQL
  (target >= 20,000 events/s);

and, as baselines measured in the same run, the same work without gRPC (the policy's
``decide`` in-process; ``Store.append_tool_calls`` in-process), printing the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.cli.benchload import (
    latency_with_ingest,
    paced_latency,
    prepare,
    server,
)
from controlplane.cli.pgschema import drop_schema as _drop_schema
from controlplane.cli.pgschema import pg_schema_url as _pg_schema_url

__all__ = ["register_bench"]

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def register_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from controlplane.cli.linkbench import add_link_flags

    p = bench.add_parser(
        "controlplane", help="DecideTtl latency/rate and ingest rate; with --links, engine links"
    )
    p.add_argument(
        "--seconds", type=float, default=None, help="length of each phase (4; --links: 20)"
    )
    p.add_argument("--postgres", default=PG_DEFAULT, metavar="URL", help="'' to skip")
    add_link_flags(p)  # --links N: controlplane.cli.linkbench
    from controlplane.cli.decidebench import add_decide_flags

    add_decide_flags(p)  # --decide-rate R: controlplane.cli.decidebench
    p.set_defaults(handler=_run)
    from controlplane.cli.watchbench import register as register_watch

    register_watch(bench)  # cachettl bench slow-watchers
    from controlplane.cli.memorybench import register as register_memory

    register_memory(bench)  # cachettl bench memory
    from controlplane.cli.doorbench import register as register_doors

    register_doors(bench)  # cachettl bench doors
    from controlplane.cli.retentionbench import register as register_retention

    register_retention(bench)  # cachettl bench retention


async def _max_rate(target: str, token: str, seconds: float, inflight: int) -> float:
    import grpc

    from controlplane._gen.cachettl.v1 import ttl_pb2, ttl_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub: Any = ttl_pb2_grpc.TtlServiceStub(channel)  # type: ignore[no-untyped-call]
        meta = (("authorization", f"Bearer {token}"),)
        request = ttl_pb2.DecideTtlRequest(tool_name="bash", tool_args="ls", context_tokens=4000)
        done = 0
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await stub.DecideTtl(request, metadata=meta, timeout=10)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return done / (time.perf_counter() - start)


async def _ingest_rate(target: str, token: str, seconds: float, inflight: int) -> float:
    import grpc

    from controlplane._gen.cachettl.v1 import events_pb2, events_pb2_grpc
    from controlplane.records import ToolCall
    from controlplane.rpc.client import to_event

    async with grpc.aio.insecure_channel(target) as channel:
        stub: Any = events_pb2_grpc.ToolEventServiceStub(channel)  # type: ignore[no-untyped-call]
        meta = (("authorization", f"Bearer {token}"),)
        stored = 0
        deadline = time.perf_counter() + seconds
        counter = iter(range(10**9))

        async def worker() -> None:
            nonlocal stored
            while time.perf_counter() < deadline:
                b = next(counter)
                events = [
                    to_event(ToolCall(f"b{b}-{i}", f"p{b}", "bash", "pytest -x", 0.5 + i / 100))
                    for i in range(100)
                ]
                request = events_pb2.RecordToolCallsRequest(events=events)
                reply = await stub.RecordToolCalls(request, metadata=meta, timeout=30)
                stored += reply.accepted

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return stored / (time.perf_counter() - start)


def _direct_ingest_rate(db_url: str, seconds: float) -> float:
    from controlplane.records import ToolCall
    from controlplane.storage import create_store

    store = create_store(db_url)
    (tenant,) = [t for t in store.list_tenants() if t.name == "bench"]
    stored, b = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        calls = [ToolCall(f"d{b}-{i}", "p", "bash", "ls", 0.5) for i in range(100)]
        stored += store.append_tool_calls(tenant, calls).accepted
        b += 1
    rate = stored / (time.perf_counter() - start)
    store.close()
    return rate


def _direct_decide_rate(seconds: float) -> float:
    from estimator import RequestFacts, get_policy

    policy = get_policy("cachettl")
    models = policy.new_models(min_samples=10)
    for d in np.random.default_rng(0).lognormal(0.0, 1.0, 2000):
        models.record_tool_call("bash", "ls", float(d))
    facts = RequestFacts(tool="bash", tool_args="ls", context_tokens=4000)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        policy.decide(facts, models)
        n += 1
    return n / (time.perf_counter() - start)


def _ingest_phase(name: str, url: str, seconds: float) -> None:
    token, _ = prepare(url, 100)
    with server(url) as target:
        rate = asyncio.run(_ingest_rate(target, token, seconds, inflight=4))
    direct = _direct_ingest_rate(url, seconds)
    print(
        f"ingest into {name:<10}: {rate:>9,.0f} events/s via gRPC (batches of 100; "
        f"target >= 20,000)   in-process store {direct:>9,.0f} events/s   "
        f"ratio {rate / direct:.2f}"
    )
    if name == "PostgreSQL":
        now, before = _pg_round_trips(url, seconds)
        print(
            f"  PostgreSQL batch, in-process: one statement {now:>9,.0f} events/s   "
            f"previous five round trips {before:>9,.0f} events/s   ratio {now / before:.2f}"
        )


def _pg_round_trips(url: str, seconds: float) -> tuple[float, float]:
    """Events/s of the store's batch insert now (one autocommitted statement that takes
    the log's lock, no ping of a busy connection) and as it was (a ping on every
    checkout, BEGIN, the lock, the insert, COMMIT: five round trips), in alternating
    slices of 0.25 s so that both see the same load."""
    from sqlalchemy import create_engine

    from controlplane.records import ToolCall
    from controlplane.storage import create_store, sql

    store = create_store(url)
    (tenant,) = [t for t in store.list_tenants() if t.name == "bench"]
    previous = create_engine(
        sql.normalize_url(url), pool_pre_ping=True, connect_args={"prepare_threshold": None}
    )
    columns = sql._ARRAY_COLUMNS
    insert = (
        f"INSERT INTO tool_events (tenant_id, shared, received_at, {', '.join(columns)}) "
        "SELECT %(tenant)s, %(shared)s, %(now)s, * FROM unnest("
        + ", ".join(f"CAST(%({k})s AS {t}[])" for k, t in columns.items())
        + ") ON CONFLICT (tenant_id, event_id) DO NOTHING RETURNING event_id, seq"
    )

    def before(calls: list[ToolCall]) -> int:
        now = time.time()
        params: dict[str, Any] = {"tenant": tenant.id, "shared": tenant.share, "now": now}
        rows = [sql._call_row(tenant, call, now) for call in calls]
        for name in columns:
            params[name] = [r[name] for r in rows]
        with sql.transaction(previous, write=True) as c:  # BEGIN, then the lock
            return len(c.exec_driver_sql(insert, params).all())

    def after(calls: list[ToolCall]) -> int:
        return len(store.append_tool_calls(tenant, calls).seqs)

    stored, spent, b = [0, 0], [0.0, 0.0], 0
    while sum(spent) < 2 * seconds:
        for i, append in enumerate((after, before)):
            start = time.perf_counter()
            while time.perf_counter() - start < 0.25:
                b += 1
                stored[i] += append(
                    [ToolCall(f"r{b}-{k}", "p", "bash", "ls", 0.5) for k in range(100)]
                )
            spent[i] += time.perf_counter() - start
    store.close()
    previous.dispose()
    return stored[0] / spent[0], stored[1] / spent[1]


def _run(args: argparse.Namespace) -> int:
    if args.links:
        from controlplane.cli.linkbench import run_links

        return run_links(args, 20.0 if args.seconds is None else float(args.seconds))
    if args.decide_rate:
        from controlplane.cli.decidebench import run_decide

        return run_decide(args, 4.0 if args.seconds is None else float(args.seconds))
    seconds = 4.0 if args.seconds is None else float(args.seconds)
    if not 0.5 <= seconds <= 120:
        raise ValueError("--seconds must be in 0.5..120")
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
        token, loader = prepare(url, 2000)
        other_url = f"sqlite:///{Path(tmp) / 'other.sqlite3'}"
        _, other_loader = prepare(other_url, 0)
        with server(url) as target, server(other_url) as other:
            lat = paced_latency(target, token, 500.0, seconds) * 1e3
            busy, ingested = latency_with_ingest(target, token, loader, seconds)
            control, _ = latency_with_ingest(target, token, other_loader, seconds, other)
            rate = asyncio.run(_max_rate(target, token, seconds, inflight=64))
        direct = _direct_decide_rate(min(seconds, 2.0))
        p50, p99 = np.percentile(lat, [50, 99])
        print(f"DecideTtl at 500 req/s: p50 {p50:.3f} ms  p99 {p99:.3f} ms (target <= 2 ms)")
        b50, b99 = np.percentile(busy * 1e3, [50, 99])
        print(
            f"  with ingest alongside ({ingested:,.0f} events/s): p50 {b50:.3f} ms  "
            f"p99 {b99:.3f} ms (target <= 2 ms)"
        )
        c50, c99 = np.percentile(control * 1e3, [50, 99])
        print(
            f"  control, that ingest into another server process: p50 {c50:.3f} ms  "
            f"p99 {c99:.3f} ms"
        )
        print(
            f"DecideTtl max rate    : {rate:>9,.0f} req/s (target >= 2,000)   "
            f"in-process decide {direct:>9,.0f}/s   ratio {rate / direct:.3f}"
        )
        _ingest_phase("SQLite", f"sqlite:///{Path(tmp) / 'ingest.sqlite3'}", seconds)
    if args.postgres:
        pg_url, handle = _pg_schema_url(args.postgres)
        try:
            _ingest_phase("PostgreSQL", pg_url, seconds)
        finally:
            _drop_schema(handle)
    return 0
