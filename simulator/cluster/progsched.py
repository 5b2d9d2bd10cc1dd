"""vllm-router 0.1.17's program scheduling (``--enable-program-scheduling``; RFC #285,
PR #286, ``src/program_scheduling/policy.rs`` in vllm-project/router).

A new program is bound to a target by ``least_program_count``; every later turn resumes on
that home target. After each turn the program stays ACTIVE ("acting") for a TTL, then is
PAUSED. The TTL is the Continuum-style break-even rule on one log-normal fitted to the
target's inter-request intervals (the last ``stats_window`` of them; 0 until the window is
full), over ``d`` in {0} ∪ 34 log-spaced points up to ``min(max_ttl_s, C)``, maximising
``C·P(T<d) − E[T; T<d] − d·P(T≥d)``, where ``C = (0.066 + 0.0570 x + 0.00441 x²)(2 − α)``
is the cold prefill of the ``x`` thousand context tokens (α = 0.15). The KV is protected
only at admission: with ``token_capacity_per_target`` (here the engine's KV pool) a paused
program's turn is held by the router while the active programs' context would not leave
room for it, and released first-come first-served as programs pause or end.

What the router reads of an engine (``observations.rs``, ``scheduler.rs``'s
``apply_observations`` and ``target_usage``): every ``metrics_interval`` (1 s, as the real
bench sets it) it scrapes ``/metrics`` (:meth:`EngineView.metrics`: ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_running``, ``vllm:num_requests_waiting``); an observation is fresh for
3 intervals. With ``native = usage × capacity``, ``r`` running requests and ``R`` the ledger's
active programs with a turn in flight (reasoning), the reasoning estimate is
``native × max(R, r) / r`` when ``r > 0``, else the ledger's reasoning tokens when ``R > 0``,
else ``native``; the active-program estimate adds the ledger's acting programs' tokens. The
target's usage is that estimate plus the ledger's changes since the observation (admissions
+, pauses −, context growth +) while it is fresh, else the ledger's active tokens. So an
engine whose only KV is pins, counted as used, and which runs nothing publishes the pins as
the usage: a paused program's turn waits there until the pins expire.

Admission of a paused program's turn (``scheduler_admission.rs``, ``rank_admission_plan``):
not while the fresh observation shows ``waiting_threshold`` (1) or more waiting requests,
not while ``max_active`` (64) programs are active on the target, and with a token capacity
only if ``usage + tokens <= capacity`` (the low watermark is 1.0 by default); a turn held
``force_resume_s`` (300 s, the static bound) is admitted regardless. ``program-scheduling``
is the real bench's ``program_scheduling`` (``token_capacity_per_target`` = the KV pool),
``program-scheduling-by-count`` its ``program_scheduling_by_count`` (no token capacity: the
program-count guard and the waiting threshold only).

Simplifications kept: the queue is per home target (the bench's ``global_queue`` may resume
a paused program elsewhere with 1.2× headroom), first-come first-served with head-of-line
blocking (the router sorts MRU and takes the first that fits), no decode buffer (100 tokens
a program), no growth reserve or batch-gain admission, no privilege leases or segment
yields, and tokens are the engine's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy.stats import norm

from simulator.cluster.base import (
    EngineMetrics,
    EngineView,
    Params,
    Router,
    TurnRequest,
    register_router,
)

__all__ = ["ProgramScheduling", "ProgramSchedulingByCount", "break_even_ttl", "miss_cost_s"]


def miss_cost_s(context_tokens: int, alpha: float = 0.15) -> float:
    """The router's calibrated cache-miss cost (AgentInfer coefficients): the cold prefill
    polynomial (13.94 s at 50k tokens; its doc says about 13.93 s) times ``2 - alpha``.

    >>> round(miss_cost_s(50_000), 2)
    25.79
    """
    x = context_tokens / 1000.0
    return (0.066 + 0.0570 * x + 0.00441 * x * x) * (2.0 - alpha)


def break_even_ttl(gaps: Sequence[float], cost_s: float, cap_s: float = 10.0) -> float:
    """The TTL ``d`` maximising ``C·P(T<d) − E[T; T<d] − d·P(T≥d)`` for log-normal ``T``
    fitted to ``gaps`` (0 when no candidate beats not pinning).

    >>> break_even_ttl([1.0, 1.2, 0.8, 1.1], 5.0) > 1.0
    True
    """
    logs = np.log(np.maximum(np.asarray(gaps, dtype=np.float64), 1e-6))
    mu, sigma = float(logs.mean()), max(float(logs.std()), 1e-3)
    top = min(cap_s, cost_s)
    if top <= 0.0:
        return 0.0
    d = np.geomspace(top / 1000.0, top, 34)
    z = (np.log(d) - mu) / sigma
    below = norm.cdf(z)
    partial = math.exp(mu + sigma * sigma / 2.0) * norm.cdf(z - sigma)  # E[T; T<d]
    gain = cost_s * below - partial - d * (1.0 - below)
    best = int(np.argmax(gain))
    return float(d[best]) if gain[best] > 0.0 else 0.0


@dataclass(slots=True)
class _Observation:
    """The last scrape of one target and the ledger's changes since."""

    at: float
    metrics: EngineMetrics
    estimate: float | None  # active program tokens (None without a token capacity)
    delta: float = 0.0


