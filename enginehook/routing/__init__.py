"""TTL-aware routing in a router's own extension point.

:mod:`enginehook.routing.rule` is the rule, a pure function of what the replicas publish
(no clock, no Ray); :mod:`enginehook.routing.router` is the state a router keeps around it
(:class:`TtlRouter`), with :mod:`enginehook.routing.drops` posting the drop of a pin the
rule escaped to its holder (:class:`PinDrops`); :mod:`enginehook.routing.ray` runs it as a
Ray Serve ``RequestRouter`` (it imports Ray, which only the ``ray`` extra installs: import
it by its path).
"""

from __future__ import annotations

from enginehook.routing.drops import PinDrops
from enginehook.routing.router import TtlRouter
from enginehook.routing.rule import (
    STATS_KEY,
    Last,
    Memory,
    PinView,
    Queued,
    ReplicaView,
    Route,
    replica_stats,
    route,
    view_of,
)

__all__ = [
    "STATS_KEY",
    "Last",
    "Memory",
    "PinDrops",
    "PinView",
    "Queued",
    "ReplicaView",
    "Route",
    "TtlRouter",
    "replica_stats",
    "route",
    "view_of",
]
