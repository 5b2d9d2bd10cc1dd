"""Serving the console beside a running gRPC server, in its process and event loop.

``Console(server, options)`` reads the server's ``ControlPlane`` and servicer (the token
cache, snapshots sent, the pin-coherence hub); ``start()`` binds uvicorn on the same event
loop and starts sampling η and T; ``stop()`` ends both. The console's door is bounded
(:mod:`controlplane.doors`: connections in all and per source address, header and
idle timeouts; a connection whose request carries a live session cookie is never shed) and
its ``accept()`` failures are logged once a minute with their count. uvicorn's own signal
handling is off: the control plane's ``serve`` owns SIGTERM and SIGINT and stops the
console with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from controlplane.console.app import HERE, make_app
from controlplane.console.sessions import COOKIE, SessionLimits, Sessions
from controlplane.console.views import Sources
from controlplane.console.watch import History
from controlplane.doors import (
    AcceptErrors,
    AccessLogBudget,
    Door,
    DoorLimits,
    DoorProtocol,
    PacedListener,
    door_limits,
)
from controlplane.rpc.server import ControlPlaneServer, ServerOptions, until_signalled

__all__ = ["Console", "ConsoleOptions", "serve_with_console"]

log = logging.getLogger(__name__)
#: Where scripts/setup puts the chart library (git ignores it).
VENDOR = HERE / "static" / "vendor"


@dataclass(frozen=True)
class ConsoleOptions:
    """Where the console listens, its admin token (None: no admin), how often η and
    T are sampled and how many samples each tenant keeps, its door's bounds (``None``:
    derived from the descriptor limit, :func:`console_door`) and its sessions' bounds and
    login rates."""

    listen: str = "127.0.0.1:8080"
    admin_token: str | None = None
    history_interval_s: float = 5.0
    history_keep: int = 720
    door: DoorLimits | None = None
    sessions: SessionLimits = field(default_factory=SessionLimits)

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"--console: expected HOST:PORT, got {self.listen!r}")
        return host.strip("[]") or "127.0.0.1", int(port)


#: The console's connections at most, whatever the descriptor limit (it takes 1/8 of it:
#: the gRPC server shares the process), and per source address 1/8 of that.
CONSOLE_MAX_CONNECTIONS = 1024
#: New connections the console accepts a second: people's browsers keep theirs alive, so
#: 64 is plenty for them, and a flood of new connections (failed logins from many
#: addresses, reconnecting idle clients) costs the event loop it shares with the gRPC
#: server a small share of its time.
CONSOLE_ACCEPTS_PER_S = 64.0
#: Lines of the console's access log a second at most (the rest are dropped and counted),
#: so that no client, with a token or without, can grow the log faster than about 70 kB a
#: minute.
ACCESS_LINES_PER_S = 10.0


def console_door(**overrides: Any) -> DoorLimits:
    """The console's door: 1/8 of ``RLIMIT_NOFILE`` up to :data:`CONSOLE_MAX_CONNECTIONS`
    (1024 at the usual 20,000), 1/8 of that per source (128), a request's headers within
    10 s, keep-alive connections closed after 5 s idle, 64 new connections accepted a
    second; ``overrides`` win."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return door_limits(CONSOLE_MAX_CONNECTIONS, **{"accepts_per_s": CONSOLE_ACCEPTS_PER_S, **given})


