"""``cachettl bench doors``: what clients without a token can do to the console's door.

Starts two ``cachettl serve --console`` processes on fresh SQLite stores (the second is the
control: it takes the same attack, so the machine carries the same load while the first
server is timed untouched) and measures, from this process, another tenant's paced
``DecideTtl`` latency and a logged-in viewer's page loads:

1. quiet: nothing else runs;
2. control: attackers hold ``--connections`` idle TCP connections to the *second* server's
   console (no request, or a request never finished);
3. attack: the same attackers against the *first* server's console.

The attackers are ``--attackers`` processes, each holding its share of the connections
from source addresses spread over 127.0.0.2-127.0.0.201 and opening a new one whenever the
server closes one (the worst a client without a token can do: the door sheds the oldest
connection that showed no credential, so held connections churn). Printed: each phase's
``DecideTtl`` p50/p99 (ms), the viewer's pages answered, the attackers' connections opened
and held, and the timed server's log growth (bytes a minute) under the attack. Targets
(the door's contract): attack p99 within 2× quiet, or within 1.3× the control's where the
attackers' processes load this machine; viewer pages ≥ 99 % answered; log growth < 1 MB a
minute.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["register"]

#: Source addresses the attackers spread over (Linux routes all of 127/8 to loopback).
SOURCES = [f"127.0.0.{i}" for i in range(2, 202)]


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench doors``."""
    p = bench.add_parser(
        "doors", help="another tenant's DecideTtl and a viewer while idle clients flood the console"
    )
    p.add_argument("--connections", type=int, default=20_000, help="idle connections held")
    p.add_argument("--attackers", type=int, default=2, help="processes holding them")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    p.add_argument("--rate", type=float, default=200.0, help="DecideTtl calls a second")
    p.set_defaults(handler=_run)


@dataclass
class _Server:
    grpc: str
    console: int
    log: Path
    token: str


@contextmanager
def _server(workdir: Path, name: str) -> Iterator[_Server]:
    from controlplane.cli.benchload import prepare

    db = f"sqlite:///{workdir / f'{name}.sqlite3'}"
    token, _ = prepare(db, 2000)
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
        yield _Server(f"127.0.0.1:{ports[0]}", ports[1], log, token)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _hold(port: int, count: int, sources: list[str], stop: Any, opened: Any) -> None:
    """Hold ``count`` idle connections to ``port`` until ``stop``, reopening closed ones;
    half send an unfinished request line, half nothing."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()
    n = 0

    def open_one() -> None:
        nonlocal n
        source = sources[n % len(sources)]
        n += 1
        try:
            s = socket.socket()
            s.setblocking(False)
            s.bind((source, 0))
            s.connect_ex(("127.0.0.1", port))
        except OSError:
            s.close()
            return
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, n % 2)
        with opened.get_lock():
            opened.value += 1

    for _ in range(count):
        open_one()
    while not stop.is_set():
        for key, events in sel.select(0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if events & selectors.EVENT_WRITE:
                if key.data:
                    with suppress(OSError):
                        s.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
                sel.modify(s, selectors.EVENT_READ)
                continue
            try:
                gone = s.recv(4096) == b""
            except OSError:
                gone = True
            if gone:
                sel.unregister(s)
                s.close()
        for _ in range(count - len(sel.get_map())):
            open_one()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


class _Attack:
    """``processes`` processes holding ``connections`` idle connections to ``port``."""

    def __init__(self, port: int, connections: int, processes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.opened = ctx.Value("q", 0)
        share = -(-connections // processes)
        self.procs = [
            ctx.Process(
                target=_hold,
                args=(port, share, SOURCES[k::processes], self.stop, self.opened),
                daemon=True,
            )
            for k in range(processes)
        ]
        self.target = share * processes

    def __enter__(self) -> _Attack:
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + 120
        while self.opened.value < self.target and time.monotonic() < deadline:
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(30)


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


def _phase(server: _Server, viewer: _Viewer, rate: float, seconds: float) -> tuple[Any, ...]:
    """Paced DecideTtl latencies, the viewer's statuses (kept and fresh connections) and
    the log's growth in bytes."""
    from controlplane.cli.benchload import paced_latency

    size = server.log.stat().st_size
    stop, kept, fresh = threading.Event(), [], []
    threads = [
        threading.Thread(target=viewer.run, args=(stop, out, new))
        for out, new in ((kept, False), (fresh, True))
    ]
    for thread in threads:
        thread.start()
    try:
        latencies = paced_latency(server.grpc, server.token, rate, seconds)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    return latencies, kept, fresh, server.log.stat().st_size - size


def _run(args: argparse.Namespace) -> int:
    if args.connections < 1 or args.attackers < 1 or args.seconds <= 0 or args.rate <= 0:
        raise ValueError("--connections, --attackers, --seconds and --rate must be positive")
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"RLIMIT_NOFILE {limit}; each server's console door is sized from it")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        timed = stack.enter_context(_server(Path(tmp), "timed"))
        control = stack.enter_context(_server(Path(tmp), "control"))
        viewer = _Viewer(timed.console, timed.token)
        rows.append(("quiet", *_phase(timed, viewer, args.rate, args.seconds), 0, 0))
        for name, port in (("control", control.console), ("attack", timed.console)):
            with _Attack(port, args.connections, args.attackers) as attack:
                opened = attack.opened.value
                phase = _phase(timed, viewer, args.rate, args.seconds)
                rows.append((name, *phase, opened, attack.opened.value))
        log = timed.log.read_text()
    quiet_p99 = float(np.percentile(rows[0][1], 99)) * 1e3
    control_p99 = float(np.percentile(rows[1][1], 99)) * 1e3
    print(
        f"{args.connections} idle connections from {args.attackers} processes, "
        f"{args.seconds:g} s a phase, DecideTtl at {args.rate:g}/s"
    )
    print(
        "phase    p50 ms  p99 ms  p99/quiet  p99/control  pages: kept  new conn  "
        "opened+reopened  log B/min"
    )
    for name, lat, kept, fresh, grew, ready, total in rows:
        p50, p99 = (float(np.percentile(lat, q)) * 1e3 for q in (50, 99))
        kept_ok, fresh_ok = (sum(1 for s in got if s == 200) for got in (kept, fresh))
        print(
            f"{name:<8} {p50:6.2f}  {p99:6.2f}  {p99 / quiet_p99:9.2f}  {p99 / control_p99:11.2f}  "
            f"{kept_ok:>5}/{len(kept):<5} {fresh_ok:>4}/{len(fresh):<4} "
            f"{ready:>7}+{total - ready:<7} {grew * 60.0 / args.seconds:>9.0f}"
        )
    warnings = [line for line in log.splitlines() if "WARNING" in line or "Traceback" in line]
    print(f"timed server's log: {len(warnings)} warning or traceback line(s)")
    for line in warnings[:5]:
        print(f"  {line[:200]}")
    print(f"pid {os.getpid()} done")
    return 0
