"""TTL-aware routing in the simulated cluster: the router Ray Serve runs, hosted here.

The rule is :mod:`enginehook.routing.rule` and the state around it (where each program last
ran, the routes since each replica's stats, the drops of escaped pins) is
:class:`enginehook.routing.router.TtlRouter`, the object :mod:`enginehook.routing.ray` wraps:
this module holds no copy of either. As ``simulator/sim.py`` hosts the engine hook's
:class:`PinController`, :class:`TtlAware` hosts the router: at every turn each live engine
publishes the routing stats a CacheTTL replica publishes
(:meth:`~simulator.cluster.engines.ClusterEngine.routing_stats`, taken at that instant, so
they are never stale), the router decides from them, and the turn goes to the replica it
ranks first. When rule 1 sends a turn away from the pin's holder, the holder drops the pin
at once (Ray's router posts the drop to the holder's hook; here the cluster applies it),
unless ``drop=false``.

What the router knows is what it reads from the stats and its own routes: it does not hear
turns finish or programs end. A pin's prefix credit decays from the pin's published expiry,
or from the first stats without it (a decision's instant here), or from the program's last
routing when it was never pinned; a pin past its expiry that its engine has not released
yet no longer binds (rule 2 applies).

``step_wait=true`` adds half of each engine's running step to the waits (its published
``step_s``: one token for each running request over the KV they hold; 0 on an engine that
runs nothing), so a first turn goes to an idle engine before one mid-step. It is off by
default: the idle engine is the one whose bound programs are all away, and they come back
(``results/cluster_step_wait_*.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from enginehook.routing.router import TtlRouter
from simulator.cluster.base import EngineView, Params, Router, TurnRequest, register_router

__all__ = ["TtlAware"]


class _HostDrops:
    """Rule 1's escapes in the simulator: the holder drops the pin at once (``drop``), or
    keeps it to its expiry. Counts the outcomes as :class:`PinDrops` does."""

    def __init__(self, router: TtlAware) -> None:
        self.router = router
        self._counts: dict[str, int] = {}

    def escaped(self, program: str, holder: str, *, endpoint: str | None, expires_at: float) -> str:
        host = self.router.host
        engine = self.router.engines.get(holder)
        outcome = "kept"
        if self.router.drop and host is not None and engine is not None:
            host.drop_pin(engine.engine_id, program)
            outcome = "dropped"
        self._counts[outcome] = self._counts.get(outcome, 0) + 1
        return outcome

    def counts(self) -> dict[str, int]:
        return dict(self._counts)


@register_router
class TtlAware(Router):
    name = "ttl-aware"
    help = "back to the pin's holder while it lives unless the wait costs more than a recompute"
    PARAMS: ClassVar[Params] = {
        "credit_decay_s": (float, 60.0, "time constant of the prefix credit after a pin ends"),
        "drop": (bool, True, "the holder drops the pin when the router sends the turn elsewhere"),
        "step_wait": (bool, False, "the wait adds half the step the engine is running"),
    }
    credit_decay_s: float
    drop: bool
    step_wait: bool

    def __init__(self, seed: int = 0, **params: object) -> None:
        super().__init__(seed, **params)
        self.router = TtlRouter(
            self.credit_decay_s, pin_drops=_HostDrops(self), step_wait=self.step_wait
        )
        #: Every engine a decision saw, by replica id.
        self.engines: dict[str, EngineView] = {}

    def route(self, request: TurnRequest, engines: Sequence[EngineView]) -> EngineView:
        now, program = request.now, request.program_id
        live = {e.replica_id: e for e in engines}
        self.engines.update(live)
        stats = [(rid, e.routing_stats(now)) for rid, e in live.items()]
        decision = self.router.decide(stats, program, now, prompt_tokens=request.prompt_tokens)
        chosen = decision.ranked[0]
        self.router.routed(program, chosen, now, tokens=request.prompt_tokens)
        return live[chosen]

    def binding(self, program_id: str, now: float) -> int | None:
        """The engine holding the program's live pin, where rule 1 sends its next turn."""
        last = self.router.memory.get(program_id)
        engine = self.engines.get(last.replica_id) if last is not None else None
        if engine is None or self.host is None or self.host.engine(engine.engine_id) is None:
            return None
        pin = engine.pin_of(program_id)
        return engine.engine_id if pin is not None and pin.expires_at > now else None
