"""Why a returning turn missed its cache: every reason through the controller (pins,
tracker and the host's view at admission), the block-exact divergence check, the JSON
form and the hook's counters."""

from __future__ import annotations

import pytest

from controlplane.records import MissReason, NotPinnedCause, PinOutcome, TurnCache
from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import (
    PREFIX_BLOCKS_KEPT,
    CacheSeen,
    ToolCallReport,
    ToolCallTracker,
    classify,
    common_blocks,
    event_from_record,
    event_record,
)
from enginehook.vllm.metrics import HookMetrics
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost

BS = 16


class _Fixed:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(self.ttl, 0.9, 1.0, "fixed", 2.0)


def _controller(
    ttl: float = 5.0, pool_blocks: int = 100, budget_share: float = 0.5
) -> tuple[PinController[str], MinimalHost]:
    host = MinimalHost(block_size=BS)
    rules = SchedulingRules(budget_share=budget_share)
    return PinController(
        rules, host, pool_blocks=pool_blocks, decider=_Fixed(ttl), engine_id="t"
    ), host


def _hashes(n: int, tag: str = "h") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def _first_turn(c: PinController[str], turn: FinishedTurn, blocks: int = 10) -> None:
    """Program ``p`` runs one turn of 10 blocks (160 tokens) that finishes at t = 1."""
    c.arrived(turn.program_id, 0.0, 0.0)
    c.admitted(turn.program_id, 0.0)
    c.finished(turn, 1.0, lambda: (blocks, "handle"))
    c.tracker().keep_prefix(turn.program_id, _hashes(10))


def _return(
    c: PinController[str], at: float, hit: int, hashes: list[str] | None = None
) -> TurnCache:
    c.arrived("p", at, at)
    prompt = 200
    seen = CacheSeen(hit, prompt, hashes if hashes is not None else _hashes(12), BS)
    pin, turn = c.admitted("p", at + 0.1, seen)
    assert turn is not None
    held = turn.event is not None and turn.event.pin_outcome is PinOutcome.HIT
    assert (pin is not None) == held
    return turn.cache


def test_hit_when_the_pin_was_held_and_handed_over() -> None:
    c, host = _controller()
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    cache = _return(c, 2.0, hit=160)
    assert cache == TurnCache(MissReason.HIT, hit_tokens=160, reusable_tokens=160)
    (event,) = host.events
    assert isinstance(event, ToolCallReport)
    assert event.cache == cache
    assert event.pin_outcome is PinOutcome.HIT


def test_expired_records_by_how_much_the_return_came_after_the_expiry() -> None:
    c, host = _controller(ttl=2.0)
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    assert [p.program_id for p in c.expire(3.5)] == ["p"]  # pinned at 1.0 until 3.0
    cache = _return(c, 7.25, hit=0)
    assert cache.reason is MissReason.EXPIRED
    assert cache.expired_by_s == pytest.approx(7.25 - 3.0)
    assert (cache.hit_tokens, cache.reusable_tokens, cache.diverged_at) == (0, 160, None)
    assert host.events[-1].pin_outcome is PinOutcome.EXPIRED  # type: ignore[attr-defined]


def test_an_expired_pin_whose_blocks_the_prefix_cache_still_had_is_no_miss() -> None:
    c, _ = _controller(ttl=2.0)
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    c.expire(3.5)
    cache = _return(c, 4.0, hit=160)
    assert cache.reason is MissReason.PREFIX_CACHE
    assert not cache.reason.missed
    assert cache.expired_by_s == pytest.approx(1.0)  # the pin's story is kept


def test_released_under_pressure() -> None:
    c, _ = _controller()
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    released = c.relieve(10, "q", for_running=True, nothing_running=False, now=1.5)
    assert released == 1
    cache = _return(c, 2.0, hit=0)
    assert cache.reason is MissReason.RELEASED_UNDER_PRESSURE
    assert cache.expired_by_s is None


