"""What the console records over time that the models keep no history of.

- :class:`History`: each tenant's η and T (and counts), sampled every ``interval_s`` since
  the console started, the newest ``keep`` samples per tenant;
- :class:`MovesTold`: moves told to watching engines, per tenant and engine the program
  left, counted as the pin-coherence hub tells them.

>>> h = History(keep=2)
>>> for t in (1.0, 2.0, 3.0):
...     h.add("acme", t, eta=0.5, queue_delay_s=t, programs=1, tool_calls=2)
>>> [p["t"] for p in h.series("acme")], h.series("other")
([2.0, 3.0], [])
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

from controlplane.records import Move

__all__ = ["History", "MovesTold"]


class History:
    """η, T and counts of each tenant over time (bounded per tenant)."""

    def __init__(self, keep: int = 720) -> None:
        if keep < 1:
            raise ValueError(f"history: keep must be >= 1, got {keep}")
        self.keep = keep
        self._points: dict[str, deque[dict[str, float]]] = {}

    def add(
        self,
        tenant: str,
        t: float,
        *,
        eta: float,
        queue_delay_s: float,
        programs: int,
        tool_calls: int,
    ) -> None:
        points = self._points.setdefault(tenant, deque(maxlen=self.keep))
        point = {"t": t, "eta": eta, "queue_delay_s": queue_delay_s}
        point.update(programs=float(programs), tool_calls=float(tool_calls))
        points.append(point)

    def series(self, tenant: str) -> list[dict[str, float]]:
        """The tenant's samples, oldest first (empty if none)."""
        return list(self._points.get(tenant, ()))


class MovesTold:
    """Counts the moves a pin-coherence hub tells, per (tenant, engine left).

    :meth:`attach` wraps the hub's ``tell`` (the one place every move passes, local or
    published by another replica); a move counts when the engine it left had a watcher.
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def attach(self, hub: Any) -> None:
        tell: Callable[[str, Iterable[Move]], None] = hub.tell
        watchers: dict[tuple[str, str], set[Any]] = hub._watchers

        def counted(tenant: str, moves: Iterable[Move]) -> None:
            moves = list(moves)
            for move in moves:
                if watchers.get((tenant, move.from_engine)):
                    self.counts[tenant, move.from_engine] += 1
            tell(tenant, moves)

        hub.tell = counted

    def of(self, tenant: str) -> dict[str, int]:
        return {engine: n for (t, engine), n in self.counts.items() if t == tenant}
