"""The TTL-aware router's state around the rule, whatever router hosts it.

:func:`enginehook.routing.rule.route` is a pure function; a router keeps, besides, where each
program last ran and the routes since each replica's stats (:class:`Memory`), its latest
decisions, and the drops of the pins rule 1 escapes (:class:`Drops`). :class:`TtlRouter`
is that state, fed the replicas' published stats and the clock by its host: Ray Serve's
``RequestRouter`` (:mod:`enginehook.routing.ray`, drops posted over HTTP by
:class:`~enginehook.routing.drops.PinDrops`) and the simulator's ``ttl-aware`` router
(``simulator/cluster/ttlaware.py``, drops applied to the simulated holder) are thin
adapters over it, and a test drives it without either.

>>> router = TtlRouter.from_kwargs({"credit_decay_s": 30.0})
>>> router.decide([("r1", None), ("r2", None)], "p", now=0.0).ranked
('r1', 'r2')
>>> TtlRouter.from_kwargs({"credit_decay": 30.0})
Traceback (most recent call last):
...
ValueError: request_router_kwargs: unknown ['credit_decay'] (known: credit_decay_s, ...)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from enginehook.core.tokens import read_token
from enginehook.routing.drops import PinDrops
from enginehook.routing.rule import (
    MAX_REPLICAS,
    STATS_KEY,
    Memory,
    ReplicaView,
    Route,
    route,
)
from enginehook.routing.stats import view_of

__all__ = ["KWARGS", "Drops", "TtlRouter"]

#: The router's settings and their defaults (Ray Serve's ``request_router_kwargs``).
#: ``pin_token_file``: a file holding the hooks' pin-command token (their ``pin_command_token``),
#: read once (empty: no token);
#: ``step_wait``: waits add half the step each replica publishes it is running.
KWARGS: Mapping[str, Any] = {
    "credit_decay_s": 60.0,
    "prefill_tokens_per_s": 1_000.0,
    "pin_token_file": "",
    "step_wait": False,
}
#: Decisions kept for :attr:`TtlRouter.decisions`.
DECISIONS_KEPT = 256


class Drops(Protocol):
    """Where the drops of the pins rule 1 escapes go (the shape of
    :class:`~enginehook.routing.drops.PinDrops`)."""

    def escaped(
        self, program: str, holder: str, *, endpoint: str | None, expires_at: float
    ) -> str: ...
    def counts(self) -> dict[str, int]: ...


class TtlRouter:
    """The rules of :mod:`enginehook.routing.rule` over the replicas' published stats, with
    the router's memory, its latest :attr:`decisions`, and the drop of every live pin rule
    1 escapes posted to its holder's ``pin_endpoint`` off the decision's path
    (:attr:`drops` counts the outcomes)."""

    def __init__(
        self,
        credit_decay_s: float = KWARGS["credit_decay_s"],
        prefill_tokens_per_s: float = KWARGS["prefill_tokens_per_s"],
        pin_drops: Drops | None = None,
        step_wait: bool = KWARGS["step_wait"],
    ) -> None:
        for name, value in (
            ("credit_decay_s", credit_decay_s),
            ("prefill_tokens_per_s", prefill_tokens_per_s),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"request_router_kwargs.{name} must be > 0, got {value!r}")
        if not isinstance(step_wait, bool):
            raise ValueError(f"request_router_kwargs.step_wait must be a bool, got {step_wait!r}")
        self.step_wait = step_wait
        self.credit_decay_s = float(credit_decay_s)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.pin_drops: Drops = pin_drops if pin_drops is not None else PinDrops()
        self.memory = Memory()
        #: Per replica: the stats last read, their ``at`` and the view read from them.
        self._views: dict[str, tuple[Mapping[str, Any] | None, object, ReplicaView]] = {}
        #: The latest decisions, newest last (what a test or an operator reads).
        self.decisions: list[tuple[str | None, Route]] = []

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> TtlRouter:
        """A router from ``request_router_kwargs`` (:data:`KWARGS`); an unknown name, a
        value not > 0 or an unreadable or empty token file raise naming it."""
        unknown = sorted(set(kwargs) - set(KWARGS))
        if unknown:
            raise ValueError(
                f"request_router_kwargs: unknown {unknown} (known: {', '.join(KWARGS)})"
            )
        values = {**KWARGS, **kwargs}
        token_file = values.pop("pin_token_file")
        token = _read_token(token_file) if token_file else ""
        return cls(**values, pin_drops=PinDrops(token=token))

    @property
    def drops(self) -> dict[str, int]:
        """How the drops of escaped pins went, by outcome
        (:data:`~enginehook.routing.drops.OUTCOMES`)."""
        return self.pin_drops.counts()

    def decide(
        self,
        replicas: Iterable[tuple[str, Mapping[str, Any] | None]],
        program: str | None,
        now: float,
        prompt_tokens: int | None = None,
    ) -> Route:
        """The rule over ``replicas`` (each ``(replica_id, routing_stats)``) for a request of
        ``program`` at ``now`` (the replicas' clock: Unix seconds); records the live pins
        seen, and queues the drop of an escaped pin."""
        views = self.memory.current([self._view(rid, stats, now) for rid, stats in replicas])
        decision = route(
            program,
            views,
            now,
            last=self.memory.get(program),
            prompt_tokens=prompt_tokens,
            credit_decay_s=self.credit_decay_s,
            step_wait=self.step_wait,
        )
        self.decisions = [*self.decisions[-(DECISIONS_KEPT - 1) :], (program, decision)]
        if decision.drop_from is not None and program is not None:
            holder = next(v for v in views if v.replica_id == decision.drop_from)
            pin = holder.live_pin(program, now)
            assert pin is not None  # rule 1 escapes live pins only
            self.pin_drops.escaped(
                program, holder.replica_id, endpoint=holder.pin_endpoint, expires_at=pin.expires_at
            )
        return decision

    def routed(self, program: str | None, replica_id: str, now: float, tokens: int = 0) -> None:
        """A request of ``program`` was sent to ``replica_id`` (:meth:`Memory.routed`)."""
        self.memory.routed(program, replica_id, now, tokens=tokens)

    def _view(self, replica_id: str, stats: Mapping[str, Any] | None, now: float) -> ReplicaView:
        """The replica's view, read from ``stats`` once: while a replica publishes the same
        stats its view is kept, so a decision costs nothing per published pin. The same
        stats are the same mapping with the same ``at`` (a host that updates one mapping in
        place must change its ``at``), or an equal mapping: Ray hands every replica's stats
        over anew at each broadcast, changed or not, and comparing them costs far less than
        reading them."""
        stamp = _stamp(stats)
        held = self._views.get(replica_id)
        if held is not None:
            kept, kept_stamp, kept_view = held
            if (kept_stamp == stamp) if kept is stats else (kept == stats):
                self._views[replica_id] = (stats, stamp, kept_view)
                return kept_view
        view = view_of(replica_id, stats, self.prefill_tokens_per_s)
        self.memory.observe(view, now, before=held[2] if held is not None else None)
        self._views.pop(replica_id, None)
        self._views[replica_id] = (stats, stamp, view)  # most recently read last
        if len(self._views) > MAX_REPLICAS:  # replicas long gone: the one read longest ago
            del self._views[next(iter(self._views))]
        return view


def _stamp(stats: Mapping[str, Any] | None) -> object:
    """When ``stats`` were taken (their ``at``), as published."""
    block = stats.get(STATS_KEY) if isinstance(stats, Mapping) else None
    return block.get("at") if isinstance(block, Mapping) else None


def _read_token(path: object) -> str:
    where = "request_router_kwargs.pin_token_file"
    if not isinstance(path, str):
        raise ValueError(f"{where} must be a path string, got {path!r}")
    return read_token(path, where)
