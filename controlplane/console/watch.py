"""What the console records over time that the models keep no history of.

- :class:`History`: each tenant's η and T (and counts), sampled every ``interval_s`` since
  the console started, the newest ``keep`` samples per tenant (moves told are counted by
  the pin-coherence hub itself: ``CoherenceHub.told``).

>>> h = History(keep=2)
>>> for t in (1.0, 2.0, 3.0):
...     h.add("acme", t, eta=0.5, queue_delay_s=t, programs=1, tool_calls=2)
>>> [p["t"] for p in h.series("acme")], h.series("other")
([2.0, 3.0], [])
"""

from __future__ import annotations

from collections import deque

__all__ = ["History"]


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
