"""The TTL-aware routing rule as a pure function of what the replicas publish.

Each replica publishes (:func:`replica_stats`) its live pins ``{program: (expires_at,
tokens)}``, its KV neither used nor pinned, its queued prompt tokens and its prefill rate.
The router keeps, per program, where it last ran (:class:`Memory`). For one request:

1. **Live pin** on replica ``h`` (a published pin whose ``expires_at`` is after ``now``): go
   to ``h`` unless ``wait(h) - wait(b) > prefill_b(T)``, where ``b`` is the other replica with
   the shortest expected wait (queued tokens at its prefill rate) and ``T`` the pinned
   tokens. When the turn goes to ``b``, ``h`` must drop the pin at once
   (:attr:`Route.drop_from`; the engines' pin coherence through the control plane does it).
2. **No live pin**, the program ran before: every replica costs ``wait(e) +
   prefill_e(prompt - credit(e))``; the replica it last ran on gets a prefix credit of its
   context that decays as ``exp(-age / credit_decay_s)`` from when its pin was last seen
   alive (or from its last routing when it was never pinned); the lowest cost wins, ties
   to the most free KV.
3. **New program** (no pin, never seen): the replica with the most KV neither used nor
   pinned (ties: the fewest queued tokens, then the lowest id).
4. **Topology**: the holder is read from the published pins, not from a hash of the
   replica set, so a replica that joins takes new programs only and live pins are never
   remapped; a replica that leaves takes its pins with it (rule 2 on the next turn).

The same rule as the simulator's ``ttl-aware`` router (``simulator/cluster/ttlaware.py``).
Nothing here reads a clock or imports Ray.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from enginehook.core.lifecycle import PinController

__all__ = [
    "STATS_KEY",
    "Last",
    "Memory",
    "PinView",
    "ReplicaView",
    "Route",
    "replica_stats",
    "route",
    "view_of",
]

#: The key of the routing stats a CacheTTL replica publishes (other keys are left alone).
STATS_KEY = "cachettl"
#: Programs a :class:`Memory` keeps (the least recently seen go first).
MAX_PROGRAMS = 65_536


@dataclass(frozen=True, slots=True)
class PinView:
    """One published pin: when it expires (seconds, the replicas' clock) and its tokens."""

    expires_at: float
    tokens: int


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one replica."""

    replica_id: str
    free_tokens: int = 0
    queued_tokens: int = 0
    prefill_tokens_per_s: float = 1_000.0
    pins: Mapping[str, PinView] = field(default_factory=dict)

    def wait_s(self) -> float:
        """Expected wait: the queued prompt tokens at the prefill rate."""
        return self.prefill_s(self.queued_tokens)

    def prefill_s(self, tokens: float) -> float:
        return max(0.0, tokens) / self.prefill_tokens_per_s

    def live_pin(self, program: str, now: float) -> PinView | None:
        pin = self.pins.get(program)
        return pin if pin is not None and pin.expires_at > now else None


@dataclass(frozen=True, slots=True)
class Last:
    """Where a program last ran, since when it is not known to hold a pin there, and the
    context tokens it left there."""

    replica_id: str
    since: float
    tokens: int


@dataclass(frozen=True, slots=True)
class Route:
    """A decision: replica ids best first, the rule that chose, the replica that must drop
    the program's pin (``None``: none)."""

    ranked: tuple[str, ...]
    rule: str
    drop_from: str | None = None


def _check_views(replicas: Sequence[ReplicaView]) -> None:
    if not replicas:
        raise ValueError("replicas: at least one replica is needed to route")
    for r in replicas:
        if not r.prefill_tokens_per_s > 0:
            raise ValueError(
                f"prefill_tokens_per_s of {r.replica_id} must be > 0, got {r.prefill_tokens_per_s}"
            )


def route(
    program: str | None,
    replicas: Sequence[ReplicaView],
    now: float,
    *,
    last: Last | None = None,
    prompt_tokens: int | None = None,
    credit_decay_s: float = 60.0,
) -> Route:
    """The replica for one request of ``program`` (``None``: no session, a new program).
    ``prompt_tokens``: the request's prompt when known (else the context it left)."""
    _check_views(replicas)
    if not credit_decay_s > 0:
        raise ValueError(f"credit_decay_s must be > 0, got {credit_decay_s}")
    if program is not None:
        held = [(r, pin) for r in replicas if (pin := r.live_pin(program, now)) is not None]
        if held:
            return _pinned(held, replicas, last)
    if program is None or last is None:
        order = sorted(replicas, key=lambda r: (-r.free_tokens, r.queued_tokens, r.replica_id))
        return Route(tuple(r.replica_id for r in order), "new")
    prompt = prompt_tokens if prompt_tokens is not None else last.tokens

    def cost(r: ReplicaView) -> tuple[float, int, str]:
        credit = 0.0
        if r.replica_id == last.replica_id:
            age = max(0.0, now - last.since)
            credit = min(last.tokens, prompt) * math.exp(-age / credit_decay_s)
        return (r.wait_s() + r.prefill_s(prompt - credit), -r.free_tokens, r.replica_id)

    order = sorted(replicas, key=cost)
    return Route(tuple(r.replica_id for r in order), "credit")


def _pinned(
    held: list[tuple[ReplicaView, PinView]], replicas: Sequence[ReplicaView], last: Last | None
) -> Route:
    # One pin per program; should two replicas publish one (a stale view), the replica it
    # last ran on, else the later expiry, is the holder.
    holder, pin = max(
        held,
        key=lambda hp: (last is not None and hp[0].replica_id == last.replica_id, hp[1].expires_at),
    )
    others = sorted(
        (r for r in replicas if r is not holder), key=lambda r: (r.wait_s(), r.replica_id)
    )
    if not others:
        return Route((holder.replica_id,), "pin")
    best = others[0]
    if holder.wait_s() - best.wait_s() <= best.prefill_s(pin.tokens):
        return Route((holder.replica_id, *(r.replica_id for r in others)), "pin")
    ranked = (*(r.replica_id for r in others), holder.replica_id)
    return Route(ranked, "escape", drop_from=holder.replica_id)


class Memory:
    """Per program, the replica it last ran on (the router's own state; bounded)."""

    def __init__(self, max_programs: int = MAX_PROGRAMS) -> None:
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.max_programs = max_programs
        self._last: OrderedDict[str, Last] = OrderedDict()

    def get(self, program: str | None) -> Last | None:
        return self._last.get(program) if program is not None else None

    def __len__(self) -> int:
        return len(self._last)

    def _put(self, program: str, last: Last) -> None:
        self._last.pop(program, None)
        self._last[program] = last
        while len(self._last) > self.max_programs:
            self._last.popitem(last=False)

    def observe(self, replicas: Iterable[ReplicaView], now: float) -> None:
        """Live pins seen now: their holder is where the program last ran, and its credit
        starts decaying no earlier than now (or the pin's expiry, if sooner)."""
        for r in replicas:
            for program, pin in r.pins.items():
                if pin.expires_at > now:
                    self._put(program, Last(r.replica_id, min(now, pin.expires_at), pin.tokens))

    def routed(self, program: str | None, replica_id: str, now: float, tokens: int = 0) -> None:
        """A request of ``program`` was sent to ``replica_id``: the context it leaves there is
        what it had (its last known context, or ``tokens``, whichever is larger)."""
        if program is None:
            return
        before = self._last.get(program)
        kept = before.tokens if before is not None else 0
        self._put(program, Last(replica_id, now, max(kept, tokens)))

    def forget(self, program: str) -> None:
        self._last.pop(program, None)


def replica_stats(
    controller: PinController[Any],
    *,
    free_tokens: int,
    queued_tokens: int,
    prefill_tokens_per_s: float,
    tokens_per_block: int,
) -> dict[str, Any]:
    """The routing stats a replica publishes from its pin controller (the same object the
    engine hook runs): ``{STATS_KEY: {...}}``, JSON-ready. ``free_tokens``: KV neither used
    nor pinned."""
    pins = {p.program_id: [p.expires_at, p.blocks * tokens_per_block] for p in controller.pins}
    return {
        STATS_KEY: {
            "pins": pins,
            "free_tokens": int(free_tokens),
            "pinned_tokens": controller.pins.pinned_blocks * tokens_per_block,
            "queued_tokens": int(queued_tokens),
            "prefill_tokens_per_s": float(prefill_tokens_per_s),
        }
    }


def view_of(
    replica_id: str, stats: Mapping[str, Any] | None, default_prefill_tokens_per_s: float
) -> ReplicaView:
    """A replica's view from its published stats (none yet, or not CacheTTL's: an empty
    replica at the default prefill rate). Malformed stats raise naming the field."""
    block = (stats or {}).get(STATS_KEY)
    if block is None:
        return ReplicaView(replica_id, prefill_tokens_per_s=default_prefill_tokens_per_s)
    if not isinstance(block, Mapping):
        raise ValueError(f"routing stats of {replica_id}: {STATS_KEY} must be a mapping")
    pins: dict[str, PinView] = {}
    for program, value in dict(block.get("pins") or {}).items():
        try:
            expires_at, tokens = value
            pins[str(program)] = PinView(float(expires_at), int(tokens))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"routing stats of {replica_id}: pins[{program!r}] must be [expires_at, tokens]"
            ) from e
    fields = {}
    for name in ("free_tokens", "queued_tokens"):
        try:
            fields[name] = int(block.get(name, 0))
        except (TypeError, ValueError) as e:
            raise ValueError(f"routing stats of {replica_id}: {name} must be an integer") from e
    rate = float(block.get("prefill_tokens_per_s", default_prefill_tokens_per_s))
    return ReplicaView(replica_id, fields["free_tokens"], fields["queued_tokens"], rate, pins)
