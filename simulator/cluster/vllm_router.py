"""vllm-router 0.1.17's policies (vllm-project/router; flags and defaults from the
wheel's ``--help``, mechanisms from ``src/policies/*.rs`` and ``docs/load_balancing``).

The router never hears that a program ended (``last_turn`` reaches the engine only), so
session state lives until its idle expiry unless ``finish_session=true`` models a client
that calls ``POST /finish_session``.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from typing import ClassVar

from simulator.cluster.base import (
    EngineView,
    Params,
    Router,
    TurnRequest,
    least,
    register_router,
    stable_hash,
)

__all__ = ["CacheAware", "ConsistentHash", "PowerOfTwo", "RoundRobin", "StickyLeastLoaded"]


@register_router
class RoundRobin(Router):
    name = "round_robin"
    help = "vllm-router round_robin: the next worker in turn, no key, no load"

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._next = 0

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        engine = engines[self._next % len(engines)]
        self._next += 1
        return engine


@register_router
class PowerOfTwo(Router):
    name = "power_of_two"
    help = "vllm-router power_of_two: two random workers, the one with fewer pending requests"

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._rng = random.Random(seed)

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        if len(engines) == 1:
            return engines[0]
        pair = self._rng.sample(list(engines), 2)
        return least(pair, lambda e: e.inflight())


@register_router
class ConsistentHash(Router):
    name = "consistent_hash"
    help = "vllm-router consistent_hash: session id on a ring, 160 virtual nodes per worker"
    PARAMS: ClassVar[Params] = {"vnodes": (int, 160, "virtual nodes per worker")}
    vnodes: int

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._ring: list[tuple[int, int]] = []  # (point, engine id), sorted
        self._points: list[int] = []

    def joined(self, engine: EngineView, now: float) -> None:
        for i in range(self.vnodes):
            self._ring.append((stable_hash(f"{engine.name}#{i}"), engine.engine_id))
        self._ring.sort()
        self._points = [p for p, _ in self._ring]

    def left(self, engine: EngineView, now: float) -> None:
        self._ring = [(p, e) for p, e in self._ring if e != engine.engine_id]
        self._points = [p for p, _ in self._ring]

    def owner(self, key: str) -> int:
        """The engine owning ``key``: the first virtual node clockwise of its hash."""
        i = bisect.bisect_right(self._points, stable_hash(key)) % len(self._ring)
        return self._ring[i][1]

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        owner = self.owner(request.program_id)
        return next(e for e in engines if e.engine_id == owner)

    def binding(self, program_id: str, now: float) -> int | None:
        return self.owner(program_id) if self._ring else None


@register_router
class StickyLeastLoaded(Router):
    name = "sticky_least_loaded"
    help = (
        "vllm-router sticky_least_loaded: a new session to the worker with the fewest active "
        "sessions (rendezvous tie-break), then kept there until idle 7200 s"
    )
    PARAMS: ClassVar[Params] = {
        "idle_s": (float, 7200.0, "VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S"),
        "sweep_s": (float, 60.0, "how often expired sessions are swept"),
        "finish_session": (bool, False, "the client calls /finish_session at the end"),
    }
    idle_s: float
    sweep_s: float
    finish_session: bool

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._sessions: dict[str, tuple[int, float]] = {}  # program → (engine, last seen)
        self._count: dict[int, int] = {}
        self._swept = 0.0

    def _drop(self, program_id: str) -> None:
        engine, _ = self._sessions.pop(program_id)
        self._count[engine] -= 1

    def _sweep(self, now: float) -> None:
        if now - self._swept < self.sweep_s:
            return
        self._swept = now
        for pid, (_, seen) in list(self._sessions.items()):
            if now - seen > self.idle_s:
                self._drop(pid)

    def joined(self, engine: EngineView, now: float) -> None:
        self._count[engine.engine_id] = 0

    def left(self, engine: EngineView, now: float) -> None:
        for pid, (eid, _) in list(self._sessions.items()):
            if eid == engine.engine_id:
                self._drop(pid)
        del self._count[engine.engine_id]

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        self._sweep(request.now)
        pid = request.program_id
        bound = self._sessions.get(pid)
        if bound is not None:
            engine = next((e for e in engines if e.engine_id == bound[0]), None)
            if engine is not None:
                self._sessions[pid] = (bound[0], request.now)
                return engine
            self._drop(pid)
        engine = min(
            engines,
            key=lambda e: (self._count[e.engine_id], -stable_hash(f"{pid}|{e.name}")),
        )
        self._sessions[pid] = (engine.engine_id, request.now)
        self._count[engine.engine_id] += 1
        return engine

    def program_ended(self, program_id: str, now: float) -> None:
        if self.finish_session and program_id in self._sessions:
            self._drop(program_id)

    def binding(self, program_id: str, now: float) -> int | None:
        bound = self._sessions.get(program_id)
        return bound[0] if bound is not None else None


class TreeRouter(Router):
    """The cache_aware algorithm shared by vllm-router and SGLang's gateway: a per-worker
    index of request text (here: how many tokens of each program's prompt a worker saw).

    Balanced: the worker with the highest prefix match if the match ratio exceeds
    ``cache_threshold``, else the worker with the smallest index. Imbalanced (in-flight
    requests ``max - min > balance_abs`` and ``max > min * balance_rel``): the worker with
    the fewest in flight. The chosen worker's index takes the prompt either way."""

    PARAMS: ClassVar[Params] = {
        "cache_threshold": (float, 0.3, "--cache-threshold"),
        "balance_abs": (int, 64, "--balance-abs-threshold"),
        "balance_rel": (float, 1.5, "--balance-rel-threshold"),
    }
    cache_threshold: float
    balance_abs: int
    balance_rel: float

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._index: dict[int, dict[str, tuple[int, float]]] = {}  # engine → program → (tokens, t)
        self._sizes: dict[int, int] = {}

    def joined(self, engine: EngineView, now: float) -> None:
        self._index[engine.engine_id] = {}
        self._sizes[engine.engine_id] = 0

    def left(self, engine: EngineView, now: float) -> None:
        del self._index[engine.engine_id]
        del self._sizes[engine.engine_id]

    def insert(self, engine_id: int, program_id: str, tokens: int, now: float) -> None:
        old = self._index[engine_id].get(program_id)
        self._sizes[engine_id] += tokens - (old[0] if old is not None else 0)
        self._index[engine_id][program_id] = (tokens, now)

    def matched(self, engine_id: int, program_id: str, now: float) -> int:
        entry = self._index[engine_id].get(program_id)
        return entry[0] if entry is not None else 0

    def size(self, engine_id: int, now: float) -> float:
        return float(self._sizes[engine_id])

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        self.maintain(request.now)
        loads = [e.inflight() for e in engines]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            choice = least(engines, lambda e: e.inflight())
        else:
            best = max(
                engines,
                key=lambda e: (
                    self.matched(e.engine_id, request.program_id, request.now),
                    -e.engine_id,
                ),
            )
            ratio = (
                self.matched(best.engine_id, request.program_id, request.now)
                / request.prompt_tokens
            )
            if ratio > self.cache_threshold:
                choice = best
            else:
                choice = least(engines, lambda e: self.size(e.engine_id, request.now))
        self.insert(choice.engine_id, request.program_id, request.prompt_tokens, request.now)
        return choice

    def maintain(self, now: float) -> None:
        """Eviction of old index entries (each router's own rule)."""

    def binding(self, program_id: str, now: float) -> int | None:
        best = max(self._index, key=lambda e: (self.matched(e, program_id, now), -e), default=None)
        if best is None or self.matched(best, program_id, now) == 0:
            return None
        return best


@register_router
class CacheAware(TreeRouter):
    name = "cache_aware"
    help = "vllm-router cache_aware: approximate radix tree per worker, 0.3 / 64 / 1.5, LRU at 2^25"
    PARAMS: ClassVar[Params] = {
        **TreeRouter.PARAMS,
        "eviction_interval_s": (float, 120.0, "--eviction-interval-secs"),
        "max_tree_chars": (int, 33554432, "--max-tree-size (characters per worker)"),
        "chars_per_token": (float, 4.0, "characters of request text per token"),
    }
    eviction_interval_s: float
    max_tree_chars: int
    chars_per_token: float

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._evicted = 0.0

    def maintain(self, now: float) -> None:
        if now - self._evicted < self.eviction_interval_s:
            return
        self._evicted = now
        budget = self.max_tree_chars / self.chars_per_token
        for engine_id, index in self._index.items():
            total = sum(t for t, _ in index.values())
            for pid, (tokens, _) in sorted(index.items(), key=lambda kv: kv[1][1]):
                if total <= budget:
                    break
                total -= tokens
                del index[pid]
            self._sizes[engine_id] = total
