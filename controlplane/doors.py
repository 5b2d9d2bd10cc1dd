"""What an unauthenticated peer may hold of an HTTP door (uvicorn, HTTP/1.1 over h11).

A door bounds its connections: at most ``max_connections`` in all and ``max_per_source``
from one client address, both set well below the process's descriptor limit
(:func:`door_limits` derives them from ``RLIMIT_NOFILE``). A connection past either bound
takes the place of the oldest connection of that scope that is *shed-able*: one that has
presented no credential (:attr:`Door.trusts`), is not being answered (it is still sending
its request, or idle between requests) and has no whole request head waiting to be read.
With none such, the new connection is closed at once. So connections that never send a
request, send one slowly, or reconnect in a loop churn among themselves, while a client
that presents its credential keeps its connection and a new one always gets in.

Every connection has a deadline: its whole request must arrive within
``header_timeout_s`` of the connection (or of the previous answer), else it is cut off;
uvicorn closes keep-alive connections idle for ``idle_timeout_s``. An answer being
computed is never cut; one the client does not read is cut after two deadlines.

Accepting is paced (:class:`PacedListener`): at most ``accepts_per_s`` new connections a
second. Past that the door stops accepting for a second (asyncio's pause after a failed
``accept()``) and new connections wait in the kernel's listen backlog, so clients that
reconnect as fast as they are shed cost the event loop a bounded share of its time, not
all of it; connections already in, a logged-in viewer's keep-alive one among them, are
served meanwhile.

``accept()`` failures (the process out of descriptors: EMFILE, ENFILE, ENOBUFS, ENOMEM)
are logged once per ``log_interval_s`` with their count (:class:`AcceptErrors`, an
exception handler of the event loop), never a traceback per attempt; so are the pauses.

Both HTTP doors use it: the web console's (``controlplane.console``) and the engine
hook's endpoint (``enginehook.vllm.endpoint``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "AcceptErrors",
    "AcceptPausedError",
    "AccessLogBudget",
    "Door",
    "DoorLimits",
    "PacedListener",
    "door_limits",
    "nofile_limit",
]

#: ``accept()`` errors that mean the process (or system) is out of a resource.
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def nofile_limit() -> int:
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
    #: New connections accepted a second (a token bucket of as many); past it the door
    #: stops accepting for a second and new connections wait in the kernel's backlog.
    accepts_per_s: float = 256.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_per_source < 1:
            raise ValueError("connection caps must be >= 1")
        if not self.accepts_per_s >= 1:
            raise ValueError("accepts_per_s must be >= 1")
        if not (self.header_timeout_s > 0 and self.idle_timeout_s > 0 and self.log_interval_s > 0):
            raise ValueError("door timeouts must be > 0 seconds")


def door_limits(
    ceiling: int,
    share: int = 8,
    per_source_share: int = 8,
    nofile: int | None = None,
    **overrides: Any,
) -> DoorLimits:
    """Limits for a door that may hold ``1/share`` of the descriptor limit, at most
    ``ceiling`` connections (at least 16), ``1/per_source_share`` of them per source (at
    least 4); ``overrides`` (``DoorLimits`` fields, ``None`` ignored) win."""
    limit = nofile_limit() if nofile is None else nofile
    values: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    cap = values.setdefault("max_connections", max(16, min(ceiling, limit // share)))
    values.setdefault("max_per_source", max(4, cap // per_source_share))
    return DoorLimits(**values)


class AcceptPausedError(OSError):
    """A door's accept budget is spent: raised by :meth:`PacedListener.accept` with the
    errno (ENOBUFS) on which asyncio stops accepting for a second and then resumes."""

    def __init__(self) -> None:
        super().__init__(errno.ENOBUFS, "the door's accept budget is spent")


class PacedListener(socket.socket):
    """A listening socket whose ``accept()`` takes a token from a bucket of ``per_s``
    tokens refilled at ``per_s`` a second (build it with :meth:`wrap`). With none left it
    raises :class:`AcceptPausedError` once, on which asyncio stops accepting for a second,
    and ``BlockingIOError`` for the rest of that round of accepts. Closed during the pause,
    it shuts down at once and releases its descriptor when asyncio resumes on it.

    >>> listener = PacedListener.wrap(socket.create_server(("127.0.0.1", 0)), per_s=1.0)
    >>> client = socket.create_connection(listener.getsockname())
    >>> conn, _ = listener.accept()
    >>> second = socket.create_connection(listener.getsockname())
    >>> try:
    ...     listener.accept()
    ... except AcceptPausedError as pause:
    ...     print(pause.strerror)
    the door's accept budget is spent
    >>> listener.paused
    1
    >>> for s in (conn, client, second, listener):
    ...     s.close()
    """

    per_s: float
    paused: int
    _tokens: float
    _at: float
    _pausing: bool
    _closing: bool

    @classmethod
    def wrap(cls, sock: socket.socket, per_s: float) -> PacedListener:
        """``sock`` (bound, maybe listening) as a paced listener; ``sock`` is detached."""
        paced = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        paced.per_s, paced.paused = per_s, 0
        paced._tokens, paced._at = per_s, time.monotonic()
        paced._pausing = paced._closing = False
        return paced

    def accept(self) -> tuple[socket.socket, Any]:
        if self._closing:
            self._release()
            raise BlockingIOError(errno.EAGAIN, "the listener is closed")
        now = time.monotonic()
        self._tokens = min(self.per_s, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens < 1.0:
            if self._pausing:  # the rest of the round that paused: end it
                raise BlockingIOError(errno.EAGAIN, "accepting is paused")
            self._pausing = True
            self.paused += 1
            raise AcceptPausedError()
        self._pausing = False
        conn, addr = super().accept()
        self._tokens -= 1.0
        return conn, addr

    def close(self) -> None:
        if self._pausing and not self._closing and self.fileno() >= 0:
            # asyncio resumes accepting on this descriptor within a second: keep it until
            # then, shut down (it reads as ready, and the next accept() releases it)
            self._closing = True
            with contextlib.suppress(OSError):
                self.shutdown(socket.SHUT_RDWR)
            return
        super().close()

    def _release(self) -> None:
        self._closing = self._pausing = False
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_reader(self.fileno())
        super().close()


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


class AccessLogBudget(logging.Filter):
    """A filter that passes at most ``per_s`` records a second (a token bucket of as
    many) and drops the rest, saying once per ``interval_s`` how many it dropped: a door's
    access log then grows by a bounded amount whoever floods it.

    >>> budget = AccessLogBudget(per_s=2.0, interval_s=60.0)
    >>> record = logging.LogRecord("access", logging.INFO, "", 0, "GET /", None, None)
    >>> [budget.filter(record) for _ in range(4)]
    [True, True, False, False]
    >>> budget.dropped
    2
    """

    def __init__(self, per_s: float = 10.0, interval_s: float = 60.0) -> None:
        super().__init__()
        self.per_s, self.interval_s = per_s, interval_s
        self.dropped = 0
        self._tokens, self._at = per_s, time.monotonic()
        self._pending, self._said = 0, time.monotonic()

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        self._tokens = min(self.per_s, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            if self._pending and now - self._said >= self.interval_s:
                record.msg = f"{record.msg} ({self._pending} access lines dropped before it)"
                self._pending, self._said = 0, now
            return True
        self.dropped += 1
        self._pending += 1
        return False


class AcceptErrors:
    """An event loop's exception handler that counts ``accept()`` failures and the door's
    pauses (:class:`AcceptPausedError`) and logs each kind once per ``interval_s`` (the first at
    once); anything else goes to the handler it replaced (or the loop's default)."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 60.0) -> None:
        self.logger, self.what, self.interval_s = logger, what, interval_s
        self.count = 0
        #: Seconds-long pauses of accepting because the accept budget was spent.
        self.pauses = 0
        self._pauses_pending = 0
        self._pauses_last = -float("inf")
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
        if isinstance(exc, AcceptPausedError):
            self.paused(exc)
            return
        if isinstance(exc, OSError) and (exc.errno in ACCEPT_ERRNOS or "accept" in message):
            self.failed(exc)
            return
        if self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def paused(self, pause: AcceptPausedError) -> None:
        self.pauses += 1
        self._pauses_pending += 1
        now = time.monotonic()
        if now - self._pauses_last >= self.interval_s:
            self.logger.warning(
                "%s: accepting paused %d time(s) in the last %.0f s: more new connections "
                "than the door accepts a second; the rest wait in the listen backlog",
                self.what,
                self._pauses_pending,
                min(now - self._pauses_last, self.interval_s),
            )
            self._pauses_last, self._pauses_pending = now, 0

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
                nofile_limit(),
            )
            self._last, self._pending = now, 0
