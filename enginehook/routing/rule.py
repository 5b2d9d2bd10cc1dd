"""The TTL-aware routing rule as a pure function of what the replicas publish.

Each replica publishes (:func:`enginehook.routing.stats.replica_stats`, from the
``PinController`` the engine hook runs; read back by
:func:`~enginehook.routing.stats.view_of`) its live pins
``{program: (expires_at, tokens, ahead_tokens)}``, its KV neither used nor pinned, its
running and queued requests, its queued prompt tokens, the programs **bound** to it (those
its controller keeps: running, queued, pinned or away in a tool call, until the program
ends, moves or idles out), the work its own queue order puts ahead of a new program's
turn, its prefill rate and when it took the stats. The router keeps, per
program, where it last ran, and the requests it routed since each replica's stats
(:class:`Memory`; :meth:`Memory.current` adds them to the views).

A turn's **wait** on replica ``e`` is the prefill time of the work ``e`` would serve before
it: the rest of the running prefills and the queued turns ``e``'s own queue order
(``PinController.order_key``) puts first, each less the prefix pinned for it. For a
program pinned on ``e`` that is the pin's ``ahead_tokens``; for any other turn the
replica's ``ahead_tokens``, the work ahead of a program it has never seen (a replica that
publishes no queue view: all its queued prompt tokens, the earlier wait). With
``step_wait`` the wait adds half the step the replica is running (its published ``step_s``:
an engine takes new work only between steps, and a turn arriving at a time unrelated to
them finds half a step left on average). For one request:

1. **Live pin** on replica ``h`` (a published pin whose ``expires_at`` is after ``now``): go
   to ``h`` unless ``wait(h) - wait(b) > prefill_b(T) * (1 + n_b)``, where ``b`` is the other
   replica where the turn would wait least, ``T`` the pinned tokens and ``n_b`` the
   requests running or queued on ``b`` (the recompute delays each of them too). When the
   turn goes to ``b``, ``h`` must drop the pin at once (:attr:`Route.drop_from`: the
   router posts the drop to ``h``'s ``pin_endpoint``, :mod:`enginehook.routing.drops`; the
   engines' pin coherence through the control plane does it too).
2. **No live pin**, the program ran before: every replica costs ``wait(e) +
   prefill_e(prompt - credit(e))``; the replica it last ran on gets a prefix credit of its
   context that decays as ``exp(-age / credit_decay_s)`` from when its pin was last known
   alive (its published expiry, or the time of the first stats that no longer show it), or
   from its last routing when it was never pinned; the lowest cost wins, ties to the most
   free KV.
3. **New program** (no pin, never seen): the shortest wait; ties (idle queues) to the
   fewest bound programs, then the fewest running requests, then the most KV neither used
   nor pinned, then the lowest id.
4. **Topology**: the holder is read from the published pins, not from a hash of the
   replica set, so a replica that joins takes new programs only (with no bound programs it
   wins rule 3's ties) and live pins are never remapped; a replica that leaves takes its
   pins with it (rule 2 on the next turn).

Two hosts run this module: Ray Serve (:mod:`enginehook.routing.ray` over
:class:`~enginehook.routing.router.TtlRouter`) and the simulator's ``ttl-aware`` router
(``simulator/cluster/ttlaware.py``, the same ``TtlRouter`` over stats each simulated engine
publishes with ``replica_stats`` at every decision). A turn with no live pin on ``e``
is charged the wait of a program ``e`` has never seen; for the replica it last ran on, whose
queue order may put it earlier (orders by a program's first arrival), that wait is an upper
bound. The stats are as old as ``at``: :meth:`Memory.current` counts the routes made since
(a new program bound, a request queued, its prompt as work ahead of turns that hold no pin
there). Nothing here reads a clock or imports Ray.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "MAX_REPLICAS",
    "STATS_KEY",
    "Last",
    "Memory",
    "PinView",
    "ReplicaView",
    "Route",
    "route",
]

#: The key of the routing stats a CacheTTL replica publishes (other keys are left alone).
STATS_KEY = "cachettl"
#: Programs a :class:`Memory` keeps (the least recently seen go first).
MAX_PROGRAMS = 65_536
#: Routes a :class:`Memory` keeps per replica to catch stale stats up (at least this many
#: of the newest).
MAX_ROUTES = 4_096
#: Replicas a router keeps anything of (the one heard of longest ago goes first).
MAX_REPLICAS = 4_096


@dataclass(frozen=True, slots=True)
class PinView:
    """One published pin: when it expires (seconds, the replicas' clock), its tokens, and the
    prompt tokens its holder serves before the program's return (``None``: not published)."""

    expires_at: float
    tokens: int
    ahead_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one replica (see the module's rules). ``ahead_tokens``:
    prompt tokens served before a program the replica has never seen (``None``: the replica
    publishes no queue view, the wait counts all of ``queued_tokens``); ``running`` and
    ``waiting``: requests; ``bound``: programs bound to it; ``at``: when the stats were taken
    (``None``: unknown, nothing is added to them); ``pin_endpoint``: where its pin commands
    go (``None``: it cannot be told to drop a pin, :mod:`enginehook.routing.drops`);
    ``step_s``: seconds of the step it is running (0: idle, or not published)."""

    replica_id: str
    free_tokens: int = 0
    queued_tokens: int = 0
    prefill_tokens_per_s: float = 1_000.0
    pins: Mapping[str, PinView] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    bound: int = 0
    ahead_tokens: int | None = None
    at: float | None = None
    pin_endpoint: str | None = None
    step_s: float = 0.0

    def ahead(self, program: str | None, now: float) -> int:
        """Prompt tokens this replica serves before a turn of ``program`` arriving now."""
        pin = self.live_pin(program, now) if program is not None else None
        if pin is not None and pin.ahead_tokens is not None:
            return pin.ahead_tokens
        return self.queued_tokens if self.ahead_tokens is None else self.ahead_tokens

    def wait_s(
        self, program: str | None = None, now: float = 0.0, step_wait: bool = False
    ) -> float:
        """The turn's wait: :meth:`ahead` at the prefill rate, and with ``step_wait`` half
        of :attr:`step_s`."""
        queued = self.prefill_s(self.ahead(program, now))
        return queued + self.step_s / 2 if step_wait else queued

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
    step_wait: bool = False,
) -> Route:
    """The replica for one request of ``program`` (``None``: no session, a new program).
    ``prompt_tokens``: the request's prompt when known (else the context it left);
    ``step_wait``: the waits add half of each replica's running step."""
    _check_views(replicas)
    if not credit_decay_s > 0:
        raise ValueError(f"credit_decay_s must be > 0, got {credit_decay_s}")
    if program is not None:
        held = [(r, pin) for r in replicas if (pin := r.live_pin(program, now)) is not None]
        if held:
            return _pinned(program, held, replicas, now, last, step_wait)
    if program is None or last is None:  # rule 3

        def place(r: ReplicaView) -> tuple[float, int, int, int, str]:
            wait = r.wait_s(program, now, step_wait)
            return (wait, r.bound, r.running, -r.free_tokens, r.replica_id)

        return Route(tuple(r.replica_id for r in sorted(replicas, key=place)), "new")
    prompt = prompt_tokens if prompt_tokens is not None else last.tokens

    def cost(r: ReplicaView) -> tuple[float, int, str]:  # rule 2
        credit = 0.0
        if r.replica_id == last.replica_id:
            age = max(0.0, now - last.since)
            credit = min(last.tokens, prompt) * math.exp(-age / credit_decay_s)
        wait = r.wait_s(program, now, step_wait)
        return (wait + r.prefill_s(prompt - credit), -r.free_tokens, r.replica_id)

    order = sorted(replicas, key=cost)
    return Route(tuple(r.replica_id for r in order), "credit")


def _pinned(
    program: str,
    held: list[tuple[ReplicaView, PinView]],
    replicas: Sequence[ReplicaView],
    now: float,
    last: Last | None,
    step_wait: bool,
) -> Route:
    """Rule 1."""
    # One pin per program; should two replicas publish one (a stale view), the replica it
    # last ran on, else the later expiry, is the holder.
    holder, pin = max(
        held,
        key=lambda hp: (last is not None and hp[0].replica_id == last.replica_id, hp[1].expires_at),
    )
    waits = {r.replica_id: r.wait_s(program, now, step_wait) for r in replicas}
    others = sorted(
        (r for r in replicas if r is not holder), key=lambda r: (waits[r.replica_id], r.replica_id)
    )
    if not others:
        return Route((holder.replica_id,), "pin")
    best = others[0]
    recompute = best.prefill_s(pin.tokens) * (1 + best.running + best.waiting)
    if waits[holder.replica_id] - waits[best.replica_id] <= recompute:
        return Route((holder.replica_id, *(r.replica_id for r in others)), "pin")
    ranked = (*(r.replica_id for r in others), holder.replica_id)
    return Route(ranked, "escape", drop_from=holder.replica_id)


class _Routes:
    """One replica's routes, oldest first, as running totals (requests, programs new
    there, prompt tokens), so that the routes since any time are two lookups: a
    decision costs the same however many routes were made since a replica's stats."""

    __slots__ = ("at", "forgotten", "totals")

    def __init__(self) -> None:
        self.at: list[float] = []
        self.totals: list[tuple[int, int, int]] = []  # up to and including each route
        self.forgotten = (0, 0, 0)  # the totals of the routes dropped past the bound

    def add(self, at: float, new_here: bool, tokens: int, keep: int) -> None:
        requests, new, held = self.totals[-1] if self.totals else self.forgotten
        self.at.append(at)
        self.totals.append((requests + 1, new + new_here, held + tokens))
        if len(self.at) > 2 * keep:  # forget the oldest half: O(1) a route, amortized
            cut = len(self.at) - keep
            self.forgotten = self.totals[cut - 1]
            del self.at[:cut], self.totals[:cut]

    def since(self, at: float) -> tuple[int, int, int]:
        """Requests, programs new there and prompt tokens routed after ``at`` (of those
        kept)."""
        i = bisect_right(self.at, at)
        if i == len(self.at):
            return 0, 0, 0
        before = self.totals[i - 1] if i else self.forgotten
        last = self.totals[-1]
        return last[0] - before[0], last[1] - before[1], last[2] - before[2]


class Memory:
    """Per program, the replica it last ran on, and the latest routes (the router's own
    state; both bounded)."""

    def __init__(self, max_programs: int = MAX_PROGRAMS, max_routes: int = MAX_ROUTES) -> None:
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        if max_routes < 1:
            raise ValueError(f"max_routes must be >= 1, got {max_routes}")
        self.max_programs = max_programs
        self.max_routes = max_routes
        self._last: OrderedDict[str, Last] = OrderedDict()
        self._routes: OrderedDict[str, _Routes] = OrderedDict()  # by replica, newest last

    def get(self, program: str | None) -> Last | None:
        return self._last.get(program) if program is not None else None

    def __len__(self) -> int:
        return len(self._last)

    def _put(self, program: str, last: Last) -> None:
        self._last.pop(program, None)
        self._last[program] = last
        while len(self._last) > self.max_programs:
            self._last.popitem(last=False)

    def observe(self, view: ReplicaView, now: float, before: ReplicaView | None = None) -> None:
        """New stats of one replica, first read at ``now``: each live pin's program last ran
        there, its credit decaying from the pin's published expiry; a program whose pin
        ``before`` (the replica's previous stats) showed and ``view`` does not, last seen
        there, decays from when ``view`` was taken (its ``at``, else ``now``). Called once
        per new stats, so a decision costs nothing per pin."""
        gone_at = view.at if view.at is not None else now
        if before is not None:
            for program in before.pins.keys() - view.pins.keys():
                last = self._last.get(program)
                if last is not None and last.replica_id == view.replica_id and last.since > gone_at:
                    self._last[program] = dataclasses.replace(last, since=gone_at)
        for program, pin in view.pins.items():
            if pin.expires_at > now:
                self._put(program, Last(view.replica_id, pin.expires_at, pin.tokens))

    def routed(self, program: str | None, replica_id: str, now: float, tokens: int = 0) -> None:
        """A request of ``program`` was sent to ``replica_id``: the context it leaves there is
        what it had (its last known context, or ``tokens``, whichever is larger)."""
        before = self._last.get(program) if program is not None else None
        new_here = program is not None and (before is None or before.replica_id != replica_id)
        routes = self._routes.pop(replica_id, None) or _Routes()
        self._routes[replica_id] = routes
        if len(self._routes) > MAX_REPLICAS:  # replicas long gone
            self._routes.popitem(last=False)
        routes.add(now, new_here, max(0, tokens), self.max_routes)
        if program is None:
            return
        kept = before.tokens if before is not None else 0
        self._put(program, Last(replica_id, now, max(kept, tokens)))

    def current(self, replicas: Iterable[ReplicaView]) -> list[ReplicaView]:
        """The views with the routes made since each was taken (its ``at``) added: a
        program new there is bound, a request waits, its prompt is work ahead of a turn that
        holds no pin there (a pinned return goes ahead of it under ``cachettl``'s order)."""
        out = []
        for r in replicas:
            routes = self._routes.get(r.replica_id)
            if routes is None or r.at is None:
                out.append(r)
                continue
            requests, new, tokens = routes.since(r.at)
            if not requests:
                out.append(r)
                continue
            out.append(
                dataclasses.replace(
                    r,
                    waiting=r.waiting + requests,
                    bound=r.bound + new,
                    queued_tokens=r.queued_tokens + tokens,
                    ahead_tokens=None if r.ahead_tokens is None else r.ahead_tokens + tokens,
                )
            )
        return out

    def forget(self, program: str) -> None:
        self._last.pop(program, None)
