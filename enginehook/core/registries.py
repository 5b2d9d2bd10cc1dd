"""The pin controller's strategies chosen by name: which pins to release under memory
pressure (:data:`VICTIMS`) and how to order the waiting queue (:data:`ORDERINGS`).

Each strategy is a small function registered under its name (:func:`register_victims`,
:func:`register_ordering`); :class:`enginehook.core.rules.SchedulingRules` names one of each,
and a registered name is valid everywhere (the contract tests iterate the registries).

>>> sorted(VICTIMS)
['latest-arrival', 'latest-expiry', 'least-recent', 'lowest-loss']
>>> "program" in ORDERINGS and "fcfs" in ORDERINGS
True
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, TypeVar

from enginehook.core.pins import Pin
from enginehook.core.pressure import choose_victims, take_until_covered

__all__ = [
    "ORDERINGS",
    "PLAS_THRESHOLDS_S",
    "VICTIMS",
    "OrderContext",
    "OrderKey",
    "VictimChoice",
    "register_ordering",
    "register_victims",
]


# -- victim strategies -------------------------------------------------------------------
#: ``(pins, needed blocks, now, programs with a waiting request) -> pins to release, in
#: order``. The host releases them in that order until its request fits.
VictimChoice = Callable[[Sequence[Pin[Any]], int, float, Collection[str]], list[Pin[Any]]]

VICTIMS: dict[str, VictimChoice] = {}


F = TypeVar("F")


def _registrar(registry: dict[str, F], what: str) -> Callable[[str], Callable[[F], F]]:
    """A decorator factory that adds functions to ``registry`` under a unique name."""

    def register(name: str) -> Callable[[F], F]:
        def add(function: F) -> F:
            if name in registry:
                raise ValueError(f"{what} named {name!r} is already registered")
            registry[name] = function
            return function

        return add

    return register


#: Decorator: make a victim strategy available to ``SchedulingRules.victim``.
register_victims = _registrar(VICTIMS, "a victim strategy")


@register_victims("lowest-loss")
def _lowest_loss(
    pins: Sequence[Pin[Any]], needed: int, now: float, waiting: Collection[str]
) -> list[Pin[Any]]:
    """Lowest expected loss first; pins of programs with a waiting request last."""
    return choose_victims(pins, needed, now, waiting, allow_waiting=True)


@register_victims("latest-arrival")
def _latest_arrival(
    pins: Sequence[Pin[Any]], needed: int, now: float, waiting: Collection[str]
) -> list[Pin[Any]]:
    """The paper: the program that arrived last goes first."""
    order = sorted(pins, key=lambda p: (-p.program_arrival, p.program_id))
    return take_until_covered(order, needed)


@register_victims("least-recent")
def _least_recent(
    pins: Sequence[Pin[Any]], needed: int, now: float, waiting: Collection[str]
) -> list[Pin[Any]]:
    """LRU: the pin made longest ago goes first (SGLang's radix cache evicts the least
    recently used referenced entries once no unreferenced entry is left)."""
    order = sorted(pins, key=lambda p: (p.pinned_at, p.program_id))
    return take_until_covered(order, needed)


@register_victims("latest-expiry")
def _latest_expiry(
    pins: Sequence[Pin[Any]], needed: int, now: float, waiting: Collection[str]
) -> list[Pin[Any]]:
    """The authors' preview code: one pin per attempt, the one that would expire last."""
    return [max(pins, key=lambda p: (p.expires_at, p.program_id))] if pins else []


# -- orderings -------------------------------------------------------------------------
class OrderContext(Protocol):
    """What an ordering may ask the controller about a program."""

    def pinned(self, program_id: str | None) -> bool: ...
    def first_arrival(self, program_id: str | None, default: float) -> float: ...
    def attained_service(self, program_id: str | None) -> float: ...
    def attained_tokens(self, program_id: str | None) -> float: ...
    @property
    def order_window_s(self) -> float: ...
    @property
    def first_turn_head_start_s(self) -> float: ...
    @property
    def first_turn_over_pins(self) -> bool: ...


#: ``(context, priority, preempted, program id, arrival, request id) -> sort key``
#: (smaller goes first). ``priority`` is the request's own (vLLM's ``--scheduling-policy
#: priority``; 0 otherwise) and comes first in every ordering.
OrderKey = Callable[[OrderContext, int, bool, "str | None", float, str], tuple[Any, ...]]

