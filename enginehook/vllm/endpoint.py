"""The hook's own HTTP endpoint: ``GET /metrics`` (the Prometheus text of
:class:`~enginehook.vllm.metrics.HookMetrics`) and a router's or operator's pin commands
(:mod:`enginehook.vllm.pin_commands`) under :data:`PINS_PATH`, behind :class:`EndpointAccess`
(who may send a command: the pin-command token, loopback, TLS). :func:`serve_metrics` starts
it as uvicorn on one event-loop thread with a bound on connections and a deadline per
request (:class:`EndpointServer`)."""

from __future__ import annotations

import hmac
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
from enginehook.vllm.pin_commands import BUSY, PinCommands

__all__ = [
    "METRICS_MAX_CONNECTIONS",
    "METRICS_THREADS",
    "METRICS_TIMEOUT_S",
    "PINS_PATH",
    "EndpointAccess",
    "EndpointServer",
    "serve_metrics",
]


#: Connections the endpoint holds at most (a connection past that is closed at once and
#: counted in the server's ``refused``), and how long one request may take, from the
#: connection (or the previous answer on it) to its answer: a client that sends slowly is
#: cut off then, and never holds up another.
METRICS_MAX_CONNECTIONS = 256
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


class EndpointServer:
    """The endpoint's HTTP server (uvicorn on its own event-loop thread): ``port``,
    ``refused`` (connections closed at once past :data:`METRICS_MAX_CONNECTIONS`),
    ``timed_out`` (connections cut off at :data:`METRICS_TIMEOUT_S`), ``shutdown()`` and
    ``server_close()``."""

    def __init__(self, app: Any, sock: socket.socket, access: EndpointAccess, timeout_s: float):
        self.port = int(sock.getsockname()[1])
        self.refused = 0
        self.timed_out = 0
        protocol = type(
            "EndpointProtocol", (_DeadlineProtocol,), {"endpoint": self, "deadline_s": timeout_s}
        )
        config = uvicorn.Config(
            app,
            http=protocol,
            lifespan="off",
            access_log=False,
            log_config=None,
            log_level="warning",
            timeout_keep_alive=int(max(1, timeout_s)),
            timeout_graceful_shutdown=1,
            ssl_certfile=access.cert_file or None,
            ssl_keyfile=access.key_file or None,
            server_header=False,
        )
        if access.tls:
            config.load()  # reads the certificate and key now: bad files fail at start
        self._server = uvicorn.Server(config)
        self._sock = sock
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name="cachettl-metrics",
            daemon=True,
        )
        self._thread.start()

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(5.0)

    def server_close(self) -> None:
        self._sock.close()


class _DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a connection bound and a deadline per request."""

    endpoint: EndpointServer
    deadline_s: float

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > METRICS_MAX_CONNECTIONS:
            self.endpoint.refused += 1
            transport.abort()
            return
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_deadline", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        timer = getattr(self, "_deadline", None)
        if timer is not None:
            timer.cancel()
        self._deadline = self.loop.call_later(self.deadline_s, self._too_slow)

    def _too_slow(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            return  # answering: the answer is never cut
        if not self.transport.is_closing():
            self.endpoint.timed_out += 1
            self.transport.abort()


def serve_metrics(
    metrics: HookMetrics,
    listen: str,
    commands: PinCommands | None = None,
    token: str = "",
    clock: Callable[[], float] = time.time,
    access: EndpointAccess | None = None,
    timeout_s: float = METRICS_TIMEOUT_S,
) -> tuple[EndpointServer, int]:
    """Serve ``GET /metrics`` (Prometheus text) on ``listen`` ("host:port", port 0: any)
    from a daemon thread; returns the server and its port. With ``commands``, a router's
    pin commands too (:mod:`enginehook.vllm.pin_commands`): ``POST /cachettl/pins/{session}:drop``,
    ``POST /cachettl/pins/{session}:extend`` with ``{"ttl_seconds": N}``, answered with the
    command as JSON (202 ``accepted``, 400 or 429 ``rejected``, 501 ``unsupported``), and
    ``GET /cachettl/pins/commands/{id}`` for its outcome (``GET /cachettl/pins/commands``:
    the ids kept, oldest first). Commands and their outcomes are
    for whom ``access`` lets in (:class:`EndpointAccess`; ``token``: its pin-command token,
    for callers that give only that). The server is uvicorn on one event-loop thread: at
    most :data:`METRICS_MAX_CONNECTIONS` connections, each request answered or cut off
    within ``timeout_s``; a client that goes away early costs nothing (no traceback)."""
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
        server = EndpointServer(app, sock, access, timeout_s)
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
        raise ValueError(f"ttl_seconds must be a number, got {ttl!r}")
    return float(ttl)
