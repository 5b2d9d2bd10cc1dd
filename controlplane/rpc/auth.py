"""Bearer tokens → tenants, with a bounded stale cache so decisions survive the database.

A token looked up less than ``fresh_s`` ago is answered from memory. An older entry of a
known tenant is still answered from memory, and refreshed from the store in the
background (one refresh per token at a time), for up to ``stale_s`` after its last
successful lookup: with the database down, tenants keep being served for ``stale_s``,
after which their calls get UNAVAILABLE. Unknown tokens are remembered for ``fresh_s`` as
well, and lookups of tokens not in memory run on a small thread pool of their own,
``max_lookups`` at a time at most (beyond: RESOURCE_EXHAUSTED), so a flood of invented
tokens neither reaches the database unbounded nor takes the threads that ingest uses.

Revocations and rotations reach the cache by the server's tail (:meth:`TenantCache.apply`,
fed by ``Store.tenant_changes`` every ``tail_interval_s``), not only by refreshes: a
cached token of a revoked tenant is answered revoked from then on, and a token replaced by
a rotation is answered unknown, both for ``stale_s`` like any other answer of the store,
so a database outage that starts after the tail read the change cannot bring the old
token back. A change is so seen within ``tail_interval_s`` plus one read on every replica
(and at the first refresh after it, within ``fresh_s``, as before). A lookup that started
before a change it overlaps is not remembered (it may have read the tenant as it was).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from controlplane.errors import OverloadedError
from controlplane.records import Tenant
from controlplane.storage import hash_token
from controlplane.storage.base import TenantChange

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
        #: token hash -> (tenant or None, when the store said so, settled): a settled None
        #: is a token a rotation replaced, answered unknown for ``stale_s``, not ``fresh_s``.
        self._entries: OrderedDict[str, tuple[Tenant | None, float, bool]] = OrderedDict()
        #: Changes applied so far, and the count when each token hash and each tenant id
        #: was last changed by one (lookups that began before are not remembered).
        self._changes = 0
        self._key_changed: dict[str, int] = {}
        self._tenant_changed: dict[int, int] = {}
        #: Cached tokens answered revoked or unknown by a change the tail read.
        self.revoked_by_changes = 0
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
            tenant, checked, settled = entry
            age = now - checked
            if age < self.options.fresh_s:
                return tenant
            if (tenant is not None or settled) and age < self.options.stale_s:
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
        began = self._changes
        try:
            loop = asyncio.get_running_loop()
            tenant = await loop.run_in_executor(self._pool, self._lookup, key)
        finally:
            self._waiting -= 1
        if not self._remember(key, tenant, began):
            entry = self._entries.get(key)  # what the change said meanwhile
            return entry[0] if entry is not None else tenant
        return tenant

    def _refresh_later(self, key: str) -> None:
        if key in self._refreshing:
            return
        self._refreshing.add(key)
        loop = asyncio.get_running_loop()
        began = self._changes
        future = loop.run_in_executor(self._pool, self._lookup, key)

        def done(f: asyncio.Future[Tenant | None]) -> None:
            self._refreshing.discard(key)
            if not f.cancelled() and f.exception() is None:
                self._remember(key, f.result(), began)
            # a failed refresh keeps the entry (and its age): stale until stale_s

        future.add_done_callback(done)

    def _remember(self, key: str, tenant: Tenant | None, began: int) -> bool:
        """Keep a lookup's answer, unless a change applied since the lookup began touched
        the token or the tenant (then the change's answer stands); whether it was kept."""
        if self._key_changed.get(key, -1) > began or (
            tenant is not None and self._tenant_changed.get(tenant.id, -1) > began
        ):
            return False
        old = self._entries.get(key)
        settled = tenant is None and old is not None and old[0] is None and old[2]
        self._entries[key] = (tenant, self._clock(), settled)
        self._entries.move_to_end(key)
        while len(self._entries) > self.options.max_entries:
            self._entries.popitem(last=False)
        return True

    def apply(self, changes: Iterable[TenantChange]) -> int:
        """Apply tenants' token changes as the store reports them (``Store.tenant_changes``,
        read by the server's tail; call on the event loop): a cached token of a changed
        tenant is answered as the tenant is now (revoked, or active again), a cached token
        that is no longer the tenant's is answered unknown, each for ``stale_s`` from now.
        Returns the cached tokens changed."""
        latest = {c.tenant.id: c for c in changes}  # in seq order: the newest wins
        if not latest:
            return 0
        self._changes += 1
        now, changed = self._clock(), 0
        for key, (tenant, _, _) in list(self._entries.items()):
            if tenant is None:
                continue
            change = latest.get(tenant.id)
            if change is None:
                continue
            answer = change.tenant if key == change.token_hash else None
            if tenant.revoked_at is None and (answer is None or answer.revoked_at is not None):
                self.revoked_by_changes += 1
            self._entries[key] = (answer, now, True)
            self._key_changed[key] = self._changes
            changed += 1
        for change in latest.values():
            entry = self._entries.get(change.token_hash)
            if entry is not None and entry[0] is None:  # looked up before it was created
                self._entries[change.token_hash] = (change.tenant, now, True)
                changed += 1
            self._key_changed[change.token_hash] = self._changes
            self._tenant_changed[change.tenant.id] = self._changes
        return changed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
