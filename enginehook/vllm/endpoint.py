"""The hook's own HTTP endpoint: ``GET /metrics`` (the Prometheus text of
:class:`~enginehook.vllm.metrics.HookMetrics`) and a router's or operator's pin commands
(:mod:`enginehook.vllm.pin_commands`) under :data:`PINS_PATH`, behind :class:`EndpointAccess`
(who may send a command: the pin-command token, loopback, TLS). :func:`serve_metrics` starts
it as uvicorn on one event-loop thread (:class:`EndpointServer`) behind a bounded door.

The door (:mod:`controlplane.doors`, the web console's too) bounds what a peer without
the token may hold: at most ``max_connections`` connections and ``max_per_source`` per
client address (from
``RLIMIT_NOFILE``: 1/8 of it up to :data:`METRICS_MAX_CONNECTIONS`, half of that per
source; environment overrides in :func:`endpoint_limits`), each request whole within its
deadline of the connection or the previous answer. When a cap is reached a new connection
*sheds the oldest connection that presented no pin-command token, is not being answered
and has no whole request head waiting to be read* (an idle or slow one) rather than being
refused: a connection that sent the token is never shed, and a well-behaved client's new
connection always gets in, however many slow clients reconnect; only when every slot is
trusted or busy answering is the new one closed at once. (Reserving slots for token
holders was the other choice; it would leave untokened ``/metrics`` scrapers to the slow
clients, and a router's first request on a new connection has not yet shown its token when
the connection is accepted.) ``accept()`` failures are logged once a minute with their
count, never a traceback each."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from controlplane.doors import (
    AcceptErrors,
    Door,
    DoorLimits,
    DoorProtocol,
    PacedListener,
    nofile_limit,
)
from controlplane.kvhints import loads_bounded
from enginehook.core.tokens import is_loopback_host
from enginehook.vllm.metrics import HookMetrics
from enginehook.vllm.pin_commands import BUSY, PinCommands, clip

__all__ = [
    "ENV_PREFIX",
    "METRICS_ACCEPTS_PER_S",
    "METRICS_MAX_CONNECTIONS",
    "METRICS_THREADS",
    "METRICS_TIMEOUT_S",
    "PINS_PATH",
    "DoorLimits",
    "EndpointAccess",
    "EndpointServer",
    "endpoint_limits",
    "serve_metrics",
]

log = logging.getLogger(__name__)


#: Connections the endpoint holds at most, whatever the descriptor limit (see the module's
#: documentation for what happens past it), and how long a request may take to arrive,
#: from the connection (or the previous answer on it): a client that sends slowly is cut
#: off then, and never holds up another.
METRICS_MAX_CONNECTIONS = 256
#: New connections the endpoint accepts a second (a router without keep-alive opens one per
#: scrape and pin command); past it they wait in the listen backlog.
METRICS_ACCEPTS_PER_S = 1024.0
#: Environment variables that override the door's bounds: ``{ENV_PREFIX}MAX_CONNECTIONS``,
#: ``…MAX_CONNECTIONS_PER_SOURCE``, ``…HEADER_TIMEOUT_S``, ``…IDLE_TIMEOUT_S``.
ENV_PREFIX = "CACHETTL_ENDPOINT_"
METRICS_TIMEOUT_S = 5.0
#: Kept for callers of the earlier thread-pooled server: the endpoint now runs on one
#: event-loop thread.
METRICS_THREADS = 1


#: The pin commands' path prefix: ``POST {PINS_PATH}{session}:drop`` or ``:extend``,
#: ``GET {PINS_PATH}commands/{id}``.
PINS_PATH = "/cachettl/pins/"
#: The largest command body read (``{"ttl_seconds": 30}``).
COMMAND_MAX_BYTES = 1024
#: HTTP status of each immediate answer.
_STATUS = {"accepted": 202, "rejected": 400, "unsupported": 501}


@dataclass(frozen=True)
class EndpointAccess:
    """Who may send pin commands and read their outcomes.

    ``token``: the pin-command credential (``pin_command_token``), scoped to pin commands
    (empty: commands only from loopback peers, without a token). ``cert_file`` /
    ``key_file``: serve the endpoint over TLS. ``allow_plaintext``: take a token over
    plain HTTP from a peer that is not on loopback (off: refused with 403, as the hook
    refuses to send its control-plane token in clear)."""

    token: str = field(default="", repr=False)
    cert_file: str = ""
    key_file: str = ""
    allow_plaintext: bool = False

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)

    def refusal(self, peer: str, scheme: str, authorization: str) -> str | None:
        """Why a command from ``peer`` is refused (``None``: it is not)."""
        loopback = is_loopback_host(peer)
        if authorization and scheme != "https" and not loopback and not self.allow_plaintext:
            return (
                f"a token over plain HTTP from {peer} is refused: serve the endpoint with "
                "TLS (endpoint_tls_cert_file, endpoint_tls_key_file) or set "
                "allow_plaintext_pin_commands"
            )
        if self.token:
            expected = f"Bearer {self.token}".encode()
            if hmac.compare_digest(authorization.encode("latin-1", "replace"), expected):
                return None
            return "pin commands need the hook's pin-command token (pin_command_token)"
        if loopback:
            return None
        return "this hook has no pin_command_token: pin commands only from loopback"

    def trusts(self, scope: Any) -> bool:
        """Whether a request (its ASGI scope) carries the pin-command token: its
        connection is then never shed to let another in."""
        if not self.token:
            return False
        expected = f"Bearer {self.token}".encode()
        return any(
            k == b"authorization" and hmac.compare_digest(v, expected)
            for k, v in scope.get("headers", ())
        )


def endpoint_limits(
    timeout_s: float = METRICS_TIMEOUT_S, nofile: int | None = None, env: Any = None
) -> DoorLimits:
    """The endpoint's door: 1/8 of ``RLIMIT_NOFILE`` (``nofile``) up to
    :data:`METRICS_MAX_CONNECTIONS`, half of that per source address, ``timeout_s`` for a
    request to arrive and for a keep-alive connection to sit idle; the environment
    (``env``, default ``os.environ``) overrides each (:data:`ENV_PREFIX`)."""
    env = os.environ if env is None else env

    def read(name: str, kind: type) -> Any:
        raw = env.get(ENV_PREFIX + name)
        if raw in (None, ""):
            return None
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}{name}: expected a number, got {raw[:40]!r}") from None
        if not value > 0:
            raise ValueError(f"{ENV_PREFIX}{name}: must be > 0, got {raw[:40]!r}")
        return value

    limit = nofile_limit() if nofile is None else nofile
    cap = read("MAX_CONNECTIONS", int) or max(16, min(METRICS_MAX_CONNECTIONS, limit // 8))
    per_source = read("MAX_CONNECTIONS_PER_SOURCE", int) or max(4, cap // 2)
    return DoorLimits(
        max_connections=cap,
        max_per_source=per_source,
        header_timeout_s=read("HEADER_TIMEOUT_S", float) or timeout_s,
        idle_timeout_s=read("IDLE_TIMEOUT_S", float) or timeout_s,
        accepts_per_s=read("ACCEPTS_PER_S", float) or METRICS_ACCEPTS_PER_S,
    )


class EndpointServer:
    """The endpoint's HTTP server (uvicorn on its own event-loop thread): ``port``,
    ``door`` (its connections), ``refused`` (connections closed at once: every slot
    trusted or busy), ``shed`` (connections closed to let a newer one in), ``timed_out``
    (connections cut off at their deadline), ``accept_errors``, ``shutdown()`` and
    ``server_close()``."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket,
        access: EndpointAccess,
        timeout_s: float,
        limits: DoorLimits | None = None,
    ):
        self.port = int(sock.getsockname()[1])
        self.limits = limits or endpoint_limits(timeout_s)
        self.door = Door(self.limits, access.trusts)
        self.accept_errors = AcceptErrors(log, "hook endpoint", self.limits.log_interval_s)
        protocol = type("EndpointProtocol", (DoorProtocol,), {"door": self.door})
        config = uvicorn.Config(
            app,
            http=protocol,
            lifespan="off",
            access_log=False,
            log_config=None,
            log_level="warning",
            timeout_keep_alive=int(max(1, self.limits.idle_timeout_s)),
            timeout_graceful_shutdown=1,
            ssl_certfile=access.cert_file or None,
            ssl_keyfile=access.key_file or None,
            server_header=False,
        )
        if access.tls:
            config.load()  # reads the certificate and key now: bad files fail at start
        self._server = uvicorn.Server(config)
        self._sock = PacedListener.wrap(sock, self.limits.accepts_per_s)
        self._thread = threading.Thread(target=self._run, name="cachettl-metrics", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        return self.door.refused

    @property
    def shed(self) -> int:
        return self.door.shed

    @property
    def timed_out(self) -> int:
        return self.door.timed_out

    def _run(self) -> None:
        """The server on a plain asyncio loop of this thread (uvloop, which uvicorn would
        pick, retries a failing ``accept()`` at once and reports each failure)."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.accept_errors.install(loop)
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        finally:
            loop.close()

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(5.0)

    def server_close(self) -> None:
        self._sock.close()


def serve_metrics(
    metrics: HookMetrics,
    listen: str,
    commands: PinCommands | None = None,
    token: str = "",
    clock: Callable[[], float] = time.time,
    access: EndpointAccess | None = None,
    timeout_s: float = METRICS_TIMEOUT_S,
    limits: DoorLimits | None = None,
) -> tuple[EndpointServer, int]:
    """Serve ``GET /metrics`` (Prometheus text) on ``listen`` ("host:port", port 0: any)
    from a daemon thread; returns the server and its port. With ``commands``, a router's
    pin commands too (:mod:`enginehook.vllm.pin_commands`): ``POST /cachettl/pins/{session}:drop``,
    ``POST /cachettl/pins/{session}:extend`` with ``{"ttl_seconds": N}``, answered with the
    command as JSON (202 ``accepted``, 400 or 429 ``rejected``, 501 ``unsupported``), and
    ``GET /cachettl/pins/commands/{id}`` for its outcome (``GET /cachettl/pins/commands``:
    the ids kept, oldest first). Commands and their outcomes are
    for whom ``access`` lets in (:class:`EndpointAccess`; ``token``: its pin-command token,
    for callers that give only that). The server is uvicorn on one event-loop thread behind
    a bounded door (``limits``, default :func:`endpoint_limits`: the module's
    documentation), each request whole within ``timeout_s`` or cut off; a client that
    goes away early costs nothing (no traceback)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(
            f"additional_config.cachettl.metrics_listen must be HOST:PORT, got {listen!r}"
        )
    access = access or EndpointAccess(token=token)
    app = _endpoint_app(metrics, commands, access, clock)
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise OSError(
            error.errno,
            f"additional_config.cachettl.metrics_listen: cannot listen on {listen!r}: "
            f"{error.strerror}",
        ) from None
    try:
        server = EndpointServer(app, sock, access, timeout_s, limits)
    except (OSError, ValueError) as error:
        sock.close()
        raise ValueError(
            "additional_config.cachettl.endpoint_tls_cert_file / endpoint_tls_key_file: "
            f"cannot load {access.cert_file!r} and {access.key_file!r}: {error}"
        ) from None
    return server, server.port


class _CommandRoutes:
    """The pin-command routes: 404 where pin commands are off, 403 for a peer or
    credential :class:`EndpointAccess` refuses."""

    def __init__(
        self, commands: PinCommands | None, access: EndpointAccess, clock: Callable[[], float]
    ) -> None:
        self.commands, self.access, self.clock = commands, access, clock

    def _gate(self, request: Request) -> tuple[PinCommands | None, Response | None]:
        if self.commands is None:
            return None, JSONResponse({"error": "not found"}, status_code=404)
        peer = request.client.host if request.client else ""
        auth = request.headers.get("authorization", "")
        why = self.access.refusal(peer, request.url.scheme, auth)
        denied = None if why is None else JSONResponse({"error": why}, status_code=403)
        return self.commands, denied

    async def submit(self, request: Request) -> Response:
        commands, denied = self._gate(request)
        if commands is None or denied is not None:
            return denied or JSONResponse({"error": "not found"}, status_code=404)
        session, colon, action = request.path_params["rest"].rpartition(":")
        if not colon:
            error = "expected /cachettl/pins/{session}:{drop|extend}"
            return JSONResponse({"error": error}, status_code=404)
        try:
            ttl = _ttl(await _bounded_body(request))
        except ValueError as error:
            return JSONResponse({"state": "rejected", "detail": str(error)}, status_code=400)
        answer = commands.submit(action, session, self.clock(), ttl)
        busy = answer.get("detail") == BUSY
        return JSONResponse(answer, status_code=429 if busy else _STATUS[answer["state"]])

    async def outcome(self, request: Request) -> Response:
        commands, denied = self._gate(request)
        if commands is None or denied is not None:
            return denied or JSONResponse({"error": "not found"}, status_code=404)
        answer = commands.get(request.path_params["command_id"])
        if answer is None:
            return JSONResponse({"error": "no such command (unknown or too old)"}, 404)
        return JSONResponse(answer)

    async def listing(self, request: Request) -> Response:
        commands, denied = self._gate(request)
        if commands is None or denied is not None:
            return denied or JSONResponse({"error": "not found"}, status_code=404)
        return JSONResponse({"commands": commands.ids()})


def _endpoint_app(
    metrics: HookMetrics,
    commands: PinCommands | None,
    access: EndpointAccess,
    clock: Callable[[], float],
) -> Starlette:
    """The endpoint's routes."""

    async def scrape(request: Request) -> Response:
        return PlainTextResponse(
            metrics.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def not_found(request: Request) -> Response:
        return JSONResponse({"error": "not found"}, status_code=404)

    pins = _CommandRoutes(commands, access, clock)
    return Starlette(
        routes=[
            Route("/metrics", scrape, methods=["GET"]),
            Route(PINS_PATH + "commands", pins.listing, methods=["GET"]),
            Route(PINS_PATH + "commands/{command_id}", pins.outcome, methods=["GET"]),
            Route(PINS_PATH + "{rest:path}", pins.submit, methods=["POST"]),
            Route("/{any:path}", not_found, methods=["GET", "POST", "PUT", "DELETE", "HEAD"]),
        ]
    )


async def _bounded_body(request: Request) -> bytes:
    declared = request.headers.get("content-length") or "0"
    if not declared.isdigit():
        raise ValueError(f"Content-Length must be a byte count, got {declared[:32]!r}")
    if int(declared) > COMMAND_MAX_BYTES:
        raise ValueError(f"body over {COMMAND_MAX_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > COMMAND_MAX_BYTES:
            raise ValueError(f"body over {COMMAND_MAX_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _ttl(raw: bytes) -> float | None:
    if not raw:
        return None
    body = loads_bounded(raw, "body", max_chars=COMMAND_MAX_BYTES)
    if not isinstance(body, dict) or set(body) - {"ttl_seconds"}:
        raise ValueError('body must be {"ttl_seconds": N} or empty')
    ttl = body.get("ttl_seconds")
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise ValueError(f"ttl_seconds must be a number, got {clip(repr(ttl))}")
    return float(ttl)
