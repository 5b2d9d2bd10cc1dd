"""``cachettl bench memory --soak-minutes M``: the server's memory with every door in use.

A ``cachettl serve --console`` process on a fresh SQLite file; tenant ``soak`` starts with
50 tools of 200 durations. From a process of its own, threads exercise every door of
that process for M minutes (the rates at ``--rate 1``; ``--rate`` scales them):

- ingest: ``RecordToolCalls``, 20 new events every 0.5 s over 50 tools and 10 argument
  signatures each, and a ``RecordProgramEnd`` every 5 s;
- decisions: ``DecideTtl``, 20 a second;
- pin coherence: ``ReportArrivals`` every 0.25 s from two engines in turn (so programs move
  between them) and each engine's ``WatchMoves`` stream, read;
- snapshots: two compact and one whole ``WatchSnapshots`` streams, read, each opened again
  every 60 s, and every 120 s 20 streams that are never read, for 20 s;
- the console: a page or its JSON every 2 s, in turn over every page; a login through the
  form every 60 s (a new session) and a login with a wrong token every 60 s.

The server's RSS is sampled every 5 s. Printed: RSS before the load, at minute 1, at the
reference minute (10, or a third of a shorter soak), at the end and at its highest; the
end's ratio to the reference (bound: within 10 %); and each door's calls and errors.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from controlplane.cli.benchserver import GAUGES, Server, never_read, scrape, serve

__all__ = ["report_soak", "run_soak"]

#: The stated bound: RSS at the end within this share of its value at the reference minute.
SOAK_BOUND = 0.10
TOOLS, SIGNATURES = 50, 10
PAGES = ("/tools", "/tools?sort=calls", "/tool?name=t0001", "/workload", "/engines", "/shared")


def _seed(db: str) -> dict[str, str]:
    import numpy as np

    from controlplane.records import ToolCall
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    store = create_store(db)
    plane = ControlPlane(store)
    tenant, token = plane.create_tenant("soak")
    rng = np.random.default_rng(0)
    calls = [
        ToolCall(f"seed{t}-{i}", f"p{i % 200}", f"t{t:04d}", f"cmd{i % SIGNATURES}", float(d))
        for t in range(TOOLS)
        for i, d in enumerate(rng.lognormal(0.0, 1.0, 200))
    ]
    for start in range(0, len(calls), 5000):
        store.append_tool_calls(tenant, calls[start : start + 5000])
    store.close()
    return {"soak": token}


class _Doors:
    """The load's threads, their counts and errors (one instance in the load process)."""

    def __init__(self, target: str, console: int, token: str, rate: float, stop: Any) -> None:
        from controlplane.rpc.client import ControlPlaneClient

        self.target, self.console, self.token, self.rate = target, console, token, rate
        self.stop = stop
        self.calls: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.first_error: dict[str, str] = {}
        self.client = ControlPlaneClient(target, token, timeout_s=30)

    def every(self, door: str, period_s: float, step: Callable[[int], object]) -> None:
        """Run ``step(k)`` every ``period_s / rate`` until stopped, counting each."""
        period = period_s / self.rate
        start = time.monotonic()
        for k in itertools.count():
            if self.stop.wait(max(0.0, start + k * period - time.monotonic())):
                return
            try:
                step(k)
                self.calls[door] += 1
            except Exception as error:  # counted; the soak goes on
                self.errors[door] += 1
                self.first_error.setdefault(door, repr(error)[:300])

    def ingest(self, k: int) -> None:
        from controlplane.records import ToolCall

        calls = [
            ToolCall(f"e{k}-{i}", f"p{(k + i) % 200}", f"t{(k + i) % TOOLS:04d}",
                     f"cmd{i % SIGNATURES}", 0.2 + (i * 37 % 100) / 20)
            for i in range(20)
        ]  # fmt: skip
        self.client.record_tool_calls(calls)

    def end(self, k: int) -> None:
        self.client.record_program_end(f"p{k % 200}-{k}", 5)

    def decide(self, k: int) -> None:
        self.client.decide_ttl(f"t{k % TOOLS:04d}", f"cmd{k % SIGNATURES}", 4000)

    def arrivals(self, k: int) -> None:
        now = time.time()
        self.client.report_arrivals(f"e{k % 2}", [(f"p{(k + i) % 50}", now) for i in range(10)])

    def watch(self, door: str, **kwargs: Any) -> None:
        """Read a stream for 60 s at a time, opened again each time (``door`` counts
        its messages)."""
        while not self.stop.is_set():
            try:
                if door == "WatchMoves":
                    stream: Any = self.client.watch_moves(
                        kwargs["engine"], timeout_s=60 / self.rate
                    )
                else:
                    stream = self.client.watch_snapshots(timeout_s=60 / self.rate, **kwargs)
                for _ in stream:
                    self.calls[door] += 1
                    if self.stop.is_set():
                        break
            except Exception as error:
                if "DEADLINE_EXCEEDED" not in repr(error):
                    self.errors[door] += 1
                    self.first_error.setdefault(door, repr(error)[:300])

    def never_read(self, k: int) -> None:
        mine, theirs = multiprocessing.Pipe()
        worker = threading.Thread(target=never_read, args=(self.target, self.token, 20, theirs))
        worker.start()
        mine.recv()
        self.stop.wait(20.0)
        mine.send("close")
        mine.recv()
        worker.join()

    def page(self, k: int) -> None:
        from controlplane.console.bench import Client

        if k % 30 == 0 or not hasattr(self, "_browser"):
            self._browser = Client(self.console)
            if self._browser.login(self.token) != 303:
                raise RuntimeError("console login failed")
            self.calls["console login"] += 1
        path = PAGES[(k // 2) % len(PAGES)]
        status, _ = self._browser.get(path if k % 2 == 0 else "/api" + path)
        if status != 200:
            raise RuntimeError(f"console {path} answered {status}")

    def bad_login(self, k: int) -> None:
        from controlplane.console.bench import Client

        if Client(self.console).login("x" * 43) == 303:
            raise RuntimeError("a wrong token logged in")


def _load(target: str, console: int, token: str, rate: float, stop: Any, out: Any) -> None:
    doors = _Doors(target, console, token, rate, stop)
    jobs: list[tuple[Callable[..., None], tuple[Any, ...], dict[str, Any]]] = [
        (doors.every, ("RecordToolCalls", 0.5, doors.ingest), {}),
        (doors.every, ("RecordProgramEnd", 5.0, doors.end), {}),
        (doors.every, ("DecideTtl", 0.05, doors.decide), {}),
        (doors.every, ("ReportArrivals", 0.25, doors.arrivals), {}),
        (doors.every, ("never-read WatchSnapshots bursts", 120.0, doors.never_read), {}),
        (doors.every, ("console pages", 2.0, doors.page), {}),
        (doors.every, ("console wrong logins", 60.0, doors.bad_login), {}),
        (doors.watch, ("WatchMoves",), {"engine": "e0"}),
        (doors.watch, ("WatchMoves",), {"engine": "e1"}),
        (doors.watch, ("WatchSnapshots compact",), {"compact": True}),
        (doors.watch, ("WatchSnapshots compact",), {"compact": True}),
        (doors.watch, ("WatchSnapshots whole",), {}),
    ]
    threads = [threading.Thread(target=f, args=a, kwargs=kw, daemon=True) for f, a, kw in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.send((dict(doors.calls), dict(doors.errors), doors.first_error))


def run_soak(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    db = f"sqlite:///{folder}/soak.sqlite3"
    tokens = _seed(db)
    with serve(db, ["--min-samples", "10"], console=True) as server:
        time.sleep(3.0)
        before = server.rss()
        ctx = multiprocessing.get_context("spawn")
        stop, (mine, theirs) = ctx.Event(), ctx.Pipe()
        assert server.console_port is not None
        load = ctx.Process(
            target=_load,
            args=(server.target, server.console_port, tokens["soak"], args.rate, stop, theirs),
        )
        load.start()
        series = _rss_series(server, args.soak_minutes)
        gauges = scrape(server.metrics_port, (*GAUGES, "process_resident_memory_bytes"))
        stop.set()
        calls, errors, first = mine.recv()
        load.join(timeout=120)
    return {
        "minutes": args.soak_minutes,
        "rate": args.rate,
        "rss_before_mb": before,
        "rss_series_mb": series,  # (minutes since the load started, MB)
        "calls": calls,
        "errors": errors,
        "first_errors": first,
        "metrics_end": gauges,
    }


def _rss_series(server: Server, minutes: float) -> list[tuple[float, float]]:
    start = time.monotonic()
    series = []
    while (elapsed := time.monotonic() - start) < minutes * 60:
        series.append((round(elapsed / 60, 3), round(server.rss(), 1)))
        time.sleep(min(5.0, max(0.1, minutes * 60 - elapsed)))
    series.append((round((time.monotonic() - start) / 60, 3), round(server.rss(), 1)))
    return series


def _at(series: list[tuple[float, float]], minute: float) -> float:
    return min(series, key=lambda point: abs(point[0] - minute))[1]


def report_soak(r: dict[str, Any]) -> None:
    series = r["rss_series_mb"]
    reference = round(min(10.0, r["minutes"] / 3), 1)
    ref, end = _at(series, reference), series[-1][1]
    change = end / ref - 1.0
    print(f"soak: {r['minutes']:g} minutes, every door of the server (rate x{r['rate']:g})")
    print(
        f"server RSS: {r['rss_before_mb']:.0f} MB before the load, {_at(series, 1.0):.0f} MB "
        f"at minute 1, {ref:.0f} MB at minute {reference:g}, {end:.0f} MB at the end "
        f"(highest {max(v for _, v in series):.0f} MB)"
    )
    verdict = "ok" if abs(change) <= SOAK_BOUND else "OVER"
    print(
        f"  end vs minute {reference:g}: {100 * change:+.1f} % "
        f"(bound {100 * SOAK_BOUND:.0f} %: {verdict})"
    )
    minutes = range(int(series[-1][0]) + 1)
    print("  RSS by minute: " + ", ".join(f"{m}:{_at(series, m):.0f}" for m in minutes))
    for door in sorted(set(r["calls"]) | set(r["errors"])):
        errors = r["errors"].get(door, 0)
        print(f"  {door}: {r['calls'].get(door, 0):,} calls, {errors} errors")
        if errors:
            print(f"    first: {r['first_errors'][door]}")
    for name, value in r["metrics_end"].items():
        print(f"  at the end, {name}: {value:,.0f}")
