"""``cachettl bench doors``: what one tenant, or a client with no token, can do through a
door to another tenant's decisions.

Starts two ``cachettl serve --console`` processes on fresh SQLite stores (the second is the
control: it takes the same attack, so that the machine carries the same load while the
first server is timed untouched) and measures, from this process, the timed tenant's paced
``DecideTtl`` latency, its own ingest (a batch of 10 events every 50 ms, as an engine's)
and its logged-in viewer's page loads (on a keep-alive connection, as a browser, and on a
new connection each time):

1. quiet: nothing else runs;
2. control: the attack (:mod:`controlplane.cli.attacks`, ``--attack``) against the
   *second* server;
3. attack: the same against the *first* server.

Printed per phase: ``DecideTtl`` p50/p99 (ms) and their ratios to quiet and control, the
viewer's pages answered, what the attack did, the timed server's log growth (bytes a
minute), and the timed tenant's own ingest p99 with its ratio to quiet (and calls
refused). The doors' contract: attack p99 within 2× quiet, or within 1.3× the control's
where the attack's processes load this machine; the viewer's pages answered; log growth
under 1 MB a minute.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.cli.attacks import ATTACKS, Target

__all__ = ["register"]


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench doors``."""
    p = bench.add_parser(
        "doors", help="another tenant's DecideTtl and console beside one tenant's flood"
    )
    p.add_argument("--attack", choices=sorted(ATTACKS), default="idle", help="the flood")
    p.add_argument("--connections", type=int, default=20_000, help="idle: connections held")
    p.add_argument("--attackers", type=int, default=None, help="processes (default per attack)")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    p.add_argument("--rate", type=float, default=200.0, help="DecideTtl calls a second")
    p.set_defaults(handler=_run)


@dataclass
class _Server:
    grpc: str
    console: int
    log: Path
    token: str
    attacker: str  # the other tenant's token


