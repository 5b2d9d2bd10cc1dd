"""Bearer tokens → tenants, with a bounded stale cache so decisions survive the database.

A token looked up less than ``fresh_s`` ago is answered from memory. An older entry of a
known tenant is still answered from memory, and refreshed from the store in the
background (one refresh per token at a time), for up to ``stale_s`` after its last
successful lookup: with the database down, tenants keep being served for ``stale_s``,
after which their calls get UNAVAILABLE. A revocation is seen at the first refresh after
it (within ``fresh_s`` plus one lookup while the database answers). Unknown tokens are
remembered for ``fresh_s`` as well, and lookups of tokens not in memory run on a small
thread pool of their own, ``max_lookups`` at a time at most (beyond: RESOURCE_EXHAUSTED),
so a flood of invented tokens neither reaches the database unbounded nor takes the
threads that ingest uses.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from controlplane.errors import OverloadedError
from controlplane.records import Tenant
from controlplane.storage import hash_token

__all__ = ["AuthOptions", "TenantCache"]


@dataclass(frozen=True)
class AuthOptions:
    #: Answer from memory without asking the store for this long after a lookup.
    fresh_s: float = 2.0
    #: Keep serving a known tenant from memory this long after its last good lookup.
    stale_s: float = 300.0
    #: Tokens remembered (least recently used dropped first).
    max_entries: int = 100_000
    #: Store lookups of tokens not in memory at once (threads of the lookup pool).
    max_lookups: int = 4
    #: Lookups waiting for a thread at once, beyond which calls get RESOURCE_EXHAUSTED.
    max_waiting: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.fresh_s <= self.stale_s:
            raise ValueError(
                f"auth cache: need 0 < fresh ({self.fresh_s}) <= stale ({self.stale_s}) seconds"
            )
        if self.max_entries < 1 or self.max_lookups < 1 or self.max_waiting < 1:
            raise ValueError("auth cache: max_entries, max_lookups, max_waiting must be >= 1")


class TenantCache:
    """Resolves tokens for the event loop; ``lookup`` maps a token hash to a tenant."""

    def __init__(
        self,
        lookup: Callable[[str], Tenant | None],
        options: AuthOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options or AuthOptions()
        self._lookup = lookup
        self._clock = clock
        self._entries: OrderedDict[str, tuple[Tenant | None, float]] = OrderedDict()
        self._refreshing: set[str] = set()
        self._waiting = 0
        self._pool = ThreadPoolExecutor(self.options.max_lookups, "cachettl-auth")

    async def tenant(self, token: str) -> Tenant | None:
        """The tenant holding ``token`` (revoked ones too), or None if nobody holds it.

        Raises ``StorageError`` when the store cannot answer and memory cannot either,
        ``OverloadedError`` when too many lookups wait.
        """
        key = hash_token(token)
        entry = self._entries.get(key)
        now = self._clock()
        if entry is not None:
            tenant, checked = entry
            age = now - checked
            if age < self.options.fresh_s:
                return tenant
            if tenant is not None and age < self.options.stale_s:
                self._refresh_later(key)
                return tenant
        return await self._look_up(key)

    async def _look_up(self, key: str) -> Tenant | None:
        if self._waiting >= self.options.max_waiting:
            raise OverloadedError(
                f"authorization: {self._waiting} token lookups in progress "
                f"(limit {self.options.max_waiting}); retry later"
            )
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            tenant = await loop.run_in_executor(self._pool, self._lookup, key)
        finally:
            self._waiting -= 1
        self._remember(key, tenant)
        return tenant

    def _refresh_later(self, key: str) -> None:
        if key in self._refreshing:
            return
        self._refreshing.add(key)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._lookup, key)

        def done(f: asyncio.Future[Tenant | None]) -> None:
            self._refreshing.discard(key)
            if not f.cancelled() and f.exception() is None:
                self._remember(key, f.result())
            # a failed refresh keeps the entry (and its age): stale until stale_s

        future.add_done_callback(done)

    def _remember(self, key: str, tenant: Tenant | None) -> None:
        self._entries[key] = (tenant, self._clock())
        self._entries.move_to_end(key)
        while len(self._entries) > self.options.max_entries:
            self._entries.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
