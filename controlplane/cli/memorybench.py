"""``cachettl bench memory``: what never-read snapshot streams cost the server, and whether
its memory levels off with every door in use (``--soak-minutes``, :mod:`.soakbench`).

Each phase runs its own ``cachettl serve`` process on a fresh SQLite file, and measures its
resident memory (``/proc/PID/status``) from this process.

Streams (``--streams N``, default 1,000): tenant ``watch`` holds ``--tools`` tools of
``--samples`` durations each, so that its whole snapshot of raw windows is about 2 MB. One
client reads a snapshot (the server builds it), then a client process opens N
``WatchSnapshots`` streams and never reads them: a real gRPC client whose HTTP/2 window
stays at its initial 64 KB (``grpc.http2.bdp_probe`` off), so the server cannot hand the
snapshot over and gRPC keeps whatever it was given. The streams stay open ``--hold``
seconds (past the server's slow-reader timeout, 30 s, so the server ends them itself),
while tenant ``other`` opens a reading stream and times its first snapshot; then the
client leaves. Printed: RSS before, at its peak and after, MB per stream, the server's
``/metrics`` gauges of snapshot streams and the bytes they hold, and the bounds (peak
under +100 MB; after within 20 % of before).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from controlplane.cli.benchserver import Server, never_read, scrape, serve

__all__ = ["register"]

#: The stated bounds: never-read streams cost less than this while open, and RSS comes
#: back within this share of its start once they end.
OPEN_BOUND_MB = 100.0
RETURN_BOUND = 0.20


def register(bench: Any) -> None:
    p = bench.add_parser(
        "memory",
        help="server memory: never-read WatchSnapshots streams, then a soak of every door",
    )
    p.add_argument("--streams", type=int, default=1000, help="never-read streams (0: skip)")
    p.add_argument("--hold", type=float, default=40.0, help="seconds they stay open (40)")
    p.add_argument("--tools", type=int, default=512, help="tools of the watched tenant (512)")
    p.add_argument("--samples", type=int, default=520, help="durations per tool (520)")
    p.add_argument(
        "--soak-minutes",
        type=float,
        default=30.0,
        help="length of the soak with the console on (30; 0: skip)",
    )
    p.add_argument("--rate", type=float, default=1.0, help="soak load, 1 = the stated rates")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.set_defaults(handler=_run)


def seed(db: str, tools: int, samples: int) -> dict[str, str]:
    """Tenants ``watch`` (``tools`` × ``samples`` durations) and ``other`` (a few): tokens."""
    import numpy as np

    from controlplane.records import ToolCall
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    store = create_store(db)
    plane = ControlPlane(store)
    tokens = {}
    rng = np.random.default_rng(0)
    for name, n_tools, n in (("watch", tools, samples), ("other", 4, 200)):
        tenant, tokens[name] = plane.create_tenant(name)
        batch: list[ToolCall] = []
        for t in range(n_tools):
            durations = rng.lognormal(0.0, 1.0, n)
            batch += (
                ToolCall(f"{name}{t}-{i}", f"p{t}", f"tool{t:04d}", "", float(d))
                for i, d in enumerate(durations)
            )
            if len(batch) >= 5000 or t == n_tools - 1:
                store.append_tool_calls(tenant, batch)
                batch = []
    store.close()
    return tokens


# -- never-read streams -------------------------------------------------------------------


def _first_snapshot(target: str, token: str, out: list[float]) -> None:
    """Seconds until a reading client's first snapshot (appended to ``out``)."""
    from controlplane.rpc.client import ControlPlaneClient

    start = time.perf_counter()
    with ControlPlaneClient(target, token, timeout_s=30) as client:
        for _ in client.watch_snapshots(timeout_s=60):
            out.append(time.perf_counter() - start)
            return


def _sample(server: Server, seconds: float, every: float = 0.5) -> list[float]:
    values = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        values.append(server.rss())
        time.sleep(every)
    return values


