"""TTL-aware routing in a router's own extension point.

:mod:`enginehook.routing.rule` is the rule, a pure function of what the replicas publish
(no clock, no Ray); :mod:`enginehook.routing.stats` is what a replica publishes and the
view a router reads back; :mod:`enginehook.routing.router` is the state a router keeps
around the rule (``TtlRouter``), with :mod:`enginehook.routing.drops` posting the drop of a
pin the rule escaped to its holder (``PinDrops``); :mod:`enginehook.routing.ray` runs it as
a Ray Serve ``RequestRouter`` (it imports Ray, which only the ``ray`` extra installs: import
it by its path). The simulator's ``ttl-aware`` router hosts the same ``TtlRouter``. This
package exports the rule's and the stats' names.
"""

from __future__ import annotations

from enginehook.routing.rule import STATS_KEY, Last, Memory, PinView, ReplicaView, route
from enginehook.routing.stats import Queued, replica_stats, view_of

__all__ = [
    "STATS_KEY",
    "Last",
    "Memory",
    "PinView",
    "Queued",
    "ReplicaView",
    "replica_stats",
    "route",
    "view_of",
]
