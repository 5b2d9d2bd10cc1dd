"""What one tenant, or a client with no token, can throw at a control plane: the loads
``cachettl bench doors`` times another tenant's decisions beside. Each runs in processes of
its own (on this machine their threads would otherwise delay the timed client) until
``stop`` is set, adding what it did to ``done``.

- ``idle``: idle TCP connections to the console, reopened as fast as the door closes them;
- ``poll``: clients logged in as the attacking tenant loading every console page and its
  JSON in a loop;
- ``logins``: logins with random tokens from addresses spread over 127.0.0.2-201;
- ``ingest``: ``RecordToolCalls`` batches of 1,000 events with 4 KB arguments, two threads
  a process;
- ``arrivals``: ``ReportArrivals`` of 1,000 programs moving between engines, beside 50
  ``WatchMoves`` streams a process that are never read.
"""

from __future__ import annotations

import http.client
import resource
import secrets
import selectors
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTACKS", "SOURCES", "Target"]

#: Source addresses attackers spread over (Linux routes all of 127/8 to loopback).
SOURCES = [f"127.0.0.{i}" for i in range(2, 202)]

#: Every console page and its JSON (``/api`` + the path).
PAGES = ["/tools", "/tool?name=bash", "/workload", "/engines", "/shared"]


@dataclass(frozen=True)
class Target:
    """A server under attack: its gRPC address, its console's port, the attacker's token."""

    grpc: str
    console: int
    token: str


def _count(done: Any, n: int = 1) -> None:
    with done.get_lock():
        done.value += n


def idle(target: Target, stop: Any, done: Any, k: int, share: int, processes: int) -> None:
    """Hold ``share`` idle connections to the console, reopening closed ones; half send
    an unfinished request line, half nothing."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sources = SOURCES[k::processes]
    sel = selectors.DefaultSelector()
    n = 0

    def open_one() -> None:
        nonlocal n
        n += 1
        s = socket.socket()
        try:
            s.setblocking(False)
            s.bind((sources[n % len(sources)], 0))
            s.connect_ex(("127.0.0.1", target.console))
        except OSError:
            s.close()
            return
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, n % 2)
        _count(done)

    for _ in range(share):
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
        for _ in range(share - len(sel.get_map())):
            open_one()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


def poll(target: Target, stop: Any, done: Any, k: int, share: int, processes: int) -> None:
    """Load every console page and its JSON on one keep-alive connection, logged in as
    the attacking tenant."""
    from controlplane.console.bench import Client

    login = Client(target.console)
    if login.login(target.token) != 303:
        raise RuntimeError("the polling client could not log in")
    headers = {"cookie": "; ".join(f"{k}={v}" for k, v in login.cookies.items())}
    paths = PAGES + ["/api" + p for p in PAGES]
    conn = http.client.HTTPConnection("127.0.0.1", target.console, timeout=30)
    while not stop.is_set():
        for path in paths:
            try:
                conn.request("GET", path, headers=headers)
                conn.getresponse().read()
                _count(done)
            except (OSError, http.client.HTTPException):
                conn.close()  # reconnects on the next request


def logins(target: Target, stop: Any, done: Any, k: int, share: int, processes: int) -> None:
    """Log in with random tokens, each from the next source address, as fast as answered."""
    sources = SOURCES[k::processes]
    form = "x" * 32
    n = 0
    while not stop.is_set():
        n += 1
        body = urllib.parse.urlencode({"login": form, "token": secrets.token_urlsafe(32)})
        conn = http.client.HTTPConnection(
            "127.0.0.1", target.console, timeout=10, source_address=(sources[n % len(sources)], 0)
        )
        headers = {
            "cookie": f"cttl_login={form}",
            "content-type": "application/x-www-form-urlencoded",
        }
        with suppress(OSError, http.client.HTTPException):
            conn.request("POST", "/login", body, headers)
            conn.getresponse().read()
            _count(done)
        conn.close()


def _first(stream: Any) -> None:
    """Read a stream's first message, then never again (until it ends with the client)."""
    with suppress(Exception):
        next(stream, None)


def _threads(work: Callable[[int], None], count: int) -> None:
    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def ingest(target: Target, stop: Any, done: Any, k: int, share: int, processes: int) -> None:
    """Batches of 1,000 events with 4 KB arguments, from two threads."""
    from controlplane.records import ToolCall
    from controlplane.rpc.client import ControlPlaneClient

    args = "pytest " + "x" * 4000

    def work(t: int) -> None:
        with ControlPlaneClient(target.grpc, target.token, timeout_s=60) as client:
            b = 0
            while not stop.is_set():
                b += 1
                calls = [
                    ToolCall(f"a{k}-{t}-{b}-{i}", f"p{k}-{t}-{i % 50}", "bash", args, 0.5)
                    for i in range(1000)
                ]
                with suppress(Exception):
                    client.record_tool_calls(calls)
                    _count(done, len(calls))

    _threads(work, 2)


def arrivals(target: Target, stop: Any, done: Any, k: int, share: int, processes: int) -> None:
    """Reports of 1,000 programs moving between two engines, from two threads, beside 50
    ``WatchMoves`` streams that are never read."""
    from controlplane.rpc.client import ControlPlaneClient

    watchers = []
    for w in range(50):
        client = ControlPlaneClient(target.grpc, target.token)
        stream = client.watch_moves(f"engine-{k}-{w}")
        watchers.append((client, stream))
        threading.Thread(target=_first, args=(stream,), daemon=True).start()

    def work(t: int) -> None:
        with ControlPlaneClient(target.grpc, target.token, timeout_s=60) as client:
            n = 0
            while not stop.is_set():
                n += 1
                engine = f"engine-{k}-{n % 50}"
                now = time.time()
                batch = [(f"p{k}-{t}-{i}", now) for i in range(1000)]
                with suppress(Exception):
                    client.report_arrivals(engine, batch)
                    _count(done, len(batch))

    _threads(work, 2)
    for client, _ in watchers:
        client.close()


#: name -> (the attack's function, processes by default)
ATTACKS: dict[str, tuple[Callable[..., None], int]] = {
    "idle": (idle, 2),
    "poll": (poll, 4),
    "logins": (logins, 2),
    "ingest": (ingest, 2),
    "arrivals": (arrivals, 2),
}