@register_router
class ProgramScheduling(Router):
    name = "program-scheduling"
    help = "vllm-router program scheduling: home target, rank-level break-even TTL, admission hold"
    PARAMS: ClassVar[Params] = {
        "max_ttl_s": (float, 10.0, "max_acting_ttl_seconds"),
        "stats_window": (int, 100, "stats_window_size"),
        "capacity_share": (
            float,
            1.0,
            "token_capacity_per_target as a share of the KV pool (0: none, admission by count)",
        ),
        "paused_retention_s": (float, 1800.0, "paused_retention_ttl_seconds"),
        "metrics_interval_s": (float, 1.0, "metrics_interval_seconds (observations)"),
        "waiting_threshold": (int, 1, "admission_waiting_request_threshold (0: off)"),
        "max_active": (int, 64, "max_active_programs_per_target"),
        "force_resume_s": (float, 300.0, "force_resume_timeout_seconds"),
    }
    paused_retention_s: float
    max_ttl_s: float
    stats_window: int
    capacity_share: float
    metrics_interval_s: float
    waiting_threshold: int
    max_active: int
    force_resume_s: float

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        if self.metrics_interval_s <= 0.0 or self.capacity_share < 0.0:
            raise ValueError(
                f"router {self.name!r}: metrics_interval_s must be > 0 and capacity_share >= 0"
            )
        self._home: dict[str, int] = {}
        self._programs: dict[int, int] = {}
        self._active: dict[str, int] = {}  # program → tokens counted on its home
        self._reasoning: set[str] = set()  # active programs with a turn in flight
        self._acting: dict[int, int] = {}  # engine → active tokens (reasoning and acting)
        self._gen: dict[str, int] = {}
        self._finished_at: dict[str, float] = {}
        self._gaps: dict[int, deque[float]] = {}
        self._held: dict[int, deque[tuple[str, int, float]]] = {}
        self._seen: dict[int, _Observation] = {}
        self._live = 0  # programs routed and not ended: the scrapes run while there are any
        self._ticking = False

    def joined(self, engine: EngineView, now: float) -> None:
        for table, value in ((self._programs, 0), (self._acting, 0)):
            table[engine.engine_id] = value
        self._gaps[engine.engine_id] = deque(maxlen=self.stats_window)
        self._held[engine.engine_id] = deque()

    def left(self, engine: EngineView, now: float) -> None:
        eid = engine.engine_id
        for pid in [p for p, h in self._home.items() if h == eid]:
            del self._home[pid]
            self._active.pop(pid, None)
            self._reasoning.discard(pid)
        held = self._held.pop(eid)
        for table in (self._programs, self._acting, self._gaps):
            del table[eid]
        self._seen.pop(eid, None)
        for pid, _, at in held:  # re-route what was held for the leaving engine
            target = min(self._programs, key=lambda e: (self._programs[e], e))
            self._home[pid] = target
            self._programs[target] += 1
            self._held[target].append((pid, 0, at))

    def binding(self, program_id: str, now: float) -> int | None:
        return self._home.get(program_id)

    def held(self) -> int:
        """Turns the router holds now (all targets)."""
        return sum(len(queue) for queue in self._held.values())

    # -- what the router reads of its targets --------------------------------------------
    def _capacity(self, engine: EngineView) -> float | None:
        return engine.kv_tokens() * self.capacity_share if self.capacity_share > 0 else None

    def _observe(self, engine: EngineView, now: float) -> None:
        """A scrape of ``engine``'s metrics, estimated as ``apply_observations`` does."""
        eid = engine.engine_id
        metrics = engine.metrics()
        capacity = self._capacity(engine)
        estimate = None
        if capacity is not None:
            native = metrics.kv_usage * capacity
            mine = [p for p in self._reasoning if self._home.get(p) == eid]
            reasoning_tokens = sum(self._active[p] for p in mine)
            if metrics.running > 0:
                reasoning = native * max(len(mine), metrics.running) / metrics.running
            elif mine:
                reasoning = float(reasoning_tokens)
            else:
                reasoning = native
            estimate = reasoning + self._acting[eid] - reasoning_tokens
        self._seen[eid] = _Observation(now, metrics, estimate)

    def _fresh(self, home: int, now: float) -> _Observation | None:
        seen = self._seen.get(home)
        if seen is None or now - seen.at > 3.0 * self.metrics_interval_s:
            return None
        return seen

    def usage(self, home: int, now: float) -> float:
        """``target_usage``: the fresh estimate plus the ledger's changes since, else the
        ledger's active programs' tokens."""
        seen = self._fresh(home, now)
        if seen is not None and seen.estimate is not None:
            return max(0.0, seen.estimate + seen.delta)
        return float(self._acting[home])

    def _admits(self, engine: EngineView, tokens: int, now: float) -> bool:
        home = engine.engine_id
        seen = self._fresh(home, now)
        waiting = seen.metrics.waiting if seen is not None else 0
        if 0 < self.waiting_threshold <= waiting:
            return False
        active = sum(1 for p in self._active if self._home.get(p) == home)
        if active >= self.max_active:
            return False
        capacity = self._capacity(engine)
        return capacity is None or self.usage(home, now) + tokens <= capacity

    def _tick(self, now: float) -> None:
        """Every ``metrics_interval_s`` while programs live: scrape, then admit."""
        if self.host is None:
            return
        for eid in list(self._held):
            engine = self.host.engine(eid)
            if engine is not None:
                self._observe(engine, now)
                self._admit_held(eid, now)
        if self._live > 0 or any(self._held.values()):
            self.host.call_at(now + self.metrics_interval_s, self._tick)
        else:
            self._ticking = False

    # -- routing -------------------------------------------------------------------------
    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView | None:
        pid = request.program_id
        if request.turn == 0:
            self._live += 1
            if not self._ticking and self.host is not None:
                self._ticking = True
                self.host.call_at(request.now, self._tick)
        home = self._home.get(pid)
        if home is None or home not in self._programs:
            home = min(self._programs, key=lambda e: (self._programs[e], e))
            self._home[pid] = home
            self._programs[home] += 1
        last = self._finished_at.pop(pid, None)
        if last is not None:
            self._gaps[home].append(max(0.0, request.now - last))
        engine = next(e for e in engines if e.engine_id == home)
        if pid in self._active:  # acting: its TTL is live
            self._gen[pid] = self._gen.get(pid, 0) + 1
            self._count(pid, request.prompt_tokens)
            self._reasoning.add(pid)
            return engine
        if self._held[home] or not self._admits(engine, request.prompt_tokens, request.now):
            self._held[home].append((pid, request.prompt_tokens, request.now))
            return None
        self._count(pid, request.prompt_tokens)
        self._reasoning.add(pid)
        return engine

    def _count(self, program_id: str, tokens: int) -> None:
        home = self._home[program_id]
        self._adjust(home, tokens - self._active.get(program_id, 0))
        self._active[program_id] = tokens

    def _adjust(self, home: int, tokens: int) -> None:
        """``adjust_usage``: the ledger and the change since the last observation."""
        self._acting[home] += tokens
        seen = self._seen.get(home)
        if seen is not None:
            seen.delta += tokens

    def _pause(self, program_id: str, now: float) -> None:
        tokens = self._active.pop(program_id, None)
        self._reasoning.discard(program_id)
        home = self._home.get(program_id)
        if tokens is None or home is None or home not in self._acting:
            return
        self._adjust(home, -tokens)
        self._admit_held(home, now)

    def _admit_held(self, home: int, now: float) -> None:
        queue = self._held[home]
        engine = self.host.engine(home) if self.host is not None else None
        if engine is None:
            return
        while queue:
            pid, tokens, at = queue[0]
            forced = now - at >= self.force_resume_s
            if not forced and not self._admits(engine, tokens, now):
                break
            queue.popleft()
            self._count(pid, tokens)
            self._reasoning.add(pid)
            self.host.submit(pid, home, now)  # type: ignore[union-attr]

    def turn_finished(self, engine: EngineView, program_id: str, context: int, now: float) -> None:
        self._finished_at[program_id] = now
        self._reasoning.discard(program_id)
        home = self._home.get(program_id, engine.engine_id)
        if program_id in self._active:
            self._count(program_id, context)
        gaps = self._gaps.get(home)
        ttl = 0.0
        if gaps is not None and len(gaps) >= self.stats_window:
            ttl = break_even_ttl(list(gaps), miss_cost_s(context), self.max_ttl_s)
        generation = self._gen[program_id] = self._gen.get(program_id, 0) + 1
        if ttl <= 0.0:
            self._pause(program_id, now)
            return

        def expire(at: float) -> None:
            if self._gen.get(program_id) == generation:
                self._pause(program_id, at)

        if self.host is not None:
            self.host.call_at(now + ttl, expire)

    def program_ended(self, program_id: str, now: float) -> None:
        """The end never reaches the router: the last turn's TTL pauses the program, and
        the paused program is forgotten after ``paused_retention_s``. (The count of live
        programs only stops the scrapes once the cluster is idle.)"""
        self._live -= 1
        if self.host is not None:
            self.host.call_at(now + self.paused_retention_s, lambda at: self._forget(program_id))

    def _forget(self, program_id: str) -> None:
        if program_id in self._active:
            return
        home = self._home.pop(program_id, None)
        if home is not None and home in self._programs:
            self._programs[home] -= 1
        self._gen.pop(program_id, None)
        self._finished_at.pop(program_id, None)


@register_router
class ProgramSchedulingByCount(ProgramScheduling):
    """The real bench's ``program_scheduling_by_count``: ``token_capacity_per_target`` null,
    so admission is by the program-count guard (``max_active``) and the waiting-request
    threshold alone; the KV usage an engine publishes is not read."""

    name = "program-scheduling-by-count"
    help = "vllm-router program scheduling without token capacity (program-count guard only)"
    PARAMS: ClassVar[Params] = {
        **ProgramScheduling.PARAMS,
        "capacity_share": (float, 0.0, "token_capacity_per_target (0: none)"),
    }
