"""Admission: who may call, and how much work each caller may have in flight.

Every RPC of the four ``cachettl.v1`` services is served by a request-*streaming*
handler (the wire is the same as unary), so the gate runs as soon as a call's headers
arrive, before its message: the bearer token is checked first (from memory, or one
bounded lookup, ``controlplane.rpc.auth``), and a call without a valid token is answered at
once, holding nothing. Only an authenticated call takes a slot, and its message must
then arrive within ``message_timeout_s``. Limits (``Budgets``; RESOURCE_EXHAUSTED
beyond each, naming the limit):

- per client address (``peer``, port ignored): calls and streams in flight;
- per tenant: unary calls in flight, and ``WatchSnapshots`` streams open (separately);
- in all: unary calls in flight, and streams open.

Health checks and reflection are not gated: they always answer.

Streams outlive their admission, so the gate keeps checking their tokens
(:meth:`Gate.revocable`): every ``recheck_s`` each token with a stream open is looked up
again (from the token cache, which refreshes from the store in the background), and every
stream of a token that was revoked, or replaced by ``cachettl tenants rotate``, ends
(PERMISSION_DENIED or UNAUTHENTICATED), whatever the stream is waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from controlplane.errors import (
    AuthenticationError,
    InvalidInputError,
    OverloadedError,
    RevokedError,
    SlowClientError,
    StorageError,
)
from controlplane.records import Tenant
from controlplane.rpc.auth import TenantCache

__all__ = ["Budgets", "Gate", "Slots", "peer_host", "until"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Budgets:
    """Concurrency limits (see the module doc and controlplane/README.md, "Limits")."""

    calls_total: int = 256
    calls_per_tenant: int = 64
    calls_per_peer: int = 128
    streams_total: int = 4096
    streams_per_tenant: int = 1024
    streams_per_peer: int = 1024
    message_timeout_s: float = 10.0
    #: Turn arrivals a tenant may report per second to one server (pin coherence), with a
    #: second's worth as burst; a report past it is refused whole (arrivals are hints: the
    #: pins of moves not told live until their TTL). Checking and applying an arrival
    #: costs tens of microseconds of Python, so this bounds what one tenant's reports take
    #: of the server's CPU from the others' decisions.
    arrivals_per_tenant_s: int = 10_000
    #: A stream whose client has taken none of its messages for this long while the server
    #: has one to send is ended RESOURCE_EXHAUSTED (a slow reader: gRPC's flow control holds
    #: only the few messages the connection's window admits, so until then each stream
    #: holds at most those: a snapshot, or moves).
    slow_reader_s: float = 30.0
    #: Bytes of snapshots a tenant's streams may have handed to gRPC and not yet written,
    #: and everyone's (``controlplane.rpc.sends``: gRPC keeps its own copy of each message
    #: until the client's window lets it out, so a never-reading client would otherwise
    #: hold a whole snapshot per stream). A tenant holding none may always send one.
    send_bytes_per_tenant: int = 16 << 20
    send_bytes_total: int = 128 << 20
    #: Threads that run the doors' blocking work (validation, storage, learning, arrivals,
    #: inspection, snapshot building), least-served tenant first
    #: (:mod:`controlplane.rpc.lanes`), and how long a call may wait for one before it is
    #: refused with a retry hint.
    lane_threads: int = 3
    lane_wait_s: float = 2.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"limit {name} must be > 0, got {value!r}")


class Slots:
    """In-flight counts per key under one limit (used from the event loop only)."""

    def __init__(self, limit: int, what: str, hint: str) -> None:
        self.limit = limit
        self.what = what
        self.hint = hint
        self.used: dict[str, int] = {}

    def take(self, key: str) -> None:
        n = self.used.get(key, 0)
        if n >= self.limit:
            raise OverloadedError(f"{self.what}: {n} in flight (limit {self.limit}, {self.hint})")
        self.used[key] = n + 1

    def give(self, key: str) -> None:
        n = self.used.get(key, 0) - 1
        if n > 0:
            self.used[key] = n
        else:
            self.used.pop(key, None)


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.1:5123`` → ``ipv4:10.0.0.1``; ``ipv6:[::1]:5123`` → ``ipv6:[::1]``."""
    if peer.startswith(("ipv4:", "ipv6:")):
        host, sep, port = peer.rpartition(":")
        if sep and port.isdigit():
            return host
    return peer


def bearer_token(context: grpc.aio.ServicerContext) -> str:
    """The token of the one ``authorization: Bearer TOKEN`` header; raises otherwise."""
    values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
    if not values:
        raise AuthenticationError(
            "authorization: missing bearer token (metadata 'authorization: Bearer TOKEN')"
        )
    if len(values) > 1:
        raise AuthenticationError(f"authorization: {len(values)} headers given, send one")
    value = values[0]
    scheme, _, token = value.partition(" ") if isinstance(value, str) else ("", "", "")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("authorization: expected 'Bearer TOKEN'")
    return token.strip()


class Rate:
    """A token bucket per key: ``rate`` per second, a second's worth of burst (used from
    the event loop only).

    >>> rate = Rate(100, clock=lambda: 0.0)
    >>> rate.take("acme", 80), rate.take("acme", 30), rate.take("other", 30)
    (True, False, True)
    """

    def __init__(self, rate: float, clock: Any = None) -> None:
        import time

        self.rate = rate
        self._clock = clock or time.monotonic
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str, n: int) -> bool:
        """Take ``n`` tokens of ``key``'s bucket; False (nothing taken) if it has fewer."""
        now = self._clock()
        tokens, at = self._buckets.get(key, (self.rate, now))
        tokens = min(self.rate, tokens + (now - at) * self.rate)
        if tokens < n:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - n, now)
        return True


