"""Pin table: expiry heap, hand-off on admission, budget, TTL cap, pressure victims."""

from __future__ import annotations

import math
import random

import pytest

from enginehook.core.pins import Pin, PinTable, ReleaseReason


def _table(budget: int = 100, cap: float = 60.0) -> tuple[PinTable[str], list[tuple[str, str]]]:
    log: list[tuple[str, str]] = []
    table: PinTable[str] = PinTable(
        budget, cap, on_release=lambda p, r: log.append((p.program_id, r.value))
    )
    return table, log


def test_expiry_releases_on_time_and_not_before():
    table, log = _table()
    table.pin("a", 5, now=0.0, ttl_s=2.0)
    table.pin("b", 5, now=0.0, ttl_s=1.0)
    assert table.expire(0.999, set()) == []
    assert table.expire(1.0, set()) == []  # at its expiry: still held
    assert [(p.program_id, r) for p, r in table.expire(1.001, set())] == [("b", ReleaseReason.TTL)]
    assert table.next_expiry() == 2.0
    table.expire(2.001, set())
    assert log == [("b", "ttl"), ("a", "ttl")]
    assert table.pinned_blocks == 0
    assert len(table) == 0


def test_expiry_is_strict_a_pin_at_exactly_its_expiry_is_held():
    """The paper's Algorithm 1 releases strictly after the TTL: ``now > expiry``."""
    table, log = _table()
    table.pin("a", 3, now=10.0, ttl_s=2.5)
    table.pin("b", 2, now=10.0, ttl_s=2.5)
    expiry = 12.5
    assert table.next_expiry() == expiry
    assert not table.due(expiry)
    assert table.expire(expiry, set()) == []
    assert "a" in table
    assert "b" in table
    assert table.pinned_blocks == 5
    just_after = math.nextafter(expiry, math.inf)
    assert table.due(just_after)
    released = table.expire(just_after, set())
    assert sorted((p.program_id, r) for p, r in released) == [
        ("a", ReleaseReason.TTL),
        ("b", ReleaseReason.TTL),
    ]
    assert log == [("a", "ttl"), ("b", "ttl")]
    assert table.pinned_blocks == 0
    assert table.next_expiry() is None


def test_overdue_pin_kept_while_its_program_waits_then_handed_over():
    table, log = _table()
    table.pin("a", 4, now=0.0, ttl_s=1.0)
    assert table.expire(5.0, waiting_programs={"a"}) == []
    assert "a" in table
    pin = table.admitted("a")
    assert pin is not None
    assert pin.blocks == 4
    assert log == [("a", "hit")]
    assert table.expire(6.0, set()) == []


def test_overdue_pin_expires_once_program_stops_waiting():
    table, _ = _table()
    table.pin("a", 4, now=0.0, ttl_s=1.0)
    table.expire(2.0, {"a"})
    released = table.expire(2.1, set())
    assert [(p.program_id, r) for p, r in released] == [("a", ReleaseReason.TTL)]


def test_repin_replaces_and_old_heap_entry_is_ignored():
    table, log = _table()
    table.pin("a", 3, now=0.0, ttl_s=1.0)
    result = table.pin("a", 6, now=0.5, ttl_s=10.0)
    assert result.pinned
    assert [r for _, r in result.released] == [ReleaseReason.REPLACED]
    assert table.pinned_blocks == 6
    assert table.expire(2.0, set()) == []  # the old entry (expiry 1.0) is stale
    assert [p.program_id for p, _ in table.expire(10.51, set())] == ["a"]
    assert log == [("a", "replaced"), ("a", "ttl")]


def test_hard_ttl_cap_bounds_every_pin():
    table, _ = _table(cap=5.0)
    result = table.pin("a", 1, now=0.0, ttl_s=3600.0)
    assert result.ttl_s == 5.0
    pin = table.get("a")
    assert pin is not None
    assert pin.expires_at == 5.0


def test_zero_ttl_or_zero_blocks_pins_nothing():
    table, _ = _table()
    assert not table.pin("a", 4, now=0.0, ttl_s=0.0).pinned
    assert not table.pin("b", 0, now=0.0, ttl_s=2.0).pinned
    assert len(table) == 0


def test_program_end_and_release_all():
    table, log = _table()
    table.pin("a", 1, now=0.0, ttl_s=5.0)
    table.pin("b", 1, now=0.0, ttl_s=5.0)
    assert table.program_end("a") is not None
    assert table.program_end("a") is None
    assert [p.program_id for p in table.release_all()] == ["b"]
    assert log == [("a", "program_end"), ("b", "shutdown")]


