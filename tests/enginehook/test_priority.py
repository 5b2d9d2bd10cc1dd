"""The paper's program order (the ``program`` ordering), program arrivals and the lazily
sorted queue."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from enginehook.core.priority import ProgramArrivals, SortedWaitQueue
from enginehook.core.registries import ORDERINGS

PROGRAM = ORDERINGS["program"]


@dataclass
class Ctx:
    """What the ``program`` ordering asks of a controller."""

    pinned_programs: set[str]
    arrivals: ProgramArrivals
    order_window_s: float = 0.0
    first_turn_head_start_s: float = 0.0  # the paper's order: no head start for new programs
    first_turn_over_pins: bool = False
    served: frozenset[str] = frozenset()  # programs with attained service (the rest are new)

    def pinned(self, program_id: str | None) -> bool:
        return program_id in self.pinned_programs

    def first_arrival(self, program_id: str | None, default: float) -> float:
        return self.arrivals.first(program_id, default)

    def attained_service(self, program_id: str | None) -> float:
        return 0.0

    def attained_tokens(self, program_id: str | None) -> float:
        return 100.0 if program_id in self.served else 0.0


@dataclass
class Req:
    rid: str
    program: str | None
    arrival: float
    preempted: bool = False


def test_key_orders_preempted_then_pinned_then_program_then_request_arrival():
    arrivals = ProgramArrivals()
    arrivals.observe("old", 100.0)
    ctx = Ctx({"y"}, arrivals)
    reqs = [
        Req("x", "x", 101.0),
        Req("w", None, 102.0),
        Req("y-2", "y", 105.0),
        Req("old-2", "old", 106.0),
        Req("r2", "r", 107.0, preempted=True),
    ]

    def key(r: Req) -> tuple[object, ...]:
        return PROGRAM(ctx, 0, r.preempted, r.program, r.arrival, r.rid)

    assert [r.rid for r in sorted(reqs, key=key)] == ["r2", "y-2", "old-2", "x", "w"]


def test_ties_break_on_arrival_then_id():
    ctx = Ctx(set(), ProgramArrivals())
    assert PROGRAM(ctx, 0, False, None, 2.0, "a") < PROGRAM(ctx, 0, False, None, 2.0, "b")
    assert PROGRAM(ctx, 0, False, None, 2.0, "z") < PROGRAM(ctx, 0, False, None, 3.0, "a")


def test_program_arrivals_keep_the_first_and_forget():
    arrivals = ProgramArrivals()
    assert arrivals.observe("p", 5.0) == 5.0
    assert arrivals.observe("p", 9.0) == 5.0
    assert arrivals.observe(None, 7.0) == 7.0
    arrivals.forget("p")
    assert arrivals.first("p", 11.0) == 11.0
    assert len(arrivals) == 0


def test_queue_resorts_when_keys_change_and_pop_returns_the_peeked_item():
    pinned: set[str] = set()
    ctx = Ctx(pinned, ProgramArrivals())
    q: SortedWaitQueue[Req] = SortedWaitQueue(
        key=lambda r: PROGRAM(ctx, 0, False, r.program, r.arrival, r.rid)
    )
    a, b = Req("a", "A", 1.0), Req("b", "B", 2.0)
    q.add(a)
    q.add(b)
    assert q.peek() is a
    pinned.add("B")
    q.mark_dirty()
    # a key changed between peek and pop: pop still returns what was peeked
    assert q.pop() is a
    q.add(a)
    assert q.peek() is b


def test_prepend_goes_first_until_next_sort_and_remove():
    q: SortedWaitQueue[int] = SortedWaitQueue(key=lambda x: x)
    for x in (1, 2, 3):
        q.add(x)
    q.prepend(9)
    assert list(q) == [9, 1, 2, 3]
    q.remove(2)
    q.remove_many([9, 42])
    assert list(q) == [1, 3]
    assert list(reversed(q)) == [3, 1]
    with pytest.raises(ValueError, match="not in queue"):
        q.remove(7)
    q.pop()
    q.pop()
    with pytest.raises(IndexError):
        q.peek()


def test_order_window_bounds_the_head_start_of_returning_turns():
    arrivals = ProgramArrivals()
    arrivals.observe("old", 0.0)
    windowed, unbounded = Ctx(set(), arrivals, 5.0), Ctx(set(), arrivals, 0.0)
    newcomer = PROGRAM(windowed, 0, False, "new", 50.0, "new")
    soon = PROGRAM(windowed, 0, False, "old", 52.0, "old-a")  # within 5 s of the newcomer
    late = PROGRAM(windowed, 0, False, "old", 60.0, "old-b")
    assert soon < newcomer < late
    assert PROGRAM(unbounded, 0, False, "old", 60.0, "x") < newcomer


def test_new_programs_go_ahead_of_pinned_returning_turns_only_with_over_pins():
    arrivals = ProgramArrivals()
    for program, t in (("pinned", 0.0), ("old", 1.0), ("late", 30.0)):
        arrivals.observe(program, t)
    served = frozenset({"pinned", "old", "late"})
    reqs = [
        Req("pinned-2", "pinned", 40.0),
        Req("old-2", "old", 41.0),
        Req("new-b", "new-b", 21.0),
        Req("new-a", "new-a", 20.0),
        Req("late-2", "late", 39.0, preempted=True),
    ]

    def order(ctx: Ctx) -> list[str]:
        keys = {r.rid: PROGRAM(ctx, 0, r.preempted, r.program, r.arrival, r.rid) for r in reqs}
        return sorted(keys, key=keys.__getitem__)

    inf = float("inf")
    default = Ctx({"pinned"}, arrivals, first_turn_head_start_s=inf, served=served)
    over = Ctx({"pinned"}, arrivals, 0.0, inf, first_turn_over_pins=True, served=served)
    assert order(default) == ["late-2", "pinned-2", "new-a", "new-b", "old-2"]
    # new programs by arrival, ahead of the pinned turn; preempted work still first
    assert order(over) == ["late-2", "new-a", "new-b", "pinned-2", "old-2"]
