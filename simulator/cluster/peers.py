"""The other routers of the field: Dynamo 1.6.1's KV router with session affinity,
llm-d's EPP scorers, SGLang's gateway (smg 1.13.0) cache_aware with a TTL'd placement
index. Sources: Dynamo's router flags in the ``ai-dynamo-runtime`` 1.6.1 wheel
(``common/configuration/groups/{router,kv_router}_args.py``), llm-d's scorers
(llm-d/llm-d-router v0.10.0, ``pkg/epp/framework/plugins/scheduling/scorer/``) and SGLang's
gateway flags in the ``smg`` 1.13.0 wheel (``smg/router_args.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from simulator.cluster.base import EngineView, Params, Router, TurnRequest, least, register_router
from simulator.cluster.vllm_router import TreeRouter

__all__ = ["DynamoKv", "LlmdScorers", "SglangCacheAware"]


@register_router
class DynamoKv(Router):
    """Lowest cost wins (temperature 0): ``prefill_load_scale`` × (the worker's active
    prompt work in blocks + the request's blocks − its overlapping cached blocks ×
    ``overlap_score_credit``) + the worker's active decode blocks. Overlap is exact (KV
    events: pinned or cached). Session affinity (``X-Dynamo-Session-ID``) with a
    router-local idle TTL: ``hard`` sends a bound session to its worker, an exact
    constraint; ``soft`` (a "policy-visible preference"; its cost term is not published)
    credits the bound worker with the request's whole prompt as if it overlapped.

    Signals: no engine metric. The prompt work and the decode blocks are the router's own
    count of the requests it sent and that are not done (``lib/kv-router``'s active
    sequences; here :meth:`EngineView.queued_tokens` and :meth:`EngineView.active_blocks`,
    the blocks running requests hold, pins excluded); the overlap comes from the engines' KV
    events (stored blocks, pinned ones included: :meth:`EngineView.cached_tokens`). So what
    an engine publishes as ``vllm:kv_cache_usage_perc``, and whether it counts pins
    (``pins_in_kv_usage``), does not reach this router."""

    name = "dynamo"
    help = "Dynamo KV router cost; affinity=none|hard|soft with an idle TTL (ttl_s)"
    PARAMS: ClassVar[Params] = {
        "affinity": (str, "none", "--router-session-affinity-mode (none: flag omitted)"),
        "ttl_s": (float, 30.0, "--router-session-affinity-ttl-secs (idle)"),
        "prefill_load_scale": (float, 1.0, "router policy config"),
        "overlap_credit": (float, 1.0, "overlap_score_credit"),
    }
    affinity: str
    ttl_s: float
    prefill_load_scale: float
    overlap_credit: float

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        if self.affinity not in ("none", "hard", "soft"):
            raise ValueError(
                f"router 'dynamo': affinity must be none, hard or soft, got {self.affinity!r}"
            )
        self._bound: dict[str, tuple[int, float]] = {}

    def _cost(self, e: EngineView, request: TurnRequest, bound: int | None) -> float:
        size = e.block_size()
        overlap = min(e.cached_tokens(request.program_id), request.prompt_tokens) // size
        if bound == e.engine_id and self.affinity == "soft":
            overlap = -(-request.prompt_tokens // size)
        blocks = -(-request.prompt_tokens // size)
        prefill = e.queued_tokens() / size + blocks - overlap * self.overlap_credit
        return self.prefill_load_scale * prefill + e.active_blocks()

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        bound = self.binding(request.program_id, request.now)
        choice = None
        if bound is not None and self.affinity == "hard":
            choice = next((e for e in engines if e.engine_id == bound), None)
        if choice is None:
            choice = least(engines, lambda e: self._cost(e, request, bound))
        if self.affinity != "none":
            self._bound[request.program_id] = (choice.engine_id, request.now)
        return choice

    def turn_finished(self, engine: EngineView, program_id: str, context: int, now: float) -> None:
        if program_id in self._bound:  # idle counts from the end of the response
            self._bound[program_id] = (engine.engine_id, now)

    def left(self, engine: EngineView, now: float) -> None:
        self._bound = {p: b for p, b in self._bound.items() if b[0] != engine.engine_id}

    def binding(self, program_id: str, now: float) -> int | None:
        bound = self._bound.get(program_id)
        if bound is None or now - bound[1] > self.ttl_s:
            return None
        return bound[0]


@register_router
class LlmdScorers(Router):
    """The EPP's weighted scorers, highest total wins (ties: lowest id): session affinity
    (``session_id_header``: 1 for the session's pod; an unbound session is bound to the pod
    with the fewest bound sessions; binding evicted after 600 s idle), approximate prefix
    (matched share of the prompt from the router's own index of what it sent where) and
    queue depth (``(max - q) / (max - min)`` of waiting requests, 1 when all equal). The
    guide's weights are prefix 3 and queue 2; session affinity keeps the plugin default 1.

    Signals: the queue scorer reads ``vllm:num_requests_waiting`` scraped from each pod
    (the scorers directory above; here :meth:`EngineView.waiting_count`). The
    kv-cache-utilization scorer, which reads ``vllm:kv_cache_usage_perc``, is not among the
    guide's scorers, so pins counted in the KV
    usage or not (``pins_in_kv_usage``) change nothing here; the prefix scorer is the
    router's own index."""

    name = "llm-d"
    help = "llm-d EPP: session-affinity 1 + prefix 3 + queue 2 scorers, binding idle TTL 600 s"
    PARAMS: ClassVar[Params] = {
        "affinity_weight": (float, 1.0, "session-affinity-scorer weight"),
        "prefix_weight": (float, 3.0, "prefix scorer weight"),
        "queue_weight": (float, 2.0, "queue scorer weight"),
        "eviction_ttl_s": (float, 600.0, "evictionTtlSeconds"),
    }
    affinity_weight: float
    prefix_weight: float
    queue_weight: float
    eviction_ttl_s: float

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._bound: dict[str, tuple[int, float]] = {}
        self._sessions: dict[int, int] = {}
        self._prefix: dict[str, tuple[int, int]] = {}  # program → (engine, tokens sent)

    def joined(self, engine: EngineView, now: float) -> None:
        self._sessions[engine.engine_id] = 0

    def left(self, engine: EngineView, now: float) -> None:
        for pid, (eid, _) in list(self._bound.items()):
            if eid == engine.engine_id:
                self._unbind(pid)
        del self._sessions[engine.engine_id]

    def _unbind(self, program_id: str) -> None:
        eid, _ = self._bound.pop(program_id)
        if eid in self._sessions:
            self._sessions[eid] -= 1

    def binding(self, program_id: str, now: float) -> int | None:
        bound = self._bound.get(program_id)
        if bound is None:
            return None
        if now - bound[1] > self.eviction_ttl_s:
            self._unbind(program_id)
            return None
        return bound[0]

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        pid = request.program_id
        bound = self.binding(pid, request.now)
        if bound is None or bound not in self._sessions:
            bound = least(engines, lambda e: self._sessions[e.engine_id]).engine_id
        waiting = {e.engine_id: e.waiting_count() for e in engines}
        high, low = max(waiting.values()), min(waiting.values())
        sent = self._prefix.get(pid)

        def score(e: EngineView) -> float:
            queue = 1.0 if high == low else (high - waiting[e.engine_id]) / (high - low)
            prefix = 0.0
            if sent is not None and sent[0] == e.engine_id:
                prefix = min(sent[1], request.prompt_tokens) / request.prompt_tokens
            affinity = 1.0 if e.engine_id == bound else 0.0
            return (
                self.affinity_weight * affinity
                + self.prefix_weight * prefix
                + self.queue_weight * queue
            )

        choice = max(engines, key=lambda e: (score(e), -e.engine_id))
        if pid in self._bound:
            self._unbind(pid)
        self._bound[pid] = (choice.engine_id, request.now)
        self._sessions[choice.engine_id] += 1
        self._prefix[pid] = (choice.engine_id, request.prompt_tokens)
        return choice

    def turn_finished(self, engine: EngineView, program_id: str, context: int, now: float) -> None:
        if program_id in self._bound:
            self._bound[program_id] = (self._bound[program_id][0], now)


@register_router
class SglangCacheAware(TreeRouter):
    """smg's cache_aware with ``--cache-index hash``: an exact-match placement map whose
    entries live ``cache_ttl_s`` (180 s) after their last placement, "approximating the
    engines' cache retention"; the smallest index is the one with the fewest live entries."""

    name = "sglang"
    help = "SGLang gateway cache_aware, hash index with placement TTL 180 s, 0.3 / 64 / 1.5"
    PARAMS: ClassVar[Params] = {
        **TreeRouter.PARAMS,
        "cache_ttl_s": (float, 180.0, "--cache-ttl-secs"),
        "eviction_interval_s": (float, 60.0, "--eviction-interval-secs"),
    }
    cache_ttl_s: float
    eviction_interval_s: float
    _swept = 0.0

    def matched(self, engine_id: int, program_id: str, now: float) -> int:
        entry = self._index[engine_id].get(program_id)
        if entry is None or now - entry[1] > self.cache_ttl_s:
            return 0
        return entry[0]

    def size(self, engine_id: int, now: float) -> float:
        return float(len(self._index[engine_id]))

    def maintain(self, now: float) -> None:
        if now - self._swept < self.eviction_interval_s:
            return
        self._swept = now
        for engine_id, index in self._index.items():
            for pid in [p for p, (_, t) in index.items() if now - t > self.cache_ttl_s]:
                self._sizes[engine_id] -= index.pop(pid)[0]
