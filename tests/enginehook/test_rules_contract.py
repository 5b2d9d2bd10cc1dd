"""The contract every registered ordering and victim strategy meets
(enginehook.core.registries.ORDERINGS and VICTIMS, discovered, not listed).

An ordering is a total order that is deterministic: every pair of waiting requests compares,
no two tie, the request's own priority comes first, and the same history gives the same
order whatever order the requests are seen in. A victim strategy returns pins it was given,
each once, at least one when memory is needed, no more than it needs, whatever order the
pins come in.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from enginehook.core.pins import Pin
from enginehook.core.registries import ORDERINGS, VICTIMS
from simulator.policies import get_scheduling_policy
from simulator.sim import Simulation

HW = "llama3.1-8b-h100"

#: (request id, program, queue time, own priority, preempted)
Waiting = tuple[str, str | None, float, int, bool]
WAITING: list[Waiting] = [
    (f"r{i}", f"p{i % 5}", float(10 - i % 4), (i * 7) % 3 - 1, i % 4 == 0) for i in range(16)
] + [("solo-a", None, 3.0, 0, False), ("solo-b", None, 3.0, 0, False)]


def _controller(ordering: str) -> Any:
    """The pin controller the simulator hosts, after programs p0..p4 arrived, p1 and p3
    hold pins."""
    sim = Simulation([], get_scheduling_policy(f"cachettl(ordering={ordering})"), HW)
    for k in range(5):
        sim.controller.arrived(f"p{k}", float(k), float(k))
    for program in ("p1", "p3"):
        sim.pins.pin(program, 2, 5.0, 60.0, handle=1)
    return sim.controller


def _keys(ordering: str, waiting: list[Waiting]) -> list[Any]:
    context, key = _controller(ordering), ORDERINGS[ordering]
    return [key(context, prio, pre, program, t, rid) for rid, program, t, prio, pre in waiting]


def test_the_registries_are_not_empty() -> None:
    assert {"fcfs", "program", "plas", "las"} <= set(ORDERINGS)
    assert {"lowest-loss", "latest-arrival", "least-recent", "latest-expiry"} <= set(VICTIMS)


@pytest.mark.parametrize("ordering", sorted(ORDERINGS))
def test_an_ordering_is_a_deterministic_total_order(ordering: str) -> None:
    keys = _keys(ordering, WAITING)
    assert len(set(keys)) == len(keys)  # no ties
    order = [rid for _, rid in sorted(zip(keys, (w[0] for w in WAITING), strict=True))]
    shuffled = WAITING[:]
    random.Random(3).shuffle(shuffled)
    again = _keys(ordering, shuffled)
    assert [rid for _, rid in sorted(zip(again, (w[0] for w in shuffled), strict=True))] == order
    assert all(key[0] == w[3] for key, w in zip(keys, WAITING, strict=True))  # priority first


def _pins() -> list[Pin[int]]:
    rng = random.Random(5)
    pins: list[Pin[int]] = []
    for i in range(12):
        pinned_at = rng.uniform(0.0, 10.0)
        ttl = rng.uniform(1.0, 30.0)
        pins.append(
            Pin(f"p{i}", rng.randint(1, 8), pinned_at, pinned_at + ttl, ttl)
            if i % 3
            else Pin(
                f"p{i}",
                rng.randint(1, 8),
                pinned_at,
                pinned_at + ttl,
                ttl,
                return_probability=rng.random(),
                benefit_s=rng.uniform(0.1, 5.0),
                program_arrival=rng.uniform(0.0, 5.0),
            )
        )
    return pins


@pytest.mark.parametrize("victims", sorted(VICTIMS))
@pytest.mark.parametrize("needed", [1, 9, 1_000])
def test_a_victim_strategy_frees_what_it_is_asked_from_the_pins_it_got(
    victims: str, needed: int
) -> None:
    pins = _pins()
    waiting = {"p2", "p7"}
    chosen = VICTIMS[victims](pins, needed, 12.0, waiting)
    assert chosen
    assert all(any(pin is p for p in pins) for pin in chosen)
    assert len({pin.program_id for pin in chosen}) == len(chosen)
    assert sum(pin.blocks for pin in chosen[:-1]) < needed  # no more than it needs
    shuffled = pins[:]
    random.Random(8).shuffle(shuffled)
    again = VICTIMS[victims](shuffled, needed, 12.0, waiting)
    assert [p.program_id for p in again] == [p.program_id for p in chosen]
    assert VICTIMS[victims]([], needed, 12.0, waiting) == []