ORDERINGS: dict[str, OrderKey] = {}


#: Decorator: make a waiting-queue ordering available to ``SchedulingRules.ordering``.
register_ordering = _registrar(ORDERINGS, "an ordering")


@register_ordering("fcfs")
def _fcfs(
    ctx: OrderContext, priority: int, preempted: bool, program: str | None, t: float, rid: str
) -> tuple[Any, ...]:
    """vLLM: preempted first, then request arrival."""
    return (priority, 0 if preempted else 1, t, rid)


@register_ordering("program-fcfs")
def _program_fcfs(
    ctx: OrderContext, priority: int, preempted: bool, program: str | None, t: float, rid: str
) -> tuple[Any, ...]:
    """Preempted first, then the program's first arrival (a program keeps its place)."""
    return (priority, 0 if preempted else 1, ctx.first_arrival(program, t), t, rid)


@register_ordering("program")
def _program(
    ctx: OrderContext, priority: int, preempted: bool, program: str | None, t: float, rid: str
) -> tuple[Any, ...]:
    """The paper's: preempted, then programs holding a live pin, then program arrival
    (with a returning turn's head start bounded by ``order_window_s`` when > 0, and a new
    program's first turn ordered ``first_turn_head_start_s`` before its arrival; with
    ``first_turn_over_pins`` new programs' first turns go ahead of the pinned ones too)."""
    first = ctx.first_arrival(program, t)
    window = ctx.order_window_s
    if window > 0:
        first = max(first, t - window)
    head = ctx.first_turn_head_start_s
    new = ctx.attained_tokens(program) == 0  # nothing served yet: a new program
    if new and ctx.first_turn_over_pins:
        return (priority, 0 if preempted else 1, -1, t, t, rid)
    if head > 0 and new:
        first -= head
    return (priority, 0 if preempted else 1, 0 if ctx.pinned(program) else 1, first, t, rid)


@register_ordering("pinned-program")
def _pinned_program(
    ctx: OrderContext, priority: int, preempted: bool, program: str | None, t: float, rid: str
) -> tuple[Any, ...]:
    """The authors' preview code: pinned programs first, then program arrival (no
    preempted-first)."""
    return (priority, 0 if ctx.pinned(program) else 1, ctx.first_arrival(program, t), t, rid)


#: Attained-service levels of :func:`_plas` (seconds of model time; Autellix's PLAS).
PLAS_THRESHOLDS_S = (1.0, 3.0, 7.0)


@register_ordering("plas")
def _plas(
    ctx: OrderContext, priority: int, preempted: bool, program: str | None, t: float, rid: str
) -> tuple[Any, ...]:
    """Program-level least attained service, discretised into the levels of
    :data:`PLAS_THRESHOLDS_S`; FCFS within a level."""
    service = ctx.attained_service(program)
    level = sum(1 for threshold in PLAS_THRESHOLDS_S if service >= threshold)
    return (priority, 0 if preempted else 1, level, t, rid)


@register_ordering("las")
def _las(
    ctx: OrderContext, priority: int, preempted: bool, program: str | None, t: float, rid: str
) -> tuple[Any, ...]:
    """llm-d's ``program-aware-fairness`` (EPP v0.9.0, strategy ``las``): the program with
    the least attained service goes first, service counted in weighted tokens of its
    finished requests (prompt + 2 × output); the oldest head-of-queue request breaks ties
    (its 0.2 head-wait weight, which its README calls the cold-start tiebreaker).
    Preempted requests first, as the vLLM engine behind the router does."""
    return (priority, 0 if preempted else 1, ctx.attained_tokens(program), t, rid)


@register_ordering("pinned-las")
def _pinned_las(
    ctx: OrderContext, priority: int, preempted: bool, program: str | None, t: float, rid: str
) -> tuple[Any, ...]:
    """Pins with least attained service: preempted, then programs holding a live pin (their
    blocks are already held, admitting them costs no memory), then :func:`_las`'s order, so
    a new program (no service yet) goes ahead of every returning turn whose pin is gone."""
    pinned = 0 if ctx.pinned(program) else 1
    return (priority, 0 if preempted else 1, pinned, ctx.attained_tokens(program), t, rid)
