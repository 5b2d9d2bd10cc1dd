"""The hook's counters: pins held, pinned blocks, hits on pinned prefixes, expiries,
pressure releases, decisions by basis, returning turns and their misses by reason (with
how long after its pin's expiry an expired turn came back), whether misses are priced
as CPU reloads, and what became of the events (the event log's and the control-plane
link's counters, read from the sink at each scrape), and in shadow mode or outside the
rollout what the pins not made would have met, and the rollout in force. Rendered as
Prometheus text by :meth:`HookMetrics.prometheus`, which :mod:`enginehook.vllm.endpoint`
serves on the hook's own endpoint when configured.

>>> m = HookMetrics()
>>> from controlplane.records import MissReason
>>> m.decision("cold-start"); m.released("ttl"); m.set_gauges(pins=2, blocks=7)
>>> m.snapshot()["expiries"], m.snapshot()["pinned_blocks"]
(1, 7)
>>> print(m.prometheus().splitlines()[0])
# TYPE cachettl_pins_held gauge
>>> m.returned(TurnCache(MissReason.EXPIRED, expired_by_s=3.0))
>>> [l for l in m.prometheus().splitlines() if l.startswith("cachettl_turn_misses")]
['cachettl_turn_misses_total{reason="expired",cause=""} 1']
>>> m.set_cpu_tier(True, "OffloadingConnector")
>>> print(m.prometheus().splitlines()[-1])
cachettl_cpu_tier{connector="OffloadingConnector"} 1
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from controlplane.records import NotPinnedCause, PinOutcome, Rollout, TurnCache

__all__ = ["EXPIRED_BY_BUCKETS_S", "SHADOW_OUTCOMES", "HookMetrics"]

#: What a shadow call's pin would have met (``cachettl_shadow_pins_total{outcome}``).
SHADOW_OUTCOMES = ("would_hit", "would_expire", "not_pinned")
_SHADOW_LABELS = dict(
    zip((PinOutcome.HIT, PinOutcome.EXPIRED, PinOutcome.NOT_PINNED), SHADOW_OUTCOMES, strict=True)
)

#: Upper bounds (seconds) of the expired-by histogram's buckets (then +Inf).
EXPIRED_BY_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class HookMetrics:
    """Thread-safe counters (written in ``schedule()``, read by an endpoint thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pins_held = 0
        self.pinned_blocks = 0
        #: Share of the KV pool only pins hold (published as free unless pins_in_kv_usage).
        self.kv_pinned = 0.0
        self.pins_taken = 0
        self.pinned_prefix_hits = 0
        self.hit_tokens = 0
        self.releases: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.events_emitted = 0
        self.schedule_calls = 0
        self.hook_seconds = 0.0
        self.vllm_schedule_seconds = 0.0
        self.cpu_tier = False
        self.cpu_tier_connectors = ""
        self.passthrough = ""
        #: Returning turns by reason; misses by (reason, not-pinned cause or "").
        self.returning: Counter[str] = Counter()
        self.misses: Counter[tuple[str, str]] = Counter()
        self.expired_by_buckets = [0] * (len(EXPIRED_BY_BUCKETS_S) + 1)
        self.expired_by_sum = 0.0
        #: Shadow calls whose program came back, by what their pin would have met.
        self.shadow_pins: Counter[str] = Counter(dict.fromkeys(SHADOW_OUTCOMES, 0))
        #: The rollout in force, read at each scrape (:mod:`enginehook.core.rollout`).
        self._rollout: Callable[[], Rollout] = Rollout
        self._sink_counters: Callable[[], list[tuple[str, str, int]]] = list
        self._more_counters: list[Callable[[], list[tuple[str, str, int]]]] = []
        #: Exceptions of the hook's own code caught before vLLM, by hook.
        self.faults: Counter[str] = Counter()
        #: Requests whose session id the engine refused (run without a session).
        self.sessions_refused = 0

    def set_cpu_tier(self, on: bool, connectors: str = "") -> None:
        """Whether TTL decisions price a miss as a reload from a CPU tier, and the KV
        connector(s) that keep it (comma-separated; empty when none was detected)."""
        with self._lock:
            self.cpu_tier, self.cpu_tier_connectors = on, connectors

    def set_sink(self, counters: Callable[[], list[tuple[str, str, int]]]) -> None:
        """Where the event sink's ``(name, type, value)`` counters are read at each scrape
        (:meth:`enginehook.link.base.EventSink.counters`)."""
        self._sink_counters = counters

    def add_counters(self, counters: Callable[[], list[tuple[str, str, int]]]) -> None:
        """More ``(name, type, value)`` counters read at each scrape (e.g. the pin-coherence
        link's, :meth:`enginehook.link.coherence.CoherenceLink.counters`)."""
        self._more_counters.append(counters)

    def set_passthrough(self, reason: str) -> None:
        """The hook passes through on this engine for ``reason`` (e.g. ``no_prefix_caching``)."""
        with self._lock:
            self.passthrough = reason

    def set_gauges(self, *, pins: int, blocks: int) -> None:
        """Current pins held and blocks they hold."""
        with self._lock:
            self.pins_held, self.pinned_blocks = pins, blocks

    def set_kv_pinned(self, share: float) -> None:
        """The share of the KV pool that only pins hold."""
        with self._lock:
            self.kv_pinned = share

    def decision(self, basis: str) -> None:
        """A TTL decision was taken on ``basis``."""
        with self._lock:
            self.decisions[basis] += 1

    def pinned(self) -> None:
        """A pin was taken."""
        with self._lock:
            self.pins_taken += 1

    def hit(self, cached_tokens: int) -> None:
        """A returning request was admitted while its program's pin was live."""
        with self._lock:
            self.pinned_prefix_hits += 1
            self.hit_tokens += cached_tokens

    def returned(self, cache: TurnCache) -> None:
        """A returning turn was admitted; ``cache``: what it found of its previous turn's."""
        reason = cache.reason.label
        with self._lock:
            self.returning[reason] += 1
            if cache.reason.missed:
                cause = cache.not_pinned_cause
                label = cause.label if cause is not NotPinnedCause.UNSPECIFIED else ""
                self.misses[(reason, label)] += 1
            if cache.expired_by_s is not None:
                i = bisect.bisect_left(EXPIRED_BY_BUCKETS_S, cache.expired_by_s)
                self.expired_by_buckets[i] += 1
                self.expired_by_sum += cache.expired_by_s

    def shadow_returned(self, outcome: PinOutcome) -> None:
        """A shadow call's program came back; ``outcome``: what its pin would have met
        (``HIT``: within its TTL, ``EXPIRED``: after it, ``NOT_PINNED``: TTL 0)."""
        label = _SHADOW_LABELS.get(outcome)
        if label is not None:
            with self._lock:
                self.shadow_pins[label] += 1

    def track_rollout(self, in_force: Callable[[], Rollout]) -> None:
        """Where the rollout in force is read at each scrape."""
        self._rollout = in_force

    def released(self, reason: str) -> None:
        """A pin ended for ``reason`` (a :class:`~enginehook.core.pins.ReleaseReason` value)."""
        with self._lock:
            self.releases[reason] += 1

    def scheduled(self, hook_seconds: float, vllm_seconds: float = 0.0) -> None:
        """One ``schedule()`` call: ``hook_seconds`` of the hook's own work and
        ``vllm_seconds`` in vLLM's ``schedule()`` (queue sorting excluded)."""
        with self._lock:
            self.schedule_calls += 1
            self.hook_seconds += hook_seconds
            self.vllm_schedule_seconds += vllm_seconds

    def refused_session(self, problem: str) -> None:
        """A request's session id failed the engine's own check (``problem``: why); the
        first is logged, every one counted."""
        with self._lock:
            self.sessions_refused += 1
            first = self.sessions_refused == 1
        if first:
            logging.getLogger("enginehook").warning(
                "CacheTTL: a request's session id %s: it runs without a session (no pin); "
                "further refusals are counted in cachettl_session_ids_refused_total",
                problem,
            )

    def fault(self, hook: str) -> None:
        """The hook's own code raised in ``hook`` (caught: the engine went on)."""
        with self._lock:
            self.faults[hook] += 1

    def emitted(self) -> None:
        """An event left for the control plane's queue."""
        with self._lock:
            self.events_emitted += 1

    def snapshot(self) -> dict[str, Any]:
        """All counters as a plain dict."""
        with self._lock:
            return {
                "pins_held": self.pins_held,
                "pinned_blocks": self.pinned_blocks,
                "kv_pinned_perc": self.kv_pinned,
                "pins_taken": self.pins_taken,
                "pinned_prefix_hits": self.pinned_prefix_hits,
                "hit_tokens": self.hit_tokens,
                "expiries": self.releases["ttl"],
                "pressure_releases": self.releases["pressure"] + self.releases["budget"],
                "releases": dict(self.releases),
                "decisions": dict(self.decisions),
                "events_emitted": self.events_emitted,
                "schedule_calls": self.schedule_calls,
                "vllm_schedule_s": self.vllm_schedule_seconds,
                "cpu_tier": self.cpu_tier,
                "cpu_tier_connectors": self.cpu_tier_connectors,
                "passthrough": self.passthrough,
                "faults": dict(self.faults),
                "sessions_refused": self.sessions_refused,
                "returning_turns": dict(self.returning),
                "turn_misses": {f"{r}/{c}" if c else r: n for (r, c), n in self.misses.items()},
                "expired_by_buckets": list(self.expired_by_buckets),
                "expired_by_sum_s": self.expired_by_sum,
                "shadow_pins": dict(self.shadow_pins),
                "hook_us_per_schedule": (
                    1e6 * self.hook_seconds / self.schedule_calls if self.schedule_calls else 0.0
                ),
            }

    def prometheus(self) -> str:
        """The counters in Prometheus text exposition format."""
        s = self.snapshot()
        lines = [
            "# TYPE cachettl_pins_held gauge",
            f"cachettl_pins_held {s['pins_held']}",
            "# TYPE cachettl_pinned_blocks gauge",
            f"cachettl_pinned_blocks {s['pinned_blocks']}",
            "# TYPE cachettl_kv_pinned_perc gauge",
            f"cachettl_kv_pinned_perc {s['kv_pinned_perc']:.6g}",
            "# TYPE cachettl_pins_taken_total counter",
            f"cachettl_pins_taken_total {s['pins_taken']}",
            "# TYPE cachettl_pinned_prefix_hits_total counter",
            f"cachettl_pinned_prefix_hits_total {s['pinned_prefix_hits']}",
            "# TYPE cachettl_pin_releases_total counter",
        ]
        lines += [
            f'cachettl_pin_releases_total{{reason="{r}"}} {n}'
            for r, n in sorted(s["releases"].items())
        ]
        lines.append("# TYPE cachettl_ttl_decisions_total counter")
        lines += [
            f'cachettl_ttl_decisions_total{{basis="{b}"}} {n}'
            for b, n in sorted(s["decisions"].items())
        ]
        lines += self._turn_lines(s)
        lines += self._rollout_lines(s)
        lines.append("# TYPE cachettl_hook_faults_total counter")
        lines += [
            f'cachettl_hook_faults_total{{hook="{h}"}} {n}' for h, n in sorted(s["faults"].items())
        ]
        lines += [
            "# TYPE cachettl_session_ids_refused_total counter",
            f"cachettl_session_ids_refused_total {s['sessions_refused']}",
            "# TYPE cachettl_cpu_tier gauge",
            f'cachettl_cpu_tier{{connector="{s["cpu_tier_connectors"]}"}} {int(s["cpu_tier"])}',
        ]
        if s["passthrough"]:
            lines += [
                "# TYPE cachettl_passthrough gauge",
                f'cachettl_passthrough{{reason="{s["passthrough"]}"}} 1',
            ]
        for counters in (self._sink_counters, *self._more_counters):
            for name, kind, value in counters():
                lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    def _rollout_lines(self, s: dict[str, Any]) -> list[str]:
        """Shadow calls by what their pin would have met, and the rollout in force."""
        rollout = self._rollout()
        tools = ",".join(rollout.tools)
        lines = ["# TYPE cachettl_shadow_pins_total counter"]
        lines += [
            f'cachettl_shadow_pins_total{{outcome="{o}"}} {n}'
            for o, n in sorted(s["shadow_pins"].items())
        ]
        return [
            *lines,
            "# TYPE cachettl_shadow_mode gauge",
            f"cachettl_shadow_mode {int(rollout.shadow)}",
            "# TYPE cachettl_rollout gauge",
            f'cachettl_rollout{{mode="{rollout.mode.label}",tools="{tools}"}} 1',
        ]

    def _turn_lines(self, s: dict[str, Any]) -> list[str]:
        """Returning turns by reason, misses by reason and cause, and the expired-by
        histogram (cumulative buckets, Prometheus style)."""
        lines = ["# TYPE cachettl_returning_turns_total counter"]
        lines += [
            f'cachettl_returning_turns_total{{reason="{r}"}} {n}'
            for r, n in sorted(s["returning_turns"].items())
        ]
        lines.append("# TYPE cachettl_turn_misses_total counter")
        with self._lock:
            misses = sorted(self.misses.items())
        lines += [
            f'cachettl_turn_misses_total{{reason="{r}",cause="{c}"}} {n}' for (r, c), n in misses
        ]
        lines.append("# TYPE cachettl_pin_expired_by_seconds histogram")
        total = 0
        bounds = [*(f"{b:g}" for b in EXPIRED_BY_BUCKETS_S), "+Inf"]
        for bound, n in zip(bounds, s["expired_by_buckets"], strict=True):
            total += n
            lines.append(f'cachettl_pin_expired_by_seconds_bucket{{le="{bound}"}} {total}')
        lines.append(f"cachettl_pin_expired_by_seconds_sum {s['expired_by_sum_s']}")
        lines.append(f"cachettl_pin_expired_by_seconds_count {total}")
        return lines
