"""The hook's own HTTP endpoint: ``GET /metrics`` (the Prometheus text of
:class:`~enginehook.vllm.metrics.HookMetrics`) and a router's or operator's pin commands
(:mod:`enginehook.vllm.pin_commands`) under :data:`PINS_PATH`, behind :class:`EndpointAccess`
(who may send a command: the pin-command token, loopback, TLS). :func:`serve_metrics` starts
it as uvicorn on one event-loop thread (:class:`EndpointServer`) behind a bounded door.

The door (a copy of ``controlplane.console.doors``: the hook may not import the control
plane's console) bounds what a peer without the token may hold: at most
``max_connections`` connections and ``max_per_source`` per client address (from
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
import errno
import hmac
import logging
import os
import resource
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
from uvicorn.protocols.http.h11_impl import H11Protocol

from controlplane.kvhints import loads_bounded
from enginehook.core.tokens import is_loopback_host
from enginehook.vllm.metrics import HookMetrics
from enginehook.vllm.pin_commands import BUSY, PinCommands, clip

__all__ = [
    "ENV_PREFIX",
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

    limit = _nofile_limit() if nofile is None else nofile
    cap = read("MAX_CONNECTIONS", int) or max(16, min(METRICS_MAX_CONNECTIONS, limit // 8))
    per_source = read("MAX_CONNECTIONS_PER_SOURCE", int) or max(4, cap // 2)
    return DoorLimits(
        max_connections=cap,
        max_per_source=per_source,
        header_timeout_s=read("HEADER_TIMEOUT_S", float) or timeout_s,
        idle_timeout_s=read("IDLE_TIMEOUT_S", float) or timeout_s,
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
        self._sock = sock
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


# -- the door (a copy of controlplane.console.doors) ------------------------------------

#: ``accept()`` errors that mean the process (or system) is out of a resource.
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _nofile_limit() -> int:
    """The process's soft descriptor limit (``RLIMIT_NOFILE``; 1024 if unlimited/unknown)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1024
    return 1024 if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


@dataclass(frozen=True)
class DoorLimits:
    """A door's bounds (see the module's documentation)."""

    max_connections: int
    max_per_source: int
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 5.0
    log_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_per_source < 1:
            raise ValueError("connection caps must be >= 1")
        if not (self.header_timeout_s > 0 and self.idle_timeout_s > 0 and self.log_interval_s > 0):
            raise ValueError("door timeouts must be > 0 seconds")


class Door:
    """The connections of one listening socket and its counters: ``refused`` (closed at
    once, nothing to shed), ``shed`` (closed to let a newer one in), ``timed_out``."""

    def __init__(self, limits: DoorLimits, trusts: Callable[[Any], bool]) -> None:
        self.limits = limits
        #: Whether a request's ASGI scope carries the door's credential.
        self.trusts = trusts
        self._all: dict[DoorProtocol, None] = {}
        self._by_source: dict[str, dict[DoorProtocol, None]] = {}
        self.refused = self.shed = self.timed_out = 0

    def __len__(self) -> int:
        return len(self._all)

    def admit(self, conn: DoorProtocol) -> bool:
        """Take ``conn`` in (shedding another if a cap is reached); False: refused."""
        source = conn.source
        mine = self._by_source.get(source, {})
        for scope, cap in (
            (mine, self.limits.max_per_source),
            (self._all, self.limits.max_connections),
        ):
            if len(scope) >= cap:
                victim = next((c for c in scope if c.sheddable()), None)
                if victim is None:
                    self.refused += 1
                    return False
                self.shed += 1
                self.leave(victim)
                victim.transport.abort()
        self._all[conn] = None
        self._by_source.setdefault(source, {})[conn] = None
        return True

    def leave(self, conn: DoorProtocol) -> None:
        self._all.pop(conn, None)
        mine = self._by_source.get(conn.source)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._by_source[conn.source]


class DoorProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol under a :class:`Door` (a subclass sets ``door``)."""

    door: Door
    source = ""
    trusted = False
    _deadline: asyncio.TimerHandle | None = None
    _seen: object = None
    _late: object = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.source = self.client[0] if self.client else ""
        if not self.door.admit(self):
            self.connections.discard(self)
            transport.abort()
            return
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen:
            self._seen = cycle
            if not self.trusted and self.door.trusts(cycle.scope):
                self.trusted = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.door.leave(self)
        super().connection_lost(exc)

    def _computing(self) -> bool:
        """Whether the whole request is in and its answer is being computed."""
        c = self.cycle
        return c is not None and not c.more_body and not c.response_started

    def _answering(self) -> bool:
        c = self.cycle
        return c is not None and c.response_started and not c.response_complete

    def sheddable(self) -> bool:
        """Neither trusted, nor being answered, nor holding a whole request head not yet
        read (a client that just sent its request, accepted in the same round as many
        others: its bytes are read after every accept of the round)."""
        return not self.trusted and not self._computing() and not self._head_waiting()

    def _head_waiting(self) -> bool:
        sock = self.transport.get_extra_info("socket")
        if sock is None or self.transport.get_extra_info("sslcontext") is not None:
            return False  # over TLS the bytes waiting say nothing
        peek = socket.socket(fileno=sock.fileno())
        try:
            waiting = peek.recv(16384, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return False
        finally:
            peek.detach()
        return b"\r\n\r\n" in waiting

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.door.limits.header_timeout_s, self._too_slow)

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._computing():
            return  # the answer re-arms the deadline
        if self._answering() and self._late is not self.cycle:
            self._late = self.cycle  # one more deadline for the client to read it
            self._arm()
            return
        self.door.timed_out += 1
        self.door.leave(self)
        self.transport.abort()


class AcceptErrors:
    """An event loop's exception handler that counts ``accept()`` failures and logs them
    once per ``interval_s`` (the first at once); anything else goes to the handler it
    replaced (or the loop's default)."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 60.0) -> None:
        self.logger, self.what, self.interval_s = logger, what, interval_s
        self.count = 0
        self._pending = 0
        self._last = -float("inf")
        self._last_error = ""
        self._previous: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._previous = loop.get_exception_handler()
        loop.set_exception_handler(self._handle)

    def uninstall(self) -> None:
        if self._loop is not None and self._loop.get_exception_handler() == self._handle:
            self._loop.set_exception_handler(self._previous)

    def _handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message", ""))
        if isinstance(exc, OSError) and (exc.errno in ACCEPT_ERRNOS or "accept" in message):
            self.failed(exc)
            return
        if self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def failed(self, error: OSError) -> None:
        self.count += 1
        self._pending += 1
        self._last_error = f"[Errno {error.errno}] {error.strerror}"
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self.logger.warning(
                "%s: %d accept() failure(s) in the last %.0f s (last: %s); the process is "
                "at its descriptor limit (RLIMIT_NOFILE %d) or the system out of sockets; "
                "accepting resumes by itself",
                self.what,
                self._pending,
                min(now - self._last, self.interval_s),
                self._last_error,
                _nofile_limit(),
            )
            self._last, self._pending = now, 0
