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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from controlplane.errors import (
    AuthenticationError,
    InvalidInputError,
    OverloadedError,
    RevokedError,
    SlowClientError,
)
from controlplane.records import Tenant
from controlplane.rpc.auth import TenantCache

__all__ = ["Budgets", "Gate", "Slots", "peer_host"]


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


class Gate:
    """Authentication and the limits of ``Budgets`` for one server."""

    def __init__(self, budgets: Budgets, tenants: TenantCache) -> None:
        b = self.budgets = budgets
        self.tenants = tenants
        self._peer_calls = Slots(b.calls_per_peer, "calls from this address", "per peer")
        self._tenant_calls = Slots(b.calls_per_tenant, "calls of this tenant", "per tenant")
        self._calls = Slots(b.calls_total, "calls", "server-wide")
        self._peer_streams = Slots(b.streams_per_peer, "streams from this address", "per peer")
        self._tenant_streams = Slots(
            b.streams_per_tenant, "WatchSnapshots streams of this tenant", "per tenant"
        )
        self._streams = Slots(b.streams_total, "WatchSnapshots streams", "server-wide")

    async def authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The caller's tenant; raises Authentication/Revoked/Storage/OverloadedError."""
        tenant = await self.tenants.tenant(bearer_token(context))
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
