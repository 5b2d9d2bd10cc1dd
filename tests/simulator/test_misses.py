"""The simulator reports why each returning turn missed its cache: its hit and the
reusable prefix (the previous turn's cached full blocks) at admission, through the same
controller and tracker as the vLLM hook; its prompts never diverge. Recording the events
changes no result."""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.records import MissReason, PinOutcome
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from simulator.policies import get_scheduling_policy
from simulator.sim import Simulation, simulate
from simulator.workloads import generate


def _run(spec: str) -> tuple[list[ToolCallReport], list[float]]:
    programs = generate("swe", 30, rate=0.09, seed=1)
    policy = get_scheduling_policy(spec)
    events: list[ToolCallReport] = []
    learn = policy.learn

    def record(event: ToolCallReport | ProgramEndReport) -> None:
        if isinstance(event, ToolCallReport):
            events.append(event)
        learn(event)

    policy.learn = record  # type: ignore[method-assign]
    result = Simulation(programs, policy).run()
    return events, sorted(p.finish_s for p in result.programs)


@pytest.fixture(scope="module")
def static_ttl() -> tuple[list[ToolCallReport], list[float]]:
    return _run("static-ttl")


def test_every_returning_turn_has_a_reason_and_its_tokens(static_ttl) -> None:
    events, _ = static_ttl
    assert len(events) > 200
    reasons = Counter(e.cache.reason for e in events)
    assert set(reasons) >= {
        MissReason.HIT,
        MissReason.PREFIX_CACHE,
        MissReason.NOT_PINNED,
        MissReason.RELEASED_UNDER_PRESSURE,
    }
    for e in events:
        cache = e.cache
        assert cache.reason is not MissReason.UNSPECIFIED
        assert cache.diverged_at is None  # the simulator's prompts extend the context
        assert cache.hit_tokens is not None
        assert cache.reusable_tokens is not None
        assert cache.reusable_tokens > 0
        served = cache.hit_tokens >= cache.reusable_tokens
        assert served is (not cache.reason.missed), e


def test_reasons_agree_with_the_pins_story(static_ttl) -> None:
    events, _ = static_ttl
    for e in events:
        cache = e.cache
        if e.pin_outcome is PinOutcome.HIT:
            assert cache.reason is MissReason.HIT  # a pin here holds the whole prefix
            assert cache.hit_tokens == cache.reusable_tokens
        if e.pin_outcome is PinOutcome.EXPIRED:
            assert cache.reason in (MissReason.EXPIRED, MissReason.PREFIX_CACHE)
            assert cache.expired_by_s is not None
            assert cache.expired_by_s == pytest.approx(e.duration_s - e.chosen_ttl_s, abs=1e-9)
            assert cache.expired_by_s > 0
        else:
            assert cache.expired_by_s is None
        if cache.reason is MissReason.NOT_PINNED:
            assert cache.not_pinned_cause.label == "ttl_zero"


def test_recording_the_events_changes_no_result(static_ttl) -> None:
    _, finishes = static_ttl
    again = simulate(generate("swe", 30, rate=0.09, seed=1), "static-ttl")
    assert sorted(p.finish_s for p in again.programs) == finishes