@pytest.mark.parametrize(
    ("turn", "ttl", "cause"),
    [
        (FinishedTurn("p", "bash", "ls", 160), 0.0, NotPinnedCause.TTL_ZERO),
        (FinishedTurn("p", "bash", "ls", 160, pin=False), 5.0, NotPinnedCause.CLIENT),
    ],
)
def test_not_pinned_names_its_cause(turn: FinishedTurn, ttl: float, cause: NotPinnedCause) -> None:
    c, host = _controller(ttl=ttl)
    _first_turn(c, turn)
    cache = _return(c, 2.0, hit=32)
    assert (cache.reason, cache.not_pinned_cause) == (MissReason.NOT_PINNED, cause)
    assert host.events[-1].pin_outcome is PinOutcome.NOT_PINNED  # type: ignore[attr-defined]


def test_a_pin_the_budget_refused_is_not_pinned_for_the_budget() -> None:
    c, _ = _controller(pool_blocks=10, budget_share=0.5)  # 5 blocks of budget, 10 to pin
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    assert not c.pinned("p")
    cache = _return(c, 2.0, hit=0)
    assert (cache.reason, cache.not_pinned_cause) == (MissReason.NOT_PINNED, NotPinnedCause.BUDGET)


def test_a_turn_without_a_tool_call_is_counted_but_sends_no_event() -> None:
    c, host = _controller()
    _first_turn(c, FinishedTurn("p", None, None, 160))
    cache = _return(c, 2.0, hit=0)
    assert (cache.reason, cache.not_pinned_cause) == (MissReason.NOT_PINNED, NotPinnedCause.NO_TOOL)
    assert host.events == []
    assert not c.tracker().returning("p")  # the orderings' view is unchanged


def test_evicted_when_the_held_pin_covered_less_than_the_reusable_prefix() -> None:
    c, _ = _controller()
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    cache = _return(c, 2.0, hit=96)
    assert cache.reason is MissReason.EVICTED
    assert (cache.hit_tokens, cache.reusable_tokens) == (96, 160)


def test_diverged_at_the_first_token_of_the_first_differing_block() -> None:
    c, host = _controller()
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    changed = _hashes(4) + _hashes(8, "x")  # block 4 (tokens 64..79) differs
    cache = _return(c, 2.0, hit=64, hashes=changed)
    assert cache == TurnCache(
        MissReason.DIVERGED, diverged_at=64, hit_tokens=64, reusable_tokens=64
    )
    assert host.events[-1].pin_outcome is PinOutcome.HIT  # type: ignore[attr-defined]


def test_a_changed_system_prompt_diverges_at_token_zero_whatever_the_pin() -> None:
    c, _ = _controller(ttl=0.0)
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    cache = _return(c, 2.0, hit=0, hashes=_hashes(12, "y"))
    assert (cache.reason, cache.diverged_at, cache.reusable_tokens) == (MissReason.DIVERGED, 0, 0)


def test_a_lost_cache_wins_over_a_late_divergence_and_keeps_k() -> None:
    c, _ = _controller(ttl=2.0)
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    c.expire(3.5)
    cache = _return(c, 4.0, hit=0, hashes=_hashes(6) + _hashes(6, "x"))
    assert (cache.reason, cache.diverged_at, cache.reusable_tokens) == (MissReason.EXPIRED, 96, 96)


def test_the_reusable_prefix_stops_before_the_prompts_last_token() -> None:
    """A prompt of exactly the cached 10 blocks can hit 9 (vLLM computes the last token)."""
    c, _ = _controller()
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    c.arrived("p", 2.0, 2.0)
    _, turn = c.admitted("p", 2.1, CacheSeen(144, 160, _hashes(10), BS))
    assert turn is not None
    assert (turn.cache.reason, turn.cache.reusable_tokens) == (MissReason.HIT, 144)


def test_host_known_reusable_prefix_without_hashes() -> None:
    """The simulator's form: hit and reusable tokens, no divergence check."""
    c, _ = _controller(ttl=0.0)
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    c.arrived("p", 2.0, 2.0)
    _, turn = c.admitted("p", 2.1, CacheSeen(0, 200, reusable_tokens=160))
    assert turn is not None
    assert turn.cache == TurnCache(
        MissReason.NOT_PINNED, NotPinnedCause.TTL_ZERO, hit_tokens=0, reusable_tokens=160
    )