def run_streams(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    db = f"sqlite:///{folder}/streams.sqlite3"
    tokens = seed(db, args.tools, args.samples)
    n = args.streams
    flags = ["--max-streams-per-peer", str(n + 64), "--max-streams-per-tenant", str(n + 64)]
    flags += ["--max-streams", str(2 * n + 128)]
    with serve(db, flags) as server:
        waited: list[float] = []
        _first_snapshot(server.target, tokens["watch"], waited)  # built once, before
        time.sleep(3.0)
        before = server.rss()
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        flood = ctx.Process(target=never_read, args=(server.target, tokens["watch"], n, theirs))
        flood.start()
        mine.recv()
        other: list[float] = []
        reader = threading.Thread(
            target=_first_snapshot, args=(server.target, tokens["other"], other)
        )
        reader.start()
        held = _sample(server, min(5.0, args.hold))
        gauges = scrape(server.metrics_port)
        held += _sample(server, max(0.0, args.hold - 5.0))
        reader.join(timeout=60)
        mine.send("close")
        mine.recv()
        flood.join(timeout=60)
        after = _sample(server, 20.0)
        gauges_after = scrape(server.metrics_port)
    return {
        "streams": n,
        "snapshot_bytes": _snapshot_size(gauges),
        "rss_before_mb": before,
        "rss_peak_mb": max(held),
        "rss_end_of_hold_mb": held[-1],
        "rss_after_mb": after[-1],
        "other_tenant_first_snapshot_s": other[0] if other else None,
        "metrics_open": gauges,
        "metrics_after": gauges_after,
    }


def _snapshot_size(gauges: dict[str, float]) -> float:
    return gauges.get("cachettl_snapshot_payload_bytes", float("nan"))


def report_streams(r: dict[str, Any]) -> None:
    n, before, peak, after = r["streams"], r["rss_before_mb"], r["rss_peak_mb"], r["rss_after_mb"]
    grown = peak - before
    back = after / before - 1.0
    print(f"never-read WatchSnapshots streams: {n} (snapshots kept: {_mb(r['snapshot_bytes'])})")
    print(
        f"server RSS: {before:.0f} MB before, {peak:.0f} MB at peak (+{grown:.0f} MB, "
        f"{1024 * grown / max(n, 1):.1f} KB a stream; bound +{OPEN_BOUND_MB:.0f} MB: "
        f"{'ok' if grown < OPEN_BOUND_MB else 'OVER'}), {r['rss_end_of_hold_mb']:.0f} MB "
        f"at the end of the hold"
    )
    print(
        f"  20 s after they ended: {after:.0f} MB ({100 * back:+.1f} % of before; bound "
        f"{100 * RETURN_BOUND:.0f} %: {'ok' if back <= RETURN_BOUND else 'OVER'})"
    )
    first = r["other_tenant_first_snapshot_s"]
    print(f"  another tenant's first snapshot meanwhile: {_seconds(first)}")
    for name, value in r["metrics_open"].items():
        print(f"  while open, {name}: {value:,.0f}   after: {r['metrics_after'][name]:,.0f}")


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f} MB"


def _seconds(value: float | None) -> str:
    return "none within 60 s" if value is None else f"{value:.2f} s"


def _run(args: argparse.Namespace) -> int:
    if args.streams < 0 or args.hold <= 0 or args.soak_minutes < 0 or args.rate <= 0:
        raise ValueError("--streams and --soak-minutes must be >= 0, --hold and --rate > 0")
    figures: dict[str, Any] = {"command": " ".join(["cachettl", *sys.argv[1:]])}
    with tempfile.TemporaryDirectory() as folder:
        if args.streams:
            figures["streams"] = run_streams(args, folder)
            report_streams(figures["streams"])
        if args.soak_minutes:
            from controlplane.cli.soakbench import report_soak, run_soak

            figures["soak"] = run_soak(args, folder)
            report_soak(figures["soak"])
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0
