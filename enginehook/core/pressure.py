"""Memory-pressure victim choice and the rule for when pressure may release pins.

Victims are chosen by lowest expected loss (the TTL decision's F(τ)·B scaled by the share
of τ still to run), then soonest expiry, then larger pins (fewer releases for the same
memory), then program id. Programs with a request already waiting are never chosen unless
``allow_waiting`` is set: their pin is about to pay off.

>>> from enginehook.core.pins import Pin
>>> pins = [Pin("a", 4, 0.0, 10.0, 10.0, 0.9, 2.0), Pin("b", 4, 0.0, 10.0, 10.0, 0.1, 2.0),
...         Pin("c", 8, 0.0, 10.0, 10.0, 0.0, 0.0)]
>>> [p.program_id for p in choose_victims(pins, 10, 5.0, waiting_programs={"c"})]
['b', 'a']
>>> [p.program_id for p in choose_victims(pins, 10, 5.0, {"c"}, allow_waiting=True)]
['b', 'a', 'c']
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from enum import Enum
from typing import Protocol, TypeVar

__all__ = ["PressureRule", "Victim", "choose_victims", "may_release", "take_until_covered"]


class Victim(Protocol):
    """What victim choice reads of a pin (:class:`enginehook.core.pins.Pin` has it); the
    pin table imports this module, so this module names the shape, not the class."""

    @property
    def program_id(self) -> str: ...

    @property
    def blocks(self) -> int: ...

    @property
    def expires_at(self) -> float: ...

    def expected_loss_s(self, now: float) -> float: ...


V = TypeVar("V", bound=Victim)


class PressureRule(Enum):
    """When a failed block allocation may release pins.

    ``RUNNING``: only for running or preempted work, or when nothing runs (the rule that
    keeps pins under load; releasing for every new arrival loses almost all of them).
    ``ALWAYS``: on any failure. ``NEVER``: not at all (a request then waits for expiry).
    """

    RUNNING = "running"
    ALWAYS = "always"
    NEVER = "never"

    @classmethod
    def parse(cls, value: str) -> PressureRule:
        """The rule called ``value``; the error lists the valid names."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(r.value for r in cls)
            raise ValueError(f"pressure must be one of: {valid}; got {value!r}") from None


def may_release(rule: PressureRule, *, for_running: bool, nothing_running: bool) -> bool:
    """Whether a failed allocation may release pins under ``rule``.

    ``for_running``: the allocation is for a running or preempted request.
    ``nothing_running``: no request is running (the engine would otherwise idle).

    >>> may_release(PressureRule.RUNNING, for_running=False, nothing_running=False)
    False
    >>> may_release(PressureRule.RUNNING, for_running=False, nothing_running=True)
    True
    """
    if rule is PressureRule.NEVER:
        return False
    if rule is PressureRule.ALWAYS:
        return True
    return for_running or nothing_running


def _order(pin: Victim, now: float) -> tuple[float, float, int, str]:
    return (pin.expected_loss_s(now), pin.expires_at, -pin.blocks, pin.program_id)


def choose_victims(
    pins: Sequence[V],
    needed_blocks: int,
    now: float,
    waiting_programs: Collection[str],
    allow_waiting: bool = False,
) -> list[V]:
    """The pins to release, in order, until their blocks cover ``needed_blocks``.

    Returns fewer blocks than needed when the eligible pins cannot cover it (the caller
    decides whether a partial release helps). ``needed_blocks <= 0`` chooses nothing.
    """
    if needed_blocks <= 0:
        return []
    free = sorted(
        (p for p in pins if p.program_id not in waiting_programs), key=lambda p: _order(p, now)
    )
    order = free
    if allow_waiting:
        held = [p for p in pins if p.program_id in waiting_programs]
        order = free + sorted(held, key=lambda p: _order(p, now))
    return take_until_covered(order, needed_blocks)


def take_until_covered(order: Iterable[V], needed_blocks: int) -> list[V]:
    """The first pins of ``order`` whose blocks together cover ``needed_blocks``.

    >>> from enginehook.core.pins import Pin
    >>> pins = [Pin(name, n, 0.0, 1.0, 1.0) for name, n in (("a", 3), ("b", 2), ("c", 9))]
    >>> [p.program_id for p in take_until_covered(pins, 4)]
    ['a', 'b']
    """
    chosen: list[V] = []
    total = 0
    for pin in order:
        if total >= needed_blocks:
            break
        chosen.append(pin)
        total += pin.blocks
    return chosen