def test_without_the_hosts_view_only_the_pins_story_counts() -> None:
    assert classify(PinOutcome.HIT, True, TurnCache()) is MissReason.HIT
    assert classify(PinOutcome.EXPIRED, False, TurnCache()) is MissReason.EXPIRED
    assert classify(PinOutcome.UNSPECIFIED, False, TurnCache()) is MissReason.UNSPECIFIED
    lost = TurnCache(hit_tokens=0, reusable_tokens=32)
    assert classify(PinOutcome.UNSPECIFIED, False, lost) is MissReason.EVICTED


def test_common_blocks_finds_the_first_difference_of_chained_hashes() -> None:
    chained = _hashes(100)
    assert common_blocks(chained, chained) == 100
    assert common_blocks(chained, chained[:40]) == 40
    for k in (0, 1, 57, 99):
        assert common_blocks(chained, chained[:k] + _hashes(100 - k, "x")) == k
    assert common_blocks(_hashes(3), []) == 0


def test_kept_prefixes_are_bounded_oldest_first_and_dropped_with_their_program() -> None:
    t = ToolCallTracker("e")
    half = PREFIX_BLOCKS_KEPT // 2 + 1
    for program in ("a", "b"):
        t.turn_finished(program, 0.0, tool="bash")
        assert t.keep_prefix(program, _hashes(half))
    assert t._prefix_blocks == half  # "a" was dropped to make room for "b"
    assert list(t._prefixes) == ["b"]
    t.program_end("b", 1.0)
    assert t._prefix_blocks == 0
    assert not t.keep_prefix("b", _hashes(3))  # no turn waiting to return
    t.turn_finished("c", 0.0, tool="bash")
    t.keep_prefix("c", _hashes(3))
    assert [end.program_id for end in t.forget_idle(100.0, idle_s=10.0)] == ["a", "c"]
    assert t._prefix_blocks == 0


def test_the_json_form_round_trips_and_old_records_read_as_unreported() -> None:
    c, host = _controller(ttl=2.0)
    _first_turn(c, FinishedTurn("p", "bash", "ls", 160))
    c.expire(3.5)
    _return(c, 5.0, hit=0)
    event = host.events[-1]
    assert isinstance(event, ToolCallReport)
    record = event_record(event)
    assert record["cache"]["reason"] == "expired"
    assert record["cache"]["not_pinned_cause"] == "unspecified"
    assert event_from_record(record) == event
    old = {k: v for k, v in record.items() if k != "cache"}
    assert event_from_record(old).cache == TurnCache()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown MissReason 'stale'"):
        event_from_record({**record, "cache": {**record["cache"], "reason": "stale"}})


def test_hook_counters_by_reason_cause_and_expired_by_histogram() -> None:
    m = HookMetrics()
    m.returned(TurnCache(MissReason.HIT))
    m.returned(TurnCache(MissReason.NOT_PINNED, NotPinnedCause.BUDGET))
    m.returned(TurnCache(MissReason.EXPIRED, expired_by_s=0.3))
    m.returned(TurnCache(MissReason.EXPIRED, expired_by_s=7200.0))
    text = m.prometheus()
    assert 'cachettl_returning_turns_total{reason="hit"} 1' in text
    assert 'cachettl_returning_turns_total{reason="expired"} 2' in text
    assert 'cachettl_turn_misses_total{reason="not_pinned",cause="budget"} 1' in text
    assert 'cachettl_turn_misses_total{reason="hit"' not in text
    assert 'cachettl_pin_expired_by_seconds_bucket{le="0.1"} 0' in text
    assert 'cachettl_pin_expired_by_seconds_bucket{le="0.5"} 1' in text
    assert 'cachettl_pin_expired_by_seconds_bucket{le="3600"} 1' in text
    assert 'cachettl_pin_expired_by_seconds_bucket{le="+Inf"} 2' in text
    assert "cachettl_pin_expired_by_seconds_count 2" in text
    assert m.snapshot()["turn_misses"] == {"not_pinned/budget": 1, "expired": 2}
