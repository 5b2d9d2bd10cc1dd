"""Why a returning turn missed its cache, in a real vLLM CPU engine (tiny random-weight
Llama, 96 blocks of 32 tokens): a hit, an expired pin (short TTL through the ``pin_ttl_s``
hint) with and without the prefix cache still holding its blocks, turns not pinned by the
client and by a TTL of 0, a turn without a tool call, and a prompt that changes an early
block (diverged at its first token, block-exact).

One in-process engine for the module; the scheduler's clock is injected. Other traffic
between turns churns the small KV pool so that unpinned blocks are evicted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.enginehook.driver import (
    BLOCK,
    Driver,
    FakeClock,
    fresh_clock,
    logged_driver,
    logged_events,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver(
    tiny_model: Path, inproc: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    yield from logged_driver(tiny_model, tmp_path_factory.mktemp("misses") / "events.jsonl")


@pytest.fixture
def clock(driver: Driver) -> Iterator[FakeClock]:
    yield from fresh_clock(driver)


def _cache(driver: Driver, program: str) -> dict[str, Any]:
    """The cache report of the program's last tool-call event in the event log."""
    events = logged_events(driver)
    calls = [e for e in events if e["program_id"] == program and e["kind"] == "tool_call"]
    assert calls, f"no tool-call event of {program}"
    cache: dict[str, Any] = calls[-1]["cache"]
    return cache


def _churn(driver: Driver, n: int = 6, words: int = 700) -> None:
    for i in range(n):
        driver.add(f"filler-{driver.rng.random()}-{i}", driver.words(words), 8)
    driver.drain()


def _two_turns(
    driver: Driver,
    clock: FakeClock,
    program: str,
    xargs: dict[str, Any],
    *,
    wait_s: float = 2.0,
    churn: bool = True,
    words: int = 300,
) -> Any:
    """Turn 1 (``words`` words, 8 tokens out, ``xargs``), a tool pause of ``wait_s`` with
    or without churn, then turn 2 extending turn 1 (prompt + output + 20 words)."""
    first = driver.words(words)
    out = driver.run(f"{program}-1", first, 8, session=program, xargs=xargs)
    clock.advance(wait_s)
    driver.run(f"tick-{program}", driver.words(10), 1)  # a step: expiry runs
    if churn:
        _churn(driver)
    second = first + list(out.outputs[0].token_ids) + driver.words(20)
    return driver.run(f"{program}-2", second, 4, session=program, xargs={"last_turn": 1})


def test_a_held_pin_is_a_hit_covering_the_reusable_prefix(driver, clock):
    out = _two_turns(driver, clock, "A", {"tool": "bash"})
    cache = _cache(driver, "A")
    assert cache["reason"] == "hit"
    assert cache["hit_tokens"] == out.num_cached_tokens > 0
    assert cache["reusable_tokens"] == cache["hit_tokens"]
    assert cache["diverged_at"] is None
    assert driver.scheduler.metrics.snapshot()["returning_turns"]["hit"] >= 1


def test_an_expired_pin_reports_by_how_much_the_return_was_late(driver, clock):
    start = clock.now
    out = _two_turns(driver, clock, "B", {"tool": "bash", "pin_ttl_s": 1}, wait_s=3.5)
    cache = _cache(driver, "B")
    assert cache["reason"] == "expired"
    assert out.num_cached_tokens == cache["hit_tokens"] == 0
    # Turn 1 finished at `start` (the clock stood still), so its pin expired at start + 1;
    # turn 2 arrived at start + 3.5.
    assert cache["expired_by_s"] == pytest.approx(3.5 - 1.0)
    assert clock.now == start + 3.5
    assert cache["reusable_tokens"] == (300 + 8) // BLOCK * BLOCK
    metrics = driver.scheduler.metrics
    assert metrics.snapshot()["expired_by_buckets"][3] >= 1  # (1, 5] s
    assert 'cachettl_turn_misses_total{reason="expired",cause=""}' in metrics.prometheus()


def test_an_expired_pin_still_in_the_prefix_cache_is_no_miss(driver, clock):
    out = _two_turns(driver, clock, "B2", {"tool": "bash", "pin_ttl_s": 1}, churn=False)
    cache = _cache(driver, "B2")
    assert cache["reason"] == "prefix_cache"
    assert cache["hit_tokens"] == out.num_cached_tokens == cache["reusable_tokens"] > 0
    assert cache["expired_by_s"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("program", "xargs", "cause"),
    [
        ("C", {"tool": "bash", "pin": 0}, "client"),
        ("C0", {"tool": "bash", "pin_ttl_s": 0}, "ttl_zero"),
    ],
)
def test_a_turn_not_pinned_names_why(driver, clock, program, xargs, cause):
    out = _two_turns(driver, clock, program, xargs)
    cache = _cache(driver, program)
    assert (cache["reason"], cache["not_pinned_cause"]) == ("not_pinned", cause)
    assert cache["hit_tokens"] == out.num_cached_tokens < cache["reusable_tokens"]


def test_a_turn_without_a_tool_call_is_counted_by_the_hook(driver, clock):
    misses = driver.scheduler.metrics.snapshot()["turn_misses"]
    before = misses.get("not_pinned/no_tool", 0)
    _two_turns(driver, clock, "E", {})
    after = driver.scheduler.metrics.snapshot()["turn_misses"]
    assert after.get("not_pinned/no_tool", 0) == before + 1
    events = logged_events(driver)
    assert [e["kind"] for e in events if e["program_id"] == "E"] == ["program_end"]


def test_a_prompt_changed_in_its_second_block_diverges_at_that_blocks_first_token(driver, clock):
    first = driver.words(300)
    out = driver.run("D-1", first, 8, session="D", xargs={"tool": "bash"})
    assert "D" in driver.scheduler.pins
    clock.advance(1.0)
    second = first + list(out.outputs[0].token_ids) + driver.words(20)
    k = BLOCK + 7  # a token of the second block
    second[k] = next(t for t in driver.words(50) if t != first[k])
    out2 = driver.run("D-2", second, 4, session="D", xargs={"last_turn": 1})
    cache = _cache(driver, "D")
    assert cache["reason"] == "diverged"
    assert cache["diverged_at"] == BLOCK  # the first token of the first differing block
    assert cache["hit_tokens"] == out2.num_cached_tokens == BLOCK
    assert cache["reusable_tokens"] == BLOCK
