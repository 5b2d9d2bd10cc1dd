"""``cachettl bench retention``: a soak of the event log's retention.

On one database (``--db``; a fresh SQLite file by default) it runs, in this process, a
primary server that compacts the log (``--retention``, ``--compact-interval``) and a replica
that tails the same log without compacting, slowly (``--replica-tail``, longer than the
horizon plus the compaction interval, so compactions delete rows it has not read yet and
it restarts from a snapshot). Writers send tool
calls and program ends at ``--rate`` events per second through gRPC to the primary.
Every ``--every`` seconds it prints the rows the log holds, the events acknowledged and
the compactions. At the end it checks, and prints:

- the live models of the primary and of the replica, a restore (a server started on the
  compacted store) and a new replica (started now, over gRPC) are equal
  (:func:`controlplane.state.differences`);
- every acknowledged event is in the models once (their tool-call and program counts equal
  the acknowledgements), and every event sent after the latest compaction's cutoff is still
  in the log.

Exit status 0 when all hold.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.cli.compact import parse_age

__all__ = ["Soak", "SoakResult", "register", "soak"]

TOOLS = ("bash", "grep", "python", "edit", "search")
BATCH = 20


def register(bench: Any) -> None:
    p = bench.add_parser("retention", help="soak of the log's retention: rows, models equal")
    p.add_argument("--db", default=None, metavar="URL", help="database (a fresh SQLite file)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak (10)")
    p.add_argument("--retention", type=parse_age, default=30.0, metavar="AGE", help="horizon (30s)")
    p.add_argument("--compact-interval", type=parse_age, default=10.0, metavar="AGE", help="(10s)")
    p.add_argument("--snapshot-interval", type=float, default=5.0, help="seconds (5)")
    p.add_argument("--replica-tail", type=float, default=60.0, help="replica's tail, s (60)")
    p.add_argument("--rate", type=float, default=400.0, help="events per second (400)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between lines (30)")
    p.set_defaults(handler=_run)


@dataclass(frozen=True)
class Soak:
    """What a soak runs: its database, length, horizon and load."""

    url: str
    seconds: float
    retention_s: float
    compact_s: float
    snapshot_s: float = 5.0
    replica_tail_s: float = 60.0
    rate: float = 400.0
    every_s: float = 30.0
    min_samples: int = 10


@dataclass
class SoakResult:
    """Rows over time (elapsed s, tool-call rows, program-end rows, acknowledged events),
    the compactions, rows deleted, and what the checks found (empty lists: all equal)."""

    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    compactions: int = 0
    deleted: int = 0
    acked_calls: int = 0
    acked_ends: int = 0
    failed_batches: int = 0
    differences: dict[str, list[str]] = field(default_factory=dict)
    lost: int = 0
    counted: tuple[int, int] = (0, 0)
    reloads: int = 0

    @property
    def ok(self) -> bool:
        equal = not any(self.differences.values())
        once = self.counted == (self.acked_calls, self.acked_ends)
        return equal and once and self.lost == 0 and self.failed_batches == 0


class _Server:
    """A real gRPC server over ``plane`` on its own thread and event loop (port 0)."""

    def __init__(self, plane: Any, **options: Any) -> None:
        from controlplane.rpc.server import ControlPlaneServer, ServerOptions

        self.plane = plane
        self.server = ControlPlaneServer(plane, ServerOptions(listen="127.0.0.1:0", **options))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.target = f"127.0.0.1:{self._run(self.server.start())}"

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def stop(self) -> None:
        self._run(self.server.stop(grace_s=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class _Writers:
    """Paced writers through gRPC: each batch's send time and ids, once acknowledged."""

    def __init__(self, targets: list[tuple[str, str]], rate: float) -> None:
        self.targets, self.rate = targets, rate
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.batches: list[tuple[float, list[str]]] = []
        self.ends = 0
        self.failed = 0
        self._threads = [
            threading.Thread(target=self._write, args=(i, t, k), daemon=True)
            for i, (t, k) in enumerate(targets)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _write(self, writer: int, target: str, token: str) -> None:
        from controlplane.rpc.client import ControlPlaneClient, ToolCall

        rng = np.random.default_rng(writer)
        period = BATCH * len(self.targets) / self.rate
        n, next_at = 0, time.monotonic()
        with ControlPlaneClient(target, token, timeout_s=60) as client:
            while not self.stopping.is_set():
                program = f"w{writer}-p{n}"
                calls = [
                    ToolCall(
                        f"w{writer}-{n}-{i}",
                        program,
                        TOOLS[i % len(TOOLS)],
                        f"run --case {i % 3}",
                        float(rng.lognormal(np.log(1.0 + i % len(TOOLS)), 0.5)),
                    )
                    for i in range(BATCH)
                ]
                sent = time.time()
                try:
                    client.record_tool_calls(calls)
                    client.record_program_end(program, BATCH, finished_at=sent)
                except Exception:
                    with self.lock:
                        self.failed += 1
                    continue
                with self.lock:
                    self.batches.append((sent, [c.event_id for c in calls]))
                    self.ends += 1
                n += 1
                next_at += period
                self.stopping.wait(max(0.0, next_at - time.monotonic()))


def soak(spec: Soak, say: Callable[[str], None] = print) -> SoakResult:
    """Run the soak of the module docstring; returns its figures and checks."""
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store
    from controlplane.storage.base import Horizon

    stores = [create_store(spec.url) for _ in range(4)]
    primary = ControlPlane(stores[0], min_samples=spec.min_samples)
    _, acme = primary.create_tenant("acme")
    _, beta = primary.create_tenant("beta", share=True)
    first = _Server(
        primary,
        tail_interval_s=0.5,
        snapshot_interval_s=spec.snapshot_s,
        retention=Horizon(max_age_s=spec.retention_s),
        compact_interval_s=spec.compact_s,
    )
    replica = _Server(
        ControlPlane(stores[1], min_samples=spec.min_samples),
        tail_interval_s=spec.replica_tail_s,
        snapshot_interval_s=spec.snapshot_s,
    )
    targets = [(first.target, acme), (first.target, beta)]
    writers = _Writers(targets, spec.rate)
    result = SoakResult()
    try:
        writers.start()
        _watch(spec, stores[2], writers, primary, result, say)
        writers.stop()
        _check(spec, stores, (primary, acme), replica, writers, result, say)
    finally:
        writers.stop()
        for server in (first, replica):
            server.stop()
        for store in stores:
            store.close()
    return result


def _watch(
    spec: Soak, store: Any, writers: _Writers, primary: Any, result: SoakResult, say: Any
) -> None:
    """Sample the log's rows every ``every_s`` until the soak's end."""
    start = time.monotonic()
    say("elapsed_s  tool_call_rows  program_end_rows  acked_events  compactions  deleted")
    while (elapsed := time.monotonic() - start) < spec.seconds:
        time.sleep(min(spec.every_s, max(0.0, spec.seconds - elapsed)))
        calls, ends = store.log_rows()
        with writers.lock:
            acked = sum(len(ids) for _, ids in writers.batches) + writers.ends
        sample = (time.monotonic() - start, calls, ends, acked)
        result.samples.append(sample)
        counters = primary.retention
        deleted = sum(counters.deleted.values())
        say(
            f"{sample[0]:9.0f}  {calls:14d}  {ends:16d}  {acked:12d}  "
            f"{counters.compactions:11d}  {deleted:7d}"
        )


def _check(
    spec: Soak,
    stores: list[Any],
    primary_and_token: tuple[Any, str],
    replica: _Server,
    writers: _Writers,
    result: SoakResult,
    say: Any,
) -> None:
    """The checks of the module docstring, into ``result``."""
    from controlplane.rpc.client import ControlPlaneClient
    from controlplane.service import ControlPlane
    from controlplane.state import differences

    primary, token = primary_and_token
    primary.catch_up()
    replica.plane.catch_up()
    restored = ControlPlane(stores[2], min_samples=spec.min_samples)
    late = _Server(ControlPlane(stores[3], min_samples=spec.min_samples), tail_interval_s=0.5)
    try:
        result.differences = {
            "replica": differences(primary.state, replica.plane.state),
            "restore": differences(primary.state, restored.state),
            "new replica": differences(primary.state, late.plane.state),
        }
        with ControlPlaneClient(late.target, token) as client:
            served = client.workload_stats().tool_calls  # the new replica, over gRPC
        if served != primary.state.tool_calls.get("acme", 0):
            result.differences["new replica"].append(f"acme's tool_calls over gRPC: {served}")
    finally:
        late.stop()
    counters = primary.retention
    result.compactions = counters.compactions
    result.deleted = sum(counters.deleted.values())
    result.acked_calls = sum(len(ids) for _, ids in writers.batches)
    result.acked_ends, result.failed_batches = writers.ends, writers.failed
    state = primary.state
    result.counted = (sum(state.tool_calls.values()), sum(state.programs.values()))
    result.reloads = replica.plane.retention.reloads
    result.lost = _lost(stores[2], writers)
    _report(result, say)


def _lost(store: Any, writers: _Writers) -> int:
    """Events sent after the latest compaction's cutoff that the log no longer holds."""
    mark = store.log_compaction()
    cutoff = mark.cutoff if mark is not None and mark.cutoff is not None else 0.0
    stored = {row.call.event_id for row in store.read_tool_calls(0, 10**9)}
    inside = [i for sent, ids in writers.batches if sent >= cutoff for i in ids]
    return sum(1 for i in inside if i not in stored)


def _report(result: SoakResult, say: Any) -> None:
    rows = [calls for _, calls, _, _ in result.samples]
    half = rows[len(rows) // 2 :] or [0]
    say(
        f"acknowledged: {result.acked_calls} tool calls, {result.acked_ends} program ends "
        f"({result.failed_batches} batches failed); compactions: {result.compactions}, "
        f"rows deleted: {result.deleted}; the replica restarted from a snapshot "
        f"{result.reloads} times (the log compacted past it)"
    )
    say(
        f"tool-call rows: max {max(rows, default=0)}, max over the second half {max(half)}, "
        f"last {rows[-1] if rows else 0}"
    )
    say(
        f"models count {result.counted[0]} tool calls and {result.counted[1]} programs "
        f"(acknowledged: {result.acked_calls}, {result.acked_ends})"
    )
    say(f"acknowledged events inside the horizon missing from the log: {result.lost}")
    for name, found in result.differences.items():
        say(f"live models == {name}: {'yes' if not found else 'NO ' + ', '.join(found[:5])}")
    say("retention soak: " + ("PASS" if result.ok else "FAIL"))


def _run(args: argparse.Namespace) -> int:
    url = args.db
    with tempfile.TemporaryDirectory() as tmp:
        if url is None:
            url = f"sqlite:///{Path(tmp) / 'retention.sqlite3'}"
        spec = Soak(
            url,
            args.minutes * 60.0,
            args.retention,
            args.compact_interval,
            args.snapshot_interval,
            args.replica_tail,
            args.rate,
            args.every,
        )
        print(
            f"retention soak on {url.split('?')[0]}: {args.minutes:g} min, horizon "
            f"{args.retention:g} s, compaction every {args.compact_interval:g} s, snapshot "
            f"every {args.snapshot_interval:g} s, replica tail {args.replica_tail:g} s, "
            f"{args.rate:g} events/s",
            flush=True,
        )
        result = soak(spec, lambda line: print(line, flush=True))
    return 0 if result.ok else 1
