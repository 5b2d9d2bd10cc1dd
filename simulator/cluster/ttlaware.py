"""TTL-aware routing: the router follows the engines' pins.

Per program the router knows its pin's holder and expiry (the engines' pin events) and the
engine that served its last turn. For each turn:

1. **Live pin** on engine ``h``: go to ``h`` unless ``wait(h) - wait(b) > prefill(T)``,
   where ``b`` is the engine (other than ``h``) with the shortest expected wait, ``T`` the
   pinned tokens and ``prefill(T)`` the time to recompute them on ``b``. Expected wait is
   the engine's queued prompt tokens at its prefill rate. When it goes to ``b``, ``h``
   drops the pin at once (not at its expiry).
2. **No live pin**: every engine costs ``wait(e) + prefill(prompt - credit(e))``; the
   engine that last held or served the program gets a prefix credit of its context that
   decays as ``exp(-age / credit_decay_s)`` from the pin's end (or the turn's end when it
   was not pinned); the lowest cost wins, ties to the most free KV.
3. **New program**: the engine with the most KV neither used nor pinned (ties: the fewest
   queued tokens, then the lowest id).
4. **Topology**: a joining engine takes new programs only; live pins are never remapped.
   A leaving engine's programs follow rule 2 on their next turn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from simulator.cluster.base import EngineView, Params, Route, Router, register_router

__all__ = ["TtlAware"]


@register_router
class TtlAware(Router):
    name = "ttl-aware"
    help = "back to the pin's holder while it lives unless the wait costs more than a recompute"
    PARAMS: ClassVar[Params] = {
        "credit_decay_s": (float, 60.0, "time constant of the prefix credit after a pin ends"),
        "drop": (bool, True, "the holder drops the pin when the router sends the turn elsewhere"),
    }
    credit_decay_s: float
    drop: bool

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self._last: dict[str, tuple[int, float, int]] = {}  # program → (engine, since, tokens)

    @staticmethod
    def wait(e: EngineView) -> float:
        return e.prefill_s(e.queued_tokens())

    def route(self, request: Route, engines: Sequence[EngineView]) -> EngineView:
        pid = request.program_id
        if request.turn == 0:
            return min(engines, key=lambda e: (-e.free_blocks(), e.queued_tokens(), e.engine_id))
        last = self._last.get(pid)
        holder = next((e for e in engines if last and e.engine_id == last[0]), None)
        if holder is not None and holder.pin_of(pid) is not None:
            others = [e for e in engines if e is not holder]
            if not others:
                return holder
            best = min(others, key=lambda e: (self.wait(e), e.engine_id))
            pinned = holder.cached_tokens(pid)
            if self.wait(holder) - self.wait(best) <= best.prefill_s(pinned):
                return holder
            if self.drop and self.host is not None:
                self.host.drop_pin(holder.engine_id, pid)
            return best
        return min(engines, key=lambda e: (self._cost(e, request), -e.free_blocks(), e.engine_id))

    def _cost(self, e: EngineView, request: Route) -> float:
        credit = 0.0
        last = self._last.get(request.program_id)
        if last is not None and last[0] == e.engine_id:
            age = max(0.0, request.now - last[1])
            credit = min(last[2], request.context_tokens) * math.exp(-age / self.credit_decay_s)
        return self.wait(e) + e.prefill_s(max(0, int(request.prompt_tokens - credit)))

    def turn_finished(self, engine: EngineView, program_id: str, context: int, now: float) -> None:
        self._last[program_id] = (engine.engine_id, now, context)

    def pin_ended(self, engine: EngineView, program_id: str, now: float) -> None:
        last = self._last.get(program_id)
        if last is not None and last[0] == engine.engine_id:
            self._last[program_id] = (last[0], now, last[2])

    def program_ended(self, program_id: str, now: float) -> None:
        self._last.pop(program_id, None)

    def binding(self, program_id: str, now: float) -> int | None:
        if self.host is None:
            return None
        last = self._last.get(program_id)
        if last is None:
            return None
        engine = self.host.engine(last[0])
        if engine is not None and engine.pin_of(program_id) is not None:
            return last[0]
        return None
