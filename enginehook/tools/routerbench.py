"""What one TTL-aware routing decision costs the router, by replicas and published pins.

The router (:class:`~enginehook.routing.router.TtlRouter`, which Ray Serve's adapter runs on
its event loop for every request) reads a replica's published stats once per new mapping.
This measures, in one run and on the same stats, the decision on stats it has read
(``decide``: most requests, between two broadcasts of the replicas' stats), the decision
on equal stats handed over as new mappings (``copied``: Ray's broadcast hands every
replica's stats over anew, changed or not; they are compared, not read) and the decision
that reads new stats from every replica (``read``: at most once per replica per
``request_routing_stats_period_s``; before stats were read once, every decision cost this).
Half the decisions are for programs holding a pin somewhere, half for new programs; each
is followed by the router's record of the route (as Ray's ``on_request_routed``), and all
of them come after the stats were taken, so every decision adds the routes since. The
stats are those :func:`~enginehook.routing.stats.replica_stats` publishes, with pins of
random expiry, size and queue position.

>>> rows = run_router_bench([2], pins_per_replica=10, decisions=20, seed=1)
>>> [(r.replicas, r.pins) for r in rows]
[(2, 20)]
>>> rows[0].read_ms > 0 and rows[0].decide_ms > 0
True
"""

from __future__ import annotations

import copy
import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from enginehook.routing.router import TtlRouter
from enginehook.routing.rule import STATS_KEY

__all__ = ["RouterBenchRow", "format_rows", "run_router_bench"]

#: When the replicas took their stats, in the router's clock.
_NOW = 1_000.0


@dataclass(frozen=True)
class RouterBenchRow:
    """Median and P90 milliseconds per decision for ``replicas`` replicas publishing
    ``pins`` pins in all."""

    replicas: int
    pins: int
    decide_ms: float
    decide_p90_ms: float
    copied_ms: float
    copied_p90_ms: float
    read_ms: float
    read_p90_ms: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stats(replica: int, pins: int, rng: random.Random) -> dict[str, Any]:
    """A replica's published stats with ``pins`` live pins (a fresh mapping each call)."""
    published = {
        f"p{replica}-{i}": [_NOW + rng.uniform(1, 60), rng.randrange(256, 32_768), i * 500]
        for i in range(pins)
    }
    block = {
        "pins": published,
        "free_tokens": rng.randrange(10_000, 200_000),
        "pinned_tokens": sum(v[1] for v in published.values()),
        "running": rng.randrange(0, 8),
        "bound": pins + rng.randrange(0, 20),
        "prefill_tokens_per_s": 8_000.0,
        "at": _NOW,
        "waiting": rng.randrange(0, 8),
        "queued_tokens": rng.randrange(0, 40_000),
        "ahead_tokens": rng.randrange(0, 20_000),
    }
    return {STATS_KEY: block}


def _ms(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e3, ordered[int(0.9 * (len(ordered) - 1))] * 1e3


def run_router_bench(
    replica_counts: Sequence[int],
    pins_per_replica: int = 300,
    decisions: int = 300,
    seed: int = 0,
) -> list[RouterBenchRow]:
    """One row per replica count: ``decisions`` decisions of each kind, in turn: on stats
    read before, on equal stats handed over as new mappings, on new stats from every
    replica."""
    if not replica_counts or min(replica_counts) < 1:
        raise ValueError(f"--replicas: counts must be >= 1, got {list(replica_counts)}")
    if pins_per_replica < 0 or decisions < 2:
        raise ValueError(
            f"--pins must be >= 0 and --decisions >= 2, got {pins_per_replica}, {decisions}"
        )
    # escaped pins of stats that publish no endpoint are counted: nothing to warn about here
    drops_log = logging.getLogger("enginehook.routing.drops")
    level = drops_log.level
    drops_log.setLevel(logging.ERROR)
    try:
        return _measure(replica_counts, pins_per_replica, decisions, random.Random(seed))
    finally:
        drops_log.setLevel(level)


def _measure(
    replica_counts: Sequence[int], pins_per_replica: int, decisions: int, rng: random.Random
) -> list[RouterBenchRow]:
    rows = []
    for count in replica_counts:
        ids = [f"r{r}" for r in range(count)]
        published = [_stats(r, pins_per_replica, rng) for r in range(count)]
        spare = [_stats(r, pins_per_replica, rng) for r in range(count)]
        router = TtlRouter()
        router.decide(list(zip(ids, published, strict=True)), None, _NOW)  # read once
        times: dict[str, list[float]] = {"decide": [], "copied": [], "read": []}
        for k in range(decisions):
            pinned = k % 2 == 1 and pins_per_replica > 0
            program = (
                f"p{rng.randrange(count)}-{rng.randrange(pins_per_replica)}"
                if pinned
                else f"new{k}"
            )
            copies = copy.deepcopy(published)  # the same stats, handed over anew
            published, spare = spare, published  # then every replica publishes anew
            for kind, stats in (("copied", copies), ("decide", copies), ("read", published)):
                start = time.perf_counter()
                chosen = router.decide(list(zip(ids, stats, strict=True)), program, _NOW + 0.5)
                router.routed(program, chosen.ranked[0], _NOW + 0.5, tokens=4_000)
                times[kind].append(time.perf_counter() - start)
        (d50, d90), (c50, c90), (r50, r90) = (_ms(times[k]) for k in ("decide", "copied", "read"))
        rows.append(RouterBenchRow(count, count * pins_per_replica, d50, d90, c50, c90, r50, r90))
    return rows


def format_rows(rows: Sequence[RouterBenchRow]) -> str:
    """The rows as a Markdown table (milliseconds, median / P90)."""
    lines = [
        "| replicas | pins published | decision, stats read before | equal stats handed over "
        "anew | new stats from every replica |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.replicas} | {r.pins:,} | {r.decide_ms:.3f} / {r.decide_p90_ms:.3f} | "
            f"{r.copied_ms:.2f} / {r.copied_p90_ms:.2f} | {r.read_ms:.2f} / {r.read_p90_ms:.2f} |"
        )
    return "\n".join(lines)