def test_budget_evicts_cheaper_pins_of_programs_not_waiting():
    table, _ = _table(budget=10)
    table.pin("cheap", 4, 0.0, 10.0, return_probability=0.1, benefit_s=1.0)
    table.pin("waits", 4, 0.0, 10.0, return_probability=0.0, benefit_s=0.0)
    result = table.pin(
        "new", 4, 0.0, 10.0, return_probability=0.9, benefit_s=1.0, waiting_programs={"waits"}
    )
    assert result.pinned
    assert [(p.program_id, r) for p, r in result.released] == [("cheap", ReleaseReason.BUDGET)]
    assert table.pinned_blocks == 8 <= table.budget_blocks


def test_budget_refuses_when_only_dearer_pins_could_make_room():
    table, log = _table(budget=8)
    table.pin("dear", 6, 0.0, 10.0, return_probability=0.9, benefit_s=5.0)
    result = table.pin("new", 4, 0.0, 10.0, return_probability=0.1, benefit_s=1.0)
    assert not result.pinned
    assert "budget" in result.reason
    assert "dear" in table
    assert table.pinned_blocks == 6
    assert log == []


def test_pin_larger_than_budget_is_refused():
    table, _ = _table(budget=3)
    assert not table.pin("a", 4, 0.0, 1.0).pinned


def test_lowest_loss_victims_take_waiting_programs_last():
    from enginehook.core.registries import VICTIMS

    table, _ = _table()
    table.pin("w", 8, 0.0, 10.0, return_probability=0.0)
    table.pin("x", 2, 0.0, 10.0, return_probability=0.5, benefit_s=1.0)
    victims = VICTIMS["lowest-loss"](list(table), 2, 1.0, {"w"})
    assert [p.program_id for p in victims] == ["x"]  # w would lose nothing, but it waits
    victims = VICTIMS["lowest-loss"](list(table), 6, 1.0, {"w"})
    assert [p.program_id for p in victims] == ["x", "w"]


def test_expected_loss_falls_as_the_ttl_runs_out():
    pin: Pin[None] = Pin("a", 1, 0.0, 10.0, 10.0, return_probability=0.8, benefit_s=2.0)
    assert pin.expected_loss_s(0.0) == pytest.approx(1.6)
    assert pin.expected_loss_s(5.0) == pytest.approx(0.8)
    assert pin.expected_loss_s(11.0) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"blocks": -1}, "blocks"),
        ({"ttl_s": float("nan")}, "ttl_s"),
        ({"ttl_s": -1.0}, "ttl_s"),
    ],
)
def test_bad_pin_arguments_name_the_field(kwargs, field):
    table, _ = _table()
    args = {"program_id": "a", "blocks": 1, "now": 0.0, "ttl_s": 1.0} | kwargs
    with pytest.raises(ValueError, match=field):
        table.pin(**args)
    assert len(table) == 0


def test_bad_table_arguments():
    with pytest.raises(ValueError, match="budget_blocks"):
        PinTable(-1)
    with pytest.raises(ValueError, match="ttl_cap_s"):
        PinTable(1, ttl_cap_s=float("inf"))


def test_random_operations_keep_block_count_and_heap_consistent():
    rng = random.Random(7)
    table, _ = _table(budget=50, cap=5.0)
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.1
        op = rng.random()
        pid = f"p{rng.randrange(40)}"
        if op < 0.5:
            table.pin(
                pid, rng.randrange(1, 8), now, rng.random() * 8, return_probability=rng.random()
            )
        elif op < 0.7:
            table.admitted(pid)
        else:
            waiting = {f"p{rng.randrange(40)}" for _ in range(3)}
            for pin, _ in table.expire(now, waiting):
                assert pin.expires_at < now
                assert pin.program_id not in waiting
            assert all(p.expires_at >= now or p.program_id in waiting for p in table)
        assert table.pinned_blocks == sum(p.blocks for p in table) <= 50
        assert all(p.ttl_s <= 5.0 for p in table)
    assert len(table._heap) <= 4 * len(table) + 65


def test_due_is_cheap_and_exact():
    table, _ = _table()
    assert not table.due(0.0)
    table.pin("a", 1, now=0.0, ttl_s=2.0)
    assert not table.due(1.9)
    assert not table.due(2.0)  # expiry is strict: nothing to do at the expiry itself
    assert table.due(2.01)
    table.expire(2.01, {"a"})
    assert table.due(2.01)  # overdue, kept for its waiting request
    table.admitted("a")
    assert not table.due(3.0)
