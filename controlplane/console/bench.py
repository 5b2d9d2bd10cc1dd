"""``cachettl bench console``: page times and sizes of a tenant at its name caps.

Fills a store with one tenant holding ``tools`` tools and ``signatures`` signatures (half of
them under one tool, so that one tool's signature list is at its longest), starts the gRPC
server and the console in this process, logs in over HTTP like a browser, and loads each
page (and its JSON) ``repeat`` times, recording one new event of the tenant before each
load so that no load reuses the store reads of the one before. Prints the median and
slowest time and the size of each. :class:`Client` is a minimal cookie-keeping HTTP client
(the login form's protocol).
"""

from __future__ import annotations

import asyncio
import http.client
import re
import ssl
import statistics
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controlplane.learning import NameLimits
from controlplane.records import MissReason, PinOutcome, Tenant, ToolCall, TurnCache
from controlplane.service import ControlPlane
from controlplane.storage import create_store

__all__ = ["Client", "fill", "run"]

_OUTCOMES = (PinOutcome.HIT, PinOutcome.EXPIRED, PinOutcome.HIT, PinOutcome.NOT_PINNED)
_REASONS = (MissReason.HIT, MissReason.EXPIRED, MissReason.HIT, MissReason.NOT_PINNED)


class Client:
    """A cookie-keeping HTTP client of one console (HTTPS with ``tls``)."""

    def __init__(
        self, port: int, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
    ) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.cookies: dict[str, str] = {}

    def request(
        self, method: str, path: str, form: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """``(status, headers (lower-case names), body)``; keeps the cookies it is sent."""
        conn = (
            http.client.HTTPConnection(self.host, self.port, timeout=30)
            if self.tls is None
            else http.client.HTTPSConnection(self.host, self.port, timeout=30, context=self.tls)
        )
        headers = {"cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        body = None
        if form is not None:
            body = urllib.parse.urlencode(form)
            headers["content-type"] = "application/x-www-form-urlencoded"
        try:
            conn.request(method, path, body, headers)
            response = conn.getresponse()
            data = response.read()
            for name, value in response.getheaders():
                if name.lower() == "set-cookie":
                    key, _, rest = value.partition("=")
                    val = rest.split(";", 1)[0].strip('"')
                    if "max-age=0" in value.lower() or not val:
                        self.cookies.pop(key, None)
                    else:
                        self.cookies[key] = val
            names = {k.lower(): v for k, v in response.getheaders()}
            cookies = [v for k, v in response.getheaders() if k.lower() == "set-cookie"]
            names["set-cookie"] = "\n".join(cookies)  # one line per cookie
            return response.status, names, data
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, body = self.request("GET", path)
        return status, body

    def login(self, token: str) -> int:
        """Log in through the form; the status of the answer (303 when it worked)."""
        _, page = self.get("/login")
        found = re.search(rb'name="login" value="([^"]+)"', page)
        field = found.group(1).decode() if found else ""
        status, _, _ = self.request("POST", "/login", {"login": field, "token": token})
        return status


def fill(plane: ControlPlane, tenant: Tenant, tools: int, signatures: int) -> int:
    """Give ``tenant`` ``tools`` tools and ``signatures`` signatures (two calls each, half
    of the signatures under tool ``t0000``); returns the calls recorded."""
    per_tool = [0] * tools
    per_tool[0] = signatures // 2 if tools > 1 else signatures
    for i in range(signatures - per_tool[0]):
        per_tool[1 + i % (tools - 1)] += 1
    calls: list[ToolCall] = []
    now, n = time.time(), 0
    for t, count in enumerate(per_tool):
        for s in range(max(count, 1)):
            for k in range(2):
                n += 1
                calls.append(
                    ToolCall(
                        f"e{n}",
                        f"p{n % 997}",
                        f"t{t:04d}",
                        f'{{"command": "s{s:05d} -x"}}' if count else "",  # names one
                        0.05 * (1 + (n * 7919) % 400),
                        now - 3600 + n * 0.01,
                        k,
                        1.0,
                        _OUTCOMES[n % 4],
                        0.2,
                        TurnCache(_REASONS[n % 4], expired_by_s=0.5 if n % 4 == 1 else None),
                    )
                )
                if len(calls) == 1000:
                    plane.record_tool_calls(tenant, calls)
                    calls = []
    if calls:
        plane.record_tool_calls(tenant, calls)
    return n


def _start(plane: ControlPlane) -> tuple[Any, asyncio.AbstractEventLoop, Any, int]:
    from controlplane.console.host import Console, ConsoleOptions
    from controlplane.rpc.server import ControlPlaneServer, ServerOptions

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(60)

    server = ControlPlaneServer(plane, ServerOptions(listen="127.0.0.1:0"))
    run(server.start())
    console = Console(server, ConsoleOptions(listen="127.0.0.1:0"))
    port = run(console.start())
    return server, loop, console, port


def run(tools: int, signatures: int, repeat: int, db: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = db or f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
        store = create_store(url)
        plane = ControlPlane(store, name_limits=NameLimits(tools, signatures))
        tenant, token = plane.create_tenant("big")
        started = time.perf_counter()
        calls = fill(plane, tenant, tools, signatures)
        print(
            f"tenant 'big': {tools} tools, {signatures} signatures "
            f"({tools + signatures} models), {calls} calls, "
            f"filled in {time.perf_counter() - started:.1f} s ({url.split(':')[0]})"
        )
        server, loop, console, port = _start(plane)
        try:
            client = Client(port)
            if client.login(token) != 303:
                raise RuntimeError("bench: logging in failed")
            seq = iter(range(10**9))

            def touch() -> object:
                call = ToolCall(f"touch-{next(seq)}", "p-touch", f"t{tools - 1:04d}", "", 0.5)
                return plane.record_tool_calls(tenant, [call])

            _pages(client, repeat, tools, touch)
        finally:
            asyncio.run_coroutine_threadsafe(console.stop(), loop).result(30)
            asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            store.close()


def _pages(client: Client, repeat: int, tools: int, touch: Callable[[], object]) -> None:
    pages = [
        "/tools",
        "/tools?sort=calls",
        "/tools?q=t09&page=1",
        "/tools?page=10",
        "/tool?name=t0000",
        "/tool?name=t0000&q=s04&page=2",
        "/tool?name=t0000&sig=s00042",
        f"/tool?name=t{tools // 2:04d}",
        "/workload",
        "/engines",
    ]
    print(f"{'page':<34} {'median ms':>10} {'max ms':>8} {'KB':>7}   (x{repeat}, after 1 warm-up)")
    worst = 0.0
    for path in pages:
        for target in (path, "/api" + path):
            client.get(target)
            times, size = [], 0
            for _ in range(repeat):
                touch()  # a new event: the page's store reads are not reused
                t0 = time.perf_counter()
                status, body = client.get(target)
                times.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"bench: {target} answered {status}")
                size = len(body)
            worst = max(worst, max(times))
            print(
                f"{target:<34} {1000 * statistics.median(times):>10.1f} "
                f"{1000 * max(times):>8.1f} {size / 1024:>7.1f}"
            )
    print(f"slowest load of any page: {1000 * worst:.0f} ms")