class Gate:
    """Authentication and the limits of ``Budgets`` for one server."""

    def __init__(self, budgets: Budgets, tenants: TenantCache, recheck_s: float = 0.5) -> None:
        b = self.budgets = budgets
        self.tenants = tenants
        self.recheck_s = recheck_s
        self._open: dict[str, set[asyncio.Future[Exception]]] = {}
        self._rechecking: asyncio.Task[None] | None = None
        #: Streams ended because their token was revoked or replaced.
        self.streams_revoked = 0
        self._peer_calls = Slots(b.calls_per_peer, "calls from this address", "per peer")
        self._tenant_calls = Slots(b.calls_per_tenant, "calls of this tenant", "per tenant")
        self._calls = Slots(b.calls_total, "calls", "server-wide")
        self._peer_streams = Slots(b.streams_per_peer, "streams from this address", "per peer")
        self._tenant_streams = Slots(
            b.streams_per_tenant, "WatchSnapshots streams of this tenant", "per tenant"
        )
        self._streams = Slots(b.streams_total, "WatchSnapshots streams", "server-wide")
        self._arrivals = Rate(b.arrivals_per_tenant_s)

    def arrivals(self, tenant: str, n: int) -> None:
        """Admit a report of ``n`` arrivals of ``tenant``; ``OverloadedError`` past the
        tenant's rate (``Budgets.arrivals_per_tenant_s``)."""
        if not self._arrivals.take(tenant, n):
            raise OverloadedError(
                f"arrivals of this tenant: over {self.budgets.arrivals_per_tenant_s} per "
                "second (limit per tenant); this report was not applied"
            )

    async def authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The caller's tenant; raises Authentication/Revoked/Storage/OverloadedError."""
        return await self._tenant_of(bearer_token(context))

    async def _tenant_of(self, token: str) -> Tenant:
        tenant = await self.tenants.tenant(token)
        if tenant is None:
            raise AuthenticationError("authorization: unknown token")
        if tenant.revoked_at is not None:
            raise RevokedError(f"authorization: the token of tenant {tenant.name!r} was revoked")
        return tenant

    @asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[Tenant]:
        """Admit a unary call: its tenant, with its slots held until the block ends."""
        async with self._admit(context, self._peer_calls, self._tenant_calls, self._calls) as t:
            yield t

    @asynccontextmanager
    async def stream(self, context: grpc.aio.ServicerContext) -> AsyncIterator[Tenant]:
        """Admit a ``WatchSnapshots`` stream (its own budgets, apart from unary calls)."""
        slots = (self._peer_streams, self._tenant_streams, self._streams)
        async with self._admit(context, *slots) as tenant:
            yield tenant

    @asynccontextmanager
    async def revocable(
        self, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[asyncio.Future[Exception]]:
        """A future that gets the error to end an admitted stream with once its token is
        revoked or replaced (module docstring); the stream is followed until the block
        ends."""
        token = bearer_token(context)
        closed: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
        self._open.setdefault(token, set()).add(closed)
        if self._rechecking is None:
            self._rechecking = asyncio.create_task(self._recheck())
        try:
            yield closed
        finally:
            streams = self._open.get(token)
            if streams is not None:
                streams.discard(closed)
                if not streams:
                    del self._open[token]

    async def _recheck(self) -> None:
        """Look the open streams' tokens up every ``recheck_s``; end those no longer
        valid. Stops when no stream is open (the next one starts it again)."""
        try:
            while self._open:
                await asyncio.sleep(self.recheck_s)
                for token in list(self._open):
                    try:
                        await self._tenant_of(token)
                    except (AuthenticationError, RevokedError) as error:
                        for closed in self._open.pop(token, ()):
                            if not closed.done():
                                closed.set_result(error)
                                self.streams_revoked += 1
                    except (StorageError, OverloadedError):
                        pass  # the store cannot say now: the token cache serves it stale
        finally:
            self._rechecking = None

    def streams_of(self, tenant: str) -> int:
        return self._tenant_streams.used.get(tenant, 0)

    @asynccontextmanager
    async def _admit(
        self, context: grpc.aio.ServicerContext, per_peer: Slots, per_tenant: Slots, total: Slots
    ) -> AsyncIterator[Tenant]:
        peer = peer_host(context.peer() or "")
        per_peer.take(peer)
        try:
            tenant = await self.authenticate(context)
            per_tenant.take(tenant.name)
            try:
                total.take("")
                try:
                    yield tenant
                finally:
                    total.give("")
            finally:
                per_tenant.give(tenant.name)
        finally:
            per_peer.give(peer)

    async def message(self, requests: AsyncIterator[Any]) -> Any:
        """The call's one request message, which must arrive within the timeout."""
        timeout = self.budgets.message_timeout_s
        try:
            return await asyncio.wait_for(anext(requests), timeout)
        except StopAsyncIteration:
            raise InvalidInputError("request", "the call ended without a message") from None
        except TimeoutError:
            raise SlowClientError(
                f"request: no message within {timeout:g} s of the call's headers"
            ) from None


async def until(items: AsyncIterator[T], closed: asyncio.Future[Exception]) -> AsyncIterator[T]:
    """The items of ``items`` until ``closed`` is set, then its error is raised (whatever
    ``items`` is waiting for); ``items`` is closed either way."""
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(items))
            await asyncio.wait((step, closed), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise closed.result()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await step
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
