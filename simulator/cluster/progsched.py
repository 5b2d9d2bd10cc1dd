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
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from scipy.stats import norm

from simulator.cluster.base import EngineView, Params, Router, TurnRequest, register_router

__all__ = ["ProgramScheduling", "break_even_ttl", "miss_cost_s"]


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


@register_router
class ProgramScheduling(Router):
    name = "program-scheduling"
    help = "vllm-router program scheduling: home target, rank-level break-even TTL, admission hold"
    PARAMS: ClassVar[Params] = {
        "max_ttl_s": (float, 10.0, "max_acting_ttl_seconds"),
        "stats_window": (int, 100, "stats_window_size"),
        "capacity_share": (float, 1.0, "token_capacity_per_target as a share of the KV pool"),
        "paused_retention_s": (float, 1800.0, "paused_retention_ttl_seconds"),
    }
    paused_retention_s: float
    max_ttl_s: float
    stats_window: int
    capacity_share: float

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._home: dict[str, int] = {}
        self._programs: dict[int, int] = {}
        self._active: dict[str, int] = {}  # program → tokens counted on its home
        self._acting: dict[int, int] = {}  # engine → active tokens
        self._gen: dict[str, int] = {}
        self._finished_at: dict[str, float] = {}
        self._gaps: dict[int, deque[float]] = {}
        self._held: dict[int, deque[tuple[str, int]]] = {}

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
        held = self._held.pop(eid)
        for table in (self._programs, self._acting, self._gaps):
            del table[eid]
        for pid, _ in held:  # re-route what was held for the leaving engine
            target = min(self._programs, key=lambda e: (self._programs[e], e))
            self._home[pid] = target
            self._programs[target] += 1
            self._held[target].append((pid, 0))

    def binding(self, program_id: str, now: float) -> int | None:
        return self._home.get(program_id)

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView | None:
        pid = request.program_id
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
            return engine
        capacity = engine.kv_tokens() * self.capacity_share
        full = self._held[home] or self._acting[home] + request.prompt_tokens > capacity
        if full and self._acting[home] > 0:  # something will pause and make room
            self._held[home].append((pid, request.prompt_tokens))
            return None
        self._count(pid, request.prompt_tokens)
        return engine

    def _count(self, program_id: str, tokens: int) -> None:
        home = self._home[program_id]
        self._acting[home] += tokens - self._active.get(program_id, 0)
        self._active[program_id] = tokens

    def _pause(self, program_id: str, now: float) -> None:
        tokens = self._active.pop(program_id, None)
        home = self._home.get(program_id)
        if tokens is None or home is None or home not in self._acting:
            return
        self._acting[home] -= tokens
        self._admit_held(home, now)

    def _admit_held(self, home: int, now: float) -> None:
        queue = self._held[home]
        engine = self.host.engine(home) if self.host is not None else None
        if engine is None:
            return
        capacity = engine.kv_tokens() * self.capacity_share
        while queue and (self._acting[home] + queue[0][1] <= capacity or self._acting[home] == 0):
            pid, tokens = queue.popleft()
            self._count(pid, tokens)
            self.host.submit(pid, home, now)  # type: ignore[union-attr]

    def turn_finished(self, engine: EngineView, program_id: str, context: int, now: float) -> None:
        self._finished_at[program_id] = now
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
        the paused program is forgotten after ``paused_retention_s``."""
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
