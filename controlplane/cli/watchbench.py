"""``cachettl bench slow-watchers``: one tenant's never-reading ``WatchMoves`` streams against
the server's memory and another tenant's decisions.

A ``cachettl serve`` process on a fresh SQLite file; tenant ``victim`` asks ``DecideTtl`` at a
fixed rate from a process of its own, first alone (quiet, after a 2 s warm-up), then while
tenant ``flood`` holds ``--streams`` WatchMoves streams it never reads and reports arrivals
that tell each of them moves, as fast as one client can. Printed: the server's resident
memory before and at its peak (sampled every 0.2 s), the moves told, coalesced and dropped
and the streams dropped (the server's own counters), and the victim's p50/p99 in both
phases with their ratio, all from one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["register"]

#: The stated bound: the server's resident memory grows by at most this much.
MEMORY_BOUND_MB = 256.0


def register(bench: Any) -> None:
    p = bench.add_parser(
        "slow-watchers",
        help="never-reading WatchMoves streams of one tenant: server memory, another "
        "tenant's DecideTtl p99",
    )
    p.add_argument("--streams", type=int, default=1024, help="never-reading streams (1024)")
    p.add_argument("--seconds", type=float, default=15.0, help="length of each phase (15)")
    p.add_argument("--rate", type=float, default=200.0, help="victim's decisions per second")
    p.add_argument(
        "--max-arrivals-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="the server's flag of that name (default: the server's own default)",
    )
    p.set_defaults(handler=_run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _victim(target: str, token: str, rate: float, seconds: float, out: Any) -> None:
    from controlplane.rpc.client import ControlPlaneClient

    latencies = []
    with ControlPlaneClient(target, token) as client:
        client.decide_ttl("bash")
        start = time.perf_counter()
        n = 0
        while (now := time.perf_counter()) - start < seconds:
            due = start + n / rate
            if due > now:
                time.sleep(due - now)
            t0 = time.perf_counter()
            client.decide_ttl("bash", "pytest -x")
            latencies.append(time.perf_counter() - t0)
            n += 1
    out.send(latencies)


def _decisions(target: str, token: str, rate: float, seconds: float) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_victim, args=(target, token, rate, seconds, theirs))
    proc.start()
    latencies: list[float] = mine.recv()
    proc.join()
    return latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _flood(
    target: str, token: str, streams: int, stop: threading.Event, refused: list[int]
) -> tuple[list[Any], int]:
    """Open ``streams`` never-read WatchMoves calls, then report moves to them until
    ``stop``; returns the calls (to cancel) and the moves the server said it found (reports
    refused for the tenant's arrival rate are counted in ``refused[0]``)."""
    import grpc

    from controlplane._gen.cachettl.v1 import cluster_pb2, cluster_pb2_grpc
    from controlplane.rpc.client import ControlPlaneClient
    from controlplane.wire import timestamp

    auth = (("authorization", f"Bearer {token}"),)
    channels = [grpc.insecure_channel(target) for _ in range(max(1, streams // 128))]
    calls = []
    for k in range(streams):
        watch = cluster_pb2_grpc.PinCoherenceServiceStub(  # type: ignore[no-untyped-call]
            channels[k % len(channels)]
        )
        calls.append(
            watch.WatchMoves(cluster_pb2.WatchMovesRequest(engine_id=f"w{k}"), metadata=auth)
        )
    calls.extend(channels)
    time.sleep(1.0)  # let them register
    moved = 0
    with ControlPlaneClient(target, token, timeout_s=30.0) as client:
        stub = client._cluster
        round_ = 0
        while not stop.is_set():
            for k in range(streams):
                if stop.is_set():
                    break
                at = timestamp(time.time())
                arrivals = [
                    cluster_pb2.Arrival(program_id=f"r{round_}-w{k}-p{i}", arrived_at=at)
                    for i in range(1000)
                ]
                for engine in (f"w{k}", "x"):
                    report = cluster_pb2.ReportArrivalsRequest(engine_id=engine, arrivals=arrivals)
                    try:
                        moved += stub.ReportArrivals(report, **client._kw()).moved
                    except grpc.RpcError as error:  # past the tenant's rate: refused whole
                        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
                        refused[0] += 1
            round_ += 1
    return calls, moved


def _counters(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    found = {}
    for name in (
        "cachettl_moves_told_total",
        "cachettl_moves_coalesced_total",
        "cachettl_moves_dropped_total",
        "cachettl_move_streams_dropped_total",
        "cachettl_moves_unread",
    ):
        match = re.search(rf"^{name} (\S+)$", text.decode(), re.M)
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def _serve(args: argparse.Namespace, db: str) -> tuple[subprocess.Popen[str], str, int]:
    """A control-plane server on ``db`` in a process of its own: the process, its gRPC
    target and its metrics port."""
    metrics_port = _free_port()
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", db]
    cmd += ["--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{metrics_port}"]
    cmd += ["--max-streams-per-peer", str(args.streams + 64)]
    cmd += ["--max-streams-per-tenant", str(max(1024, args.streams))]
    if args.max_arrivals_per_tenant is not None:
        cmd += ["--max-arrivals-per-tenant", str(args.max_arrivals_per_tenant)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "on port" not in line:
        proc.terminate()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, f"127.0.0.1:{int(line.split('on port')[1].split()[0])}", metrics_port


def _run(args: argparse.Namespace) -> int:
    from controlplane.service import ControlPlane
    from controlplane.storage import create_store

    if args.streams < 1 or args.seconds <= 0 or args.rate <= 0:
        raise ValueError("--streams must be >= 1, --seconds and --rate > 0")
    with tempfile.TemporaryDirectory() as folder:
        db = f"sqlite:///{folder}/cp.sqlite3"
        store = create_store(db)
        plane = ControlPlane(store)
        _, victim = plane.create_tenant("victim")
        _, flood = plane.create_tenant("flood")
        store.close()
        proc, target, metrics_port = _serve(args, db)
        try:
            _decisions(target, victim, args.rate, 2.0)  # warm-up, not counted
            quiet = _decisions(target, victim, args.rate, args.seconds)
            base = _rss_mb(proc.pid)
            stop, peak = threading.Event(), [base]
            result: list[Any] = []
            refused = [0]
            flooding = threading.Thread(
                target=lambda: result.append(_flood(target, flood, args.streams, stop, refused))
            )
            flooding.start()
            sampling = threading.Event()

            def sample() -> None:
                while not sampling.wait(0.2):
                    peak[0] = max(peak[0], _rss_mb(proc.pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            time.sleep(2.0)  # streams open, flood under way
            loud = _decisions(target, victim, args.rate, args.seconds)
            stop.set()
            flooding.join()
            sampling.set()
            counters = _counters(metrics_port)
            calls, moved = result[0]
            for call in calls:
                call.cancel() if hasattr(call, "cancel") else call.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    _report(args, quiet, loud, base, peak[0], moved, refused[0], counters)
    return 0


def _report(
    args: argparse.Namespace,
    quiet: list[float],
    loud: list[float],
    base: float,
    peak: float,
    moved: int,
    refused: int,
    counters: dict[str, float],
) -> None:
    q50, q99 = _pct(quiet, 0.5), _pct(quiet, 0.99)
    l50, l99 = _pct(loud, 0.5), _pct(loud, 0.99)
    grown = peak - base
    print(f"never-reading WatchMoves streams of tenant flood: {args.streams}")
    print(
        f"moves the flood's reports revealed: {moved:,}; reports refused for the tenant's "
        f"arrival rate: {refused:,}"
    )
    for name, value in counters.items():
        print(f"  {name}: {value:,.0f}")
    print(
        f"server RSS: {base:.0f} MB before the flood, {peak:.0f} MB at peak "
        f"(+{grown:.0f} MB; bound +{MEMORY_BOUND_MB:.0f} MB: "
        f"{'ok' if grown <= MEMORY_BOUND_MB else 'OVER'})"
    )
    print(
        f"tenant victim DecideTtl at {args.rate:g}/s: quiet p50 {q50:.2f} ms p99 {q99:.2f} ms "
        f"({len(quiet)} calls); during the flood p50 {l50:.2f} ms p99 {l99:.2f} ms "
        f"({len(loud)} calls); p99 ratio {l99 / q99:.2f} (target <= 2)"
    )
