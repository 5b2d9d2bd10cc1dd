"""Moves kept for engines whose ``WatchMoves`` stream here ended (:class:`KeptMoves`): the
engine is likely reconnecting, and a move told in the gap would otherwise be lost and its
pin held until its TTL (:mod:`controlplane.rpc.moves`)."""

from __future__ import annotations

import time
from collections import OrderedDict

__all__ = ["RESUME_S", "KeptMoves"]

#: Moves away from an engine whose stream here ended are kept this long for its next
#: stream (seconds; the engine reconnects after a second).
RESUME_S = 10.0

#: program -> (engine it moved to, arrival time), oldest first.
Unread = OrderedDict[str, tuple[str, float]]


class KeptMoves:
    """Per (tenant, engine) away: the moves kept for its next stream, coalesced per program
    (the newer supersedes the older), at most ``per_engine``, for :data:`RESUME_S` after its
    last stream ended; counted per tenant so that the hub's bounds include them."""

    def __init__(self, per_engine: int) -> None:
        self.per_engine = per_engine
        self._away: dict[tuple[str, str], tuple[float, Unread]] = {}
        self._of: dict[str, int] = {}
        self.total = 0

    def of(self, tenant: str) -> int:
        """Moves kept for the tenant's engines away."""
        return self._of.get(tenant, 0)

    def left(self, key: tuple[str, str], unread: Unread) -> None:
        """The last stream of ``key``'s engine ended with ``unread`` moves: keep them, and
        those to come, for :data:`RESUME_S`; forget what is kept for engines gone longer."""
        now = time.monotonic()
        for gone in [k for k, (until, _) in self._away.items() if now > until]:
            self._forget(gone)
        self._away[key] = (now + RESUME_S, unread)
        self._count(key[0], len(unread))

    def keeping(self, key: tuple[str, str]) -> bool:
        """Whether moves away from ``key``'s engine are kept (it left less than
        :data:`RESUME_S` ago)."""
        away = self._away.get(key)
        if away is None:
            return False
        if time.monotonic() > away[0]:
            self._forget(key)
            return False
        return True

    def keep(
        self, key: tuple[str, str], program: str, entry: tuple[str, float], room: bool
    ) -> bool:
        """Keep a move for a :meth:`keeping` engine, superseding the program's older one;
        ``False`` (not kept) when the engine holds ``per_engine`` or there is no ``room``."""
        kept = self._away[key][1]
        if kept.pop(program, None) is not None:
            self._count(key[0], -1)
        if len(kept) >= self.per_engine or not room:
            return False
        kept[program] = entry
        self._count(key[0], 1)
        return True

    def resume(self, key: tuple[str, str]) -> Unread:
        """What is kept for ``key``'s engine, now that a stream of it is back (forgotten
        here)."""
        away = self._away.get(key)
        if away is None:
            return OrderedDict()
        kept = self._forget(key)
        return kept if time.monotonic() <= away[0] else OrderedDict()

    def shed(self, tenant: str | None) -> bool:
        """Free the oldest move kept for an engine away (of ``tenant``, or of anyone);
        ``False`` when none is kept."""
        for key, (_, kept) in self._away.items():
            if kept and (tenant is None or key[0] == tenant):
                kept.popitem(last=False)
                self._count(key[0], -1)
                return True
        return False

    def _forget(self, key: tuple[str, str]) -> Unread:
        _, kept = self._away.pop(key)
        self._count(key[0], -len(kept))
        return kept

    def _count(self, tenant: str, n: int) -> None:
        left = self._of.get(tenant, 0) + n
        if left > 0:
            self._of[tenant] = left
        else:
            self._of.pop(tenant, None)
        self.total += n
