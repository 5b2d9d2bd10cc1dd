"""What the server's streams hold in gRPC's send buffers: bounded per tenant and in all.

gRPC copies every message it is handed into a buffer of its own and keeps it until HTTP/2
flow control lets it out, so a ``WatchSnapshots`` client that grants no window (it never
reads) holds a whole snapshot in the server for as long as its connection lives: ending
the call does not free it, only the client's window or its connection going away does.
A thousand such streams of a tenant with a 2.1 MB snapshot held 2.3 GB.

So a stream's snapshot is handed to gRPC only within a budget of bytes not yet written:
at most ``per_tenant`` for a tenant's streams and ``total`` for everyone's, except that a
tenant holding nothing may always send one message, however large (so no tenant waits
for another's clients: the total is passed by at most one message per tenant). A stream
waits for room before its write starts, and its bytes are given back when gRPC reports
the write done or failed, not when the stream gives up on it: until then they are still
in gRPC's buffers. A write its stream gives up on (a slow reader,
``Budgets.slow_reader_s``, or a revoked token) moves to the tenant's abandoned bytes, at
most ``per_tenant`` of them, so that a few clients that stopped reading do not keep the
tenant's other streams waiting; past that, a tenant whose own clients stop reading waits
for itself, and the others do not. Every stream of a tenant and version is handed the
same ``bytes`` object (``controlplane.rpc.servicer``), so what the server holds beyond
this budget is one snapshot per tenant. Used from the event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["SendBudget"]


class SendBudget:
    """Bytes handed to gRPC and not yet written, per tenant and in all.

    >>> async def demo():
    ...     budget = SendBudget(per_tenant=10, total=15)
    ...     await budget.take("a", 8)
    ...     await budget.take("b", 30)  # b holds nothing: one message always goes
    ...     waiting = asyncio.ensure_future(budget.take("a", 8))
    ...     await asyncio.sleep(0)
    ...     before = waiting.done(), budget.waiting
    ...     budget.give("a", 8)
    ...     budget.give("b", 30)
    ...     await waiting
    ...     return before, budget.held, budget.held_by("a")
    >>> asyncio.run(demo())
    ((False, 1), 8, 8)
    """

    def __init__(
        self, per_tenant: int, total: int, on_give: Callable[[int], None] | None = None
    ) -> None:
        if per_tenant <= 0 or total <= 0:
            raise ValueError(f"budgets must be > 0, got {per_tenant!r} and {total!r}")
        self.per_tenant = per_tenant
        self.total = total
        self.on_give = on_give  # told of the bytes each written message freed
        self.held = 0
        self.waiting = 0
        self.waits = 0  # writes that had to wait for room (a counter)
        self._tenants: dict[str, int] = {}
        self._room: asyncio.Condition | None = None  # made in the running loop
        self._waking: asyncio.Future[None] | None = None
        self.abandoned = 0  # bytes of writes given up on, still in gRPC's buffers
        self._abandoned: dict[str, int] = {}
        self._writes: dict[asyncio.Future[None], tuple[str, int]] = {}
        self._abandoned_writes: set[asyncio.Future[None]] = set()

    def held_by(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0)

    def _fits(self, tenant: str, size: int) -> bool:
        mine = self._tenants.get(tenant, 0)
        if mine == 0:  # one message per tenant always goes: no tenant waits for another's
            return True
        return mine + size <= self.per_tenant and self.held + size <= self.total

    async def take(self, tenant: str, size: int) -> None:
        """Wait until ``size`` more bytes of ``tenant`` fit, then count them held."""
        if not self._fits(tenant, size):
            if self._room is None:
                self._room = asyncio.Condition()
            self.waits += 1
            self.waiting += 1
            try:
                async with self._room:
                    await self._room.wait_for(lambda: self._fits(tenant, size))
            finally:
                self.waiting -= 1
        self._tenants[tenant] = self._tenants.get(tenant, 0) + size
        self.held += size

    def give(self, tenant: str, size: int) -> None:
        """Count ``size`` bytes of ``tenant`` written (or dropped by gRPC)."""
        self._release(tenant, size)
        if self.on_give is not None:
            self.on_give(size)

    def _release(self, tenant: str, size: int) -> None:
        left = self._tenants.get(tenant, 0) - size
        if left > 0:
            self._tenants[tenant] = left
        else:
            self._tenants.pop(tenant, None)
        self.held -= size
        if self._room is not None and self.waiting and self._waking is None:
            self._waking = asyncio.ensure_future(self._wake())

    async def _wake(self) -> None:
        assert self._room is not None
        self._waking = None
        async with self._room:
            self._room.notify_all()

    async def send(
        self, tenant: str, size: int, write: Callable[[], Awaitable[None]]
    ) -> asyncio.Future[None]:
        """Take room for ``size`` bytes, then start ``write()`` (gRPC's write of them);
        the write's future, whose end gives the room back. Awaiting it is the caller's."""
        await self.take(tenant, size)
        started = asyncio.ensure_future(write())
        self._writes[started] = (tenant, size)
        started.add_done_callback(self._done)
        return started

    def abandon(self, write: asyncio.Future[None]) -> bool:
        """The stream gave up on ``write`` (a slow reader): move its bytes out of the
        tenant's room into its abandoned bytes, if they fit there (``per_tenant`` each:
        gRPC holds them until the client reads or leaves), so the tenant's other streams
        are not kept waiting by it; False if they do not fit (they keep their room)."""
        found = self._writes.get(write)
        if found is None or write in self._abandoned_writes:
            return False
        tenant, size = found
        if self._abandoned.get(tenant, 0) + size > self.per_tenant:
            return False
        self._abandoned[tenant] = self._abandoned.get(tenant, 0) + size
        self.abandoned += size
        self._abandoned_writes.add(write)
        self._release(tenant, size)
        return True

    def _done(self, write: asyncio.Future[None]) -> None:
        tenant, size = self._writes.pop(write)
        if write in self._abandoned_writes:
            self._abandoned_writes.discard(write)
            left = self._abandoned[tenant] - size
            if left > 0:
                self._abandoned[tenant] = left
            else:
                self._abandoned.pop(tenant, None)
            self.abandoned -= size
        else:
            self._release(tenant, size)
        if self.on_give is not None:
            self.on_give(size)
        if not write.cancelled():
            write.exception()  # retrieved: the stream's handler reports it, if still there