@contextmanager
def _server(workdir: Path, name: str) -> Iterator[_Server]:
    from controlplane.cli.benchload import prepare

    db = f"sqlite:///{workdir / f'{name}.sqlite3'}"
    token, attacker = prepare(db, 2000)
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "controlplane", "serve", "--db", db, "--min-samples", "10"]
    cmd += ["--listen", "127.0.0.1:0", "--console", "127.0.0.1:0"]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        ports = []
        for _ in range(2):
            line = proc.stdout.readline()
            if "on port" not in line:
                raise RuntimeError(f"server did not start: {line!r}; see {log}")
            ports.append(int(line.split("on port")[1].split()[0]))
        yield _Server(f"127.0.0.1:{ports[0]}", ports[1], log, token, attacker)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class _Attack:
    """The attack ``name`` against ``target`` from ``processes`` processes (idle: holding
    ``connections`` connections in all), from ready to the end of the ``with``."""

    def __init__(self, name: str, target: Target, processes: int, connections: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.done = ctx.Value("q", 0)
        work, _ = ATTACKS[name]
        share = -(-connections // processes)
        self.procs = [
            ctx.Process(
                target=work, args=(target, self.stop, self.done, k, share, processes), daemon=True
            )
            for k in range(processes)
        ]
        self.ready_at = share * processes if name == "idle" else 1

    def __enter__(self) -> _Attack:
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + 120
        while self.done.value < self.ready_at and time.monotonic() < deadline:
            if not any(p.is_alive() for p in self.procs):
                raise RuntimeError("the attack's processes ended before it began")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


class _Viewer:
    """A logged-in viewer as a browser: one keep-alive connection, opened at login."""

    def __init__(self, port: int, token: str) -> None:
        from controlplane.console.bench import Client

        login = Client(port)
        if login.login(token) != 303:
            raise RuntimeError("the viewer could not log in")
        self.port = port
        self.cookie = "; ".join(f"{k}={v}" for k, v in login.cookies.items())
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.page()

    def page(self, fresh: bool = False) -> int:
        """One page's status (0: no answer); ``fresh``: on a new connection of its own."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        if not fresh:
            conn = self.conn
        for _ in range(1 if fresh else 2):  # keep-alive: once more if the server closed it
            try:
                conn.request("GET", "/tools", headers={"cookie": self.cookie})
                response = conn.getresponse()
                response.read()
                return response.status
            except (OSError, http.client.HTTPException):
                conn.close()
            finally:
                if fresh:
                    conn.close()
        return 0

    def run(self, stop: threading.Event, out: list[int], fresh: bool) -> None:
        """A page every half second (``fresh``: each on a new connection) until ``stop``."""
        while not stop.is_set():
            out.append(self.page(fresh))
            stop.wait(0.5)


def _ingest(server: _Server, stop: threading.Event, out: list[float]) -> None:
    """The timed tenant's own ingest, as an engine's: a batch of 10 events every 50 ms,
    each call's latency (inf: refused or failed)."""
    from controlplane.records import ToolCall
    from controlplane.rpc.client import ControlPlaneClient

    with ControlPlaneClient(server.grpc, server.token, timeout_s=60) as client:
        b = 0
        while not stop.is_set():
            b += 1
            calls = [
                ToolCall(f"v{time.time_ns()}-{b}-{i}", f"v{i}", "bash", "ls -l", 0.3)
                for i in range(10)
            ]
            start = time.perf_counter()
            try:
                client.record_tool_calls(calls)
                out.append(time.perf_counter() - start)
            except Exception:
                out.append(float("inf"))
            stop.wait(0.05)


def _phase(server: _Server, viewer: _Viewer, rate: float, seconds: float) -> tuple[Any, ...]:
    """Paced DecideTtl latencies, the viewer's statuses (kept and fresh connections), the
    log's growth in bytes and the timed tenant's ingest latencies."""
    from controlplane.cli.benchload import paced_latency

    size = server.log.stat().st_size
    stop, kept, fresh, ingest = threading.Event(), list[int](), list[int](), list[float]()
    threads = [
        threading.Thread(target=viewer.run, args=(stop, out, new))
        for out, new in ((kept, False), (fresh, True))
    ]
    threads.append(threading.Thread(target=_ingest, args=(server, stop, ingest)))
    for thread in threads:
        thread.start()
    try:
        latencies = paced_latency(server.grpc, server.token, rate, seconds)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    return latencies, kept, fresh, server.log.stat().st_size - size, ingest


def _run(args: argparse.Namespace) -> int:
    if args.connections < 1 or args.seconds <= 0 or args.rate <= 0:
        raise ValueError("--connections, --seconds and --rate must be positive")
    processes = ATTACKS[args.attack][1] if args.attackers is None else args.attackers
    if processes < 1:
        raise ValueError(f"--attackers must be >= 1, got {processes}")
    print(f"RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        timed = stack.enter_context(_server(Path(tmp), "timed"))
        control = stack.enter_context(_server(Path(tmp), "control"))
        viewer = _Viewer(timed.console, timed.token)
        rows.append(("quiet", *_phase(timed, viewer, args.rate, args.seconds), 0, 0))
        for name, server in (("control", control), ("attack", timed)):
            target = Target(server.grpc, server.console, server.attacker)
            with _Attack(args.attack, target, processes, args.connections) as attack:
                ready = attack.done.value
                phase = _phase(timed, viewer, args.rate, args.seconds)
                rows.append((name, *phase, ready, attack.done.value))
        log = timed.log.read_text()
    what = f"{args.connections} idle connections" if args.attack == "idle" else args.attack
    print(
        f"attack: {what} from {processes} processes, {args.seconds:g} s a phase, "
        f"DecideTtl at {args.rate:g}/s"
    )
    _table(rows, args.seconds)
    warnings = [line for line in log.splitlines() if "WARNING" in line or "Traceback" in line]
    print(f"timed server's log: {len(warnings)} warning or traceback line(s)")
    for line in warnings[:5]:
        print(f"  {line[:200]}")
    return 0


def _table(rows: list[tuple[Any, ...]], seconds: float) -> None:
    quiet_p99 = float(np.percentile(rows[0][1], 99)) * 1e3
    control_p99 = float(np.percentile(rows[1][1], 99)) * 1e3
    quiet_ingest = float(np.percentile(rows[0][5], 99)) * 1e3
    print(
        "phase    p50 ms  p99 ms  p99/quiet  p99/control  pages: kept  new conn  "
        "attack done (ready+during)  log B/min  own ingest: p99 ms  p99/quiet  refused"
    )
    for name, lat, kept, fresh, grew, ingest, ready, total in rows:
        p50, p99 = (float(np.percentile(lat, q)) * 1e3 for q in (50, 99))
        kept_ok, fresh_ok = (sum(1 for s in got if s == 200) for got in (kept, fresh))
        answered = [t for t in ingest if t != float("inf")]
        ingest_p99 = float(np.percentile(answered, 99)) * 1e3 if answered else float("nan")
        print(
            f"{name:<8} {p50:6.2f}  {p99:6.2f}  {p99 / quiet_p99:9.2f}  {p99 / control_p99:11.2f}  "
            f"{kept_ok:>5}/{len(kept):<5} {fresh_ok:>4}/{len(fresh):<4} "
            f"{ready:>9}+{total - ready:<16} {grew * 60.0 / seconds:>9.0f}  "
            f"{ingest_p99:>17.1f}  {ingest_p99 / quiet_ingest:9.2f}  "
            f"{len(ingest) - len(answered):>7}"
        )