def _trusts(sessions: Sessions) -> Callable[[Any], bool]:
    """Whether a request's scope carries the cookie of a session held now."""
    name = COOKIE.encode() + b"="

    def trusts(scope: Any) -> bool:
        for key, value in scope.get("headers", ()):
            if key == b"cookie" and name in value:
                for part in value.split(b";"):
                    k, _, v = part.strip().partition(b"=")
                    if k == name[:-1] and sessions.known(v.decode("latin-1").strip('"')):
                        return True
        return False

    return trusts


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (the control plane's ``serve`` has them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Console:
    """The console of one running ``ControlPlaneServer`` (``start``/``stop``)."""

    def __init__(self, server: ControlPlaneServer, options: ConsoleOptions | None = None) -> None:
        self.options = options or ConsoleOptions()
        self.server = server
        self.port = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._uvicorn: _Server | None = None

    async def start(self) -> int:
        """Bind and serve (after the gRPC server started); returns the bound port."""
        if not (VENDOR / "uPlot.iife.min.js").is_file():
            raise ValueError(
                f"--console: the chart library is missing from {VENDOR}; reinstall the "
                "package (uPlot ships in it; scripts/update-uplot replaces it)"
            )
        servicer = self.server.servicer  # built by start(): the one the RPCs use
        src = Sources(self.server.plane, servicer, History(self.options.history_keep))
        self.sources = src
        sessions = Sessions(servicer.tenants, self.options.admin_token, self.options.sessions)
        self.sessions = sessions
        host, port = self.options.host_port()
        tls = self.server.options.tls
        self.app = make_app(src, sessions)
        limits = self.options.door or console_door()
        self.door = Door(limits, _trusts(sessions))
        protocol = type("ConsoleProtocol", (DoorProtocol,), {"door": self.door})
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            http=protocol,
            timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
            log_config=None,
            lifespan="off",
            ssl_certfile=str(tls.cert) if tls else None,
            ssl_keyfile=str(tls.key) if tls else None,
            server_header=False,
        )
        try:  # bound here, so that a taken address is one clear error
            sock = socket.create_server((host, port), family=_family(host))
        except OSError as error:
            raise ValueError(f"--console: cannot bind {self.options.listen!r}: {error}") from None
        sock = PacedListener.wrap(sock, limits.accepts_per_s)
        self.port = sock.getsockname()[1]
        self.accept_errors = AcceptErrors(log, "console", limits.log_interval_s)
        self.accept_errors.install(asyncio.get_running_loop())
        self.access_log = AccessLogBudget(ACCESS_LINES_PER_S, limits.log_interval_s)
        logging.getLogger("uvicorn.access").addFilter(self.access_log)
        self._uvicorn = _Server(config)
        self._tasks = [
            asyncio.create_task(self._uvicorn.serve(sockets=[sock])),
            asyncio.create_task(self._sample()),
        ]
        while not self._uvicorn.started and not self._tasks[0].done():
            await asyncio.sleep(0.01)
        return self.port

    async def _sample(self) -> None:
        """Every ``history_interval_s``: η, T and counts of every active tenant."""
        plane, history = self.server.plane, self.sources.history
        while True:
            try:
                tenants = await asyncio.to_thread(plane.store.list_tenants)
                now = time.time()
                for t in tenants:
                    if t.revoked_at is None:
                        v = plane.workload_stats(t.name)
                        history.add(
                            t.name,
                            now,
                            eta=v.eta,
                            queue_delay_s=v.queue_delay_s,
                            programs=v.programs_completed,
                            tool_calls=v.tool_calls,
                        )
            except Exception:  # the database may be down a while: sample again later
                log.exception("console: sampling η and T failed")
            await asyncio.sleep(self.options.history_interval_s)

    async def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        for task in self._tasks:
            if task is not self._tasks[0]:
                task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if getattr(self, "accept_errors", None) is not None:
            self.accept_errors.uninstall()
        if getattr(self, "access_log", None) is not None:
            logging.getLogger("uvicorn.access").removeFilter(self.access_log)


async def serve_with_console(
    plane: object, options: ServerOptions, console: ConsoleOptions
) -> None:
    """``controlplane.rpc.server.serve`` with the console beside the gRPC server."""

    from controlplane.service import ControlPlane

    assert isinstance(plane, ControlPlane)
    server = ControlPlaneServer(plane, options)
    port = await server.start()
    web = Console(server, console)
    try:
        web_port = await web.start()
    except BaseException:
        await server.stop()
        raise
    print(f"cachettl control plane on port {port} (policy {plane.policy_name})", flush=True)
    print(f"cachettl console on port {web_port}", flush=True)
    await until_signalled()
    await web.stop()
    await server.stop()
