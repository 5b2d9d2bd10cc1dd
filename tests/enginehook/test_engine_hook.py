"""The hook inside a real vLLM CPU engine (tiny random-weight Llama, 96 blocks of 32 tokens).

One in-process engine for the module; the scheduler's clock is injected, so expiry is
tested without sleeping. Other traffic between turns churns the small KV pool.
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
from tests.enginehook.kvcheck import (
    KV_TOLERANCE,
    PromptKv,
    block_contents,
    kv_mismatches,
    layer_caches,
    run_capturing_prompt_kv,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver(
    tiny_model: Path, inproc: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    yield from logged_driver(tiny_model, tmp_path_factory.mktemp("hook") / "events.jsonl")


@pytest.fixture
def clock(driver: Driver) -> Iterator[FakeClock]:
    yield from fresh_clock(driver)


def _events(driver: Driver) -> list[dict[str, Any]]:
    return logged_events(driver)


def _churn(driver: Driver, n: int = 6, words: int = 700) -> None:
    for i in range(n):
        driver.add(f"filler-{driver.rng.random()}-{i}", driver.words(words), 8)
    driver.drain()


def _changed_blocks(held: dict[str, Any], got: PromptKv, count: int) -> list[int]:
    """The indices of the first ``count`` blocks of ``got`` whose contents in some layer
    differ in any bit from ``held`` (the same blocks copied when they were pinned)."""
    import torch

    return [
        i
        for i in range(count)
        if any(not torch.equal(got.kv[name][i], blocks[i]) for name, blocks in held.items())
    ]


def _pinned_turn_and_recompute(
    driver: Driver, clock: FakeClock, program: str, corrupt: Any = None
) -> tuple[dict[str, Any], list[int], PromptKv, PromptKv]:
    """Turn 1 of ``program`` (600 words, 32 outputs, pinned), the pinned blocks' contents
    copied, other traffic churning the pool, ``corrupt(pinned_ids)`` if given, turn 2 (the
    pinned prefix hit, 100 more words) and a full recompute of turn 2's prompt; returns the
    copy, the pinned block ids and the prompt KV of turn 2 and of the recompute."""
    a1 = driver.words(600)
    out1 = driver.run(f"{program}-1", a1, 32, session=program, xargs={"tool": "bash"})
    pin = driver.scheduler.pins.get(program)
    assert pin is not None
    assert pin.blocks == (600 + 32) // BLOCK
    pinned_ids = [block.block_id for block in pin.handle]
    held = block_contents(driver, pinned_ids)
    clock.advance(2.0)
    _churn(driver)
    clock.advance(0.5)
    if corrupt is not None:
        corrupt(pinned_ids)
    a2 = a1 + list(out1.outputs[0].token_ids) + driver.words(100)
    xargs = {"last_turn": 1}
    out2, got = run_capturing_prompt_kv(
        driver, f"{program}-2", a2, 16, session=program, xargs=xargs
    )
    assert out2.num_cached_tokens == pin.blocks * BLOCK
    assert got.block_ids[0][: pin.blocks] == pinned_ids  # the hit is the pinned blocks
    assert program not in driver.scheduler.pins
    ref, want = run_capturing_prompt_kv(driver, f"{program}-2-ref", a2, 16, salt="recompute")
    assert ref.num_cached_tokens == 0
    assert not set(want.block_ids[0]) & set(pinned_ids)  # computed in other blocks
    return held, pinned_ids, got, want


def test_pinned_prefix_survives_churn_and_its_kv_equals_recompute(driver, clock):
    """The pinned blocks come through the churn bit for bit, and turn 2's prompt KV (the
    pinned prefix and the suffix computed over it, every layer) is a recompute's within
    :data:`~tests.enginehook.kvcheck.KV_TOLERANCE`: turn 2's output is a function of that
    KV and the weights, and this holds in any dtype on any CPU (greedy outputs of the two
    paths differ in bfloat16 on CPUs without AVX-512 BF16, by rounding alone)."""
    held, pinned_ids, got, want = _pinned_turn_and_recompute(driver, clock, "A")
    assert _changed_blocks(held, got, len(pinned_ids)) == []
    mismatches, compared = kv_mismatches(got, want)
    assert compared == {0: set(range(len(got.block_ids[0])))}
    assert len(compared[0]) > len(pinned_ids)  # the suffix's blocks too
    assert mismatches == []
    events = [e for e in _events(driver) if e["program_id"] == "A"]
    tool_call = next(e for e in events if e["kind"] == "tool_call")
    assert tool_call["tool"] == "bash"
    assert tool_call["pin_outcome"] == "hit"
    assert tool_call["duration_s"] == pytest.approx(2.5)
    end = next(e for e in events if e["kind"] == "program_end")
    assert end["total_turns"] == 2


@pytest.mark.parametrize("corruption", ["another_sequence", "zeros"])
def test_the_kv_checks_report_a_pinned_block_overwritten(driver, clock, corruption):
    """The test of the test above: one pinned block overwritten in the engine's KV cache
    during the churn (with the KV of another sequence at the same position, or zeros) is
    found by both of its checks, in every layer, and no other pinned block is."""
    victim = 7
    other = None
    if corruption == "another_sequence":
        _, other = run_capturing_prompt_kv(driver, "other", driver.words(400), 2)

    def corrupt(pinned_ids: list[int]) -> None:
        for name, (_, tensor) in layer_caches(driver).items():
            if other is None:
                tensor[pinned_ids[victim]] = 0
            else:
                tensor[pinned_ids[victim]] = other.kv[name][victim]

    held, pinned_ids, got, want = _pinned_turn_and_recompute(driver, clock, "V", corrupt)
    assert _changed_blocks(held, got, len(pinned_ids)) == [victim]
    mismatches, _ = kv_mismatches(got, want)
    in_victim = {(m.layer, m.half) for m in mismatches if m.block == victim}
    assert in_victim == {(name, half) for name in got.kv for half in ("key", "value")}
    assert min(m.error for m in mismatches if m.block == victim) > 10 * KV_TOLERANCE
    # Layer 0's KV depends on its own token alone: no other pinned block there is flagged
    # (later layers' suffix blocks attend to the corrupted block and may be).
    first = next(iter(got.kv))
    assert {m.block for m in mismatches if m.layer == first} == {victim}


def test_a_turn_index_from_the_body_counts_the_turns_served_elsewhere(driver, clock):
    """The middleware writes a chat body's answers as ``vllm_xargs.turn_index``: a program
    that moved here after four turns elsewhere is counted from there."""
    t1 = driver.words(200)
    out1 = driver.run("T-1", t1, 8, session="T", xargs={"tool": "bash", "turn_index": 4})
    clock.advance(1.0)
    t2 = t1 + list(out1.outputs[0].token_ids) + driver.words(20)
    driver.run("T-2", t2, 8, session="T", xargs={"last_turn": 1, "turn_index": 5})
    events = [e for e in _events(driver) if e["program_id"] == "T"]
    assert next(e for e in events if e["kind"] == "tool_call")["turn_index"] == 4
    assert next(e for e in events if e["kind"] == "program_end")["total_turns"] == 6


def test_pin_expires_on_time(driver, clock):
    driver.run("B-1", driver.words(300), 8, session="B", xargs={"tool": "bash", "pin_ttl_s": 5})
    pin = driver.scheduler.pins.get("B")
    assert pin is not None
    assert pin.expires_at == pytest.approx(clock.now + 5.0)
    clock.advance(4.9)
    driver.run("tick-1", driver.words(20), 1)
    assert "B" in driver.scheduler.pins
    clock.now = pin.expires_at  # exactly at its expiry: still held (strict expiry)
    driver.run("tick-at", driver.words(20), 1)
    assert "B" in driver.scheduler.pins
    clock.advance(0.1)
    driver.run("tick-2", driver.words(20), 1)
    assert "B" not in driver.scheduler.pins
    assert driver.scheduler.metrics.snapshot()["expiries"] >= 1
    driver.run("B-2", driver.words(50), 4, session="B", xargs={"last_turn": 1})
    event = [e for e in _events(driver) if e["program_id"] == "B" and e["kind"] == "tool_call"]
    assert event[-1]["pin_outcome"] == "expired"
    assert event[-1]["chosen_ttl_s"] == 5.0


def test_overdue_pin_kept_while_next_turn_waits(driver, clock):
    c1 = driver.words(300)
    out1 = driver.run("C-1", c1, 8, session="C", xargs={"tool": "bash", "pin_ttl_s": 1})
    hits = driver.scheduler.metrics.snapshot()["pinned_prefix_hits"]
    clock.advance(3.0)  # past the TTL, but C's next turn arrives before any step
    c2 = c1 + list(out1.outputs[0].token_ids) + driver.words(10)
    driver.add("C-2", c2, 4, session="C", xargs={"last_turn": 1})
    out = driver.drain()["C-2"]
    assert out.num_cached_tokens == (300 + 8) // BLOCK * BLOCK
    assert driver.scheduler.metrics.snapshot()["pinned_prefix_hits"] == hits + 1


def test_pressure_releases_pins_without_stall_or_preemption(driver, clock):
    sched = driver.scheduler
    preemptions: list[str] = []
    original = sched._preempt_request

    def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
        preemptions.append(request.request_id)
        return original(request, *args, **kwargs)

    sched._preempt_request = counting
    try:
        for name in ("P", "Q"):
            driver.run(f"{name}-1", driver.words(600), 32, session=name, xargs={"tool": "bash"})
            clock.advance(1.0)
        assert sched.pins.pinned_blocks == 2 * ((600 + 32) // BLOCK)
        before = sched.metrics.snapshot()["pressure_releases"]
        steps = driver.steps
        big = driver.run("big", driver.words(1900), 4)
        assert big.outputs[0].token_ids
        assert driver.steps - steps < 40
        assert sched.metrics.snapshot()["pressure_releases"] == before + 1
        assert "P" not in sched.pins  # earliest expiry, equal expected loss
        assert "Q" in sched.pins
        assert preemptions == []
    finally:
        sched._preempt_request = original


class _Priced:
    """The module's fixed-TTL decisions with a value estimate, F(τ) = 0.9 and B = 2 s (a
    fixed TTL carries none, and pins without one are never reclaimed)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decide(self, facts: Any, turn: Any) -> Any:
        import dataclasses

        decision = self.inner.decide(facts, turn)
        return dataclasses.replace(decision, return_probability=0.9, benefit_s=2.0)


def test_a_new_programs_first_turn_reclaims_a_pin_once_it_has_waited_its_loss(driver, clock):
    """Pins fill the pool while another request runs: the running rule keeps them from a
    waiting request, but a new program's first turn takes one once it has waited longer
    than the pin's expected loss (F·B = 1.8 s over the 30 s TTL still to run)."""
    from vllm.v1.request import RequestStatus

    sched = driver.scheduler
    controller = sched.controller
    decider = controller.decider

    def status(rid: str) -> Any:
        (request,) = [r for key, r in sched.requests.items() if key.startswith(rid)]
        return request.status

    controller.decider = _Priced(decider)
    try:
        for name in ("P", "Q"):
            driver.run(f"{name}-1", driver.words(600), 32, session=name, xargs={"tool": "bash"})
            clock.advance(1.0)
        assert sched.pins.pinned_blocks == 2 * ((600 + 32) // BLOCK)
        driver.add("busy", driver.words(200), 64)
        driver.engine.step()  # busy prefills and runs
        driver.add("N-1", driver.words(1900), 4, session="N", xargs={"tool": "bash"})
        driver.add("one-shot", driver.words(1900), 4)  # no session: never takes a pin
        before = sched.metrics.snapshot()["pressure_releases"]
        clock.advance(1.0)  # N has waited 1 s, less than either pin's loss (about 1.7 s)
        driver.engine.step()
        assert status("N-1") == RequestStatus.WAITING
        assert sched.metrics.snapshot()["pressure_releases"] == before
        assert len(sched.pins) == 2
        clock.advance(1.0)
        driver.engine.step()
        assert status("busy") == RequestStatus.RUNNING
        assert status("N-1") == RequestStatus.RUNNING
        assert sched.metrics.snapshot()["pressure_releases"] == before + 1
        assert "P" not in sched.pins  # the lower loss: less of its TTL left
        assert "Q" in sched.pins
    finally:
        controller.decider = decider
        driver.drain()


def test_waiting_order_follows_the_priority_key(driver, clock):
    sched = driver.scheduler
    driver.run("Old-1", driver.words(50), 2, session="Old", xargs={"tool": "bash", "pin": 0})
    clock.advance(1.0)
    driver.run("Y-1", driver.words(50), 2, session="Y", xargs={"tool": "bash"})
    assert "Y" in sched.pins
    assert "Old" not in sched.pins
    saved = sched.max_num_running_reqs, sched.max_num_active_reqs
    sched.max_num_running_reqs = sched.max_num_active_reqs = 1
    try:
        driver.finished_order.clear()
        driver.add("X", driver.words(50), 2, session="X", xargs={"tool": "bash"})
        driver.add("W", driver.words(50), 2)
        driver.add("Y-2", driver.words(50), 2, session="Y", xargs={"last_turn": 1})
        driver.add("Old-2", driver.words(50), 2, session="Old", xargs={"last_turn": 1})
        driver.drain()
    finally:
        sched.max_num_running_reqs, sched.max_num_active_reqs = saved
    # New programs' first turns first (a request without a session is one too), in arrival
    # order, ahead of the pinned returning turn (the default, so that a new session never
    # waits behind pins), then the pinned returning turn, then the unpinned one.
    assert driver.finished_order == ["X", "W", "Y-2", "Old-2"]


def test_a_cpu_tier_prices_the_miss_as_a_reload_in_the_engine(driver, clock):
    """The same turn after the same tool is pinned when a miss means a full prefill and
    not pinned when a CPU tier would reload it (no KV connector runs on the CPU build, so
    the setting is switched to ``on`` on the running scheduler)."""
    from enginehook.config import detect_cpu_tier
    from enginehook.core.pressure import PressureRule
    from enginehook.link.decide import TtlDecider

    sched, services, controller = (
        driver.scheduler,
        driver.scheduler.services,
        driver.scheduler.controller,
    )
    assert not services.cpu_tier.on  # auto, and this engine has no KV connector
    assert "no KV connector" in services.cpu_tier.reason
    assert sched.metrics.snapshot()["cpu_tier"] is False
    rules = (controller.pressure_rule, controller.order_window_s)
    assert rules == (PressureRule.RUNNING, 0.0)  # the module's HOOK settings
    decider = TtlDecider("cachettl", {"ttl_cap_s": 60.0}, min_samples=5)
    for k in range(20):  # this tool returns after 5-14.5 ms
        decider.models.record_tool_call("bash", "ls -la", 0.005 + 0.0005 * k)
    saved = services.decider, services.cpu_tier
    services.decider = decider
    xargs = {"tool": "bash", "tool_args": "ls -la"}
    try:
        driver.run("T-1", driver.words(600), 32, session="T", xargs=xargs)
        pin = sched.pins.get("T")
        assert pin is not None
        assert pin.ttl_s > 0
        services.cpu_tier = detect_cpu_tier("on", sched.vllm_config)
        controller.cpu_tier = True
        rules = (controller.pressure_rule, controller.order_window_s)
        assert rules == (PressureRule.ALWAYS, 0.0)  # the tier's rules: no order window
        driver.run("U-1", driver.words(600), 32, session="U", xargs=xargs)
        assert "U" not in sched.pins  # a miss costs a reload: not worth the memory
    finally:
        services.decider, services.cpu_tier = saved
        controller.cpu_tier = False


def test_load_signals_count_waiting_demand_less_pinned_blocks(driver, clock):
    """The load a pin is priced against: waiting prompts less their programs' pins, and
    the walk stops once the sum passes free + context (λ is 1 from there on)."""
    from estimator import CachettlPolicy, RequestFacts

    sched = driver.scheduler
    driver.run("P-1", driver.words(300), 4, session="P", xargs={"tool": "bash"})
    pin = sched.pins.get("P")
    assert pin is not None
    assert pin.blocks > 0
    driver.add("P-2", driver.words(400), 2, session="P", xargs={"last_turn": 1})
    for i in range(6):
        driver.add(f"big-{i}", driver.words(700), 2)
    queue = list(sched.waiting)
    assert len(queue) == 7
    held = {"P": pin.blocks * BLOCK}
    expected = sum(max(0, r.num_tokens - held.get(r.session_id, 0)) for r in queue)
    free = sched._pool.get_num_free_blocks() * BLOCK
    assert sched.controller.load(10**9) == (expected, free)
    assert expected > free + 500  # enough demand to stop early
    early, same_free = sched.controller.load(500)
    assert same_free == free
    assert free + 500 < early < expected
    policy = CachettlPolicy()
    facts = [
        RequestFacts(tool="bash", context_tokens=500, waiting_tokens=w, free_tokens=free)
        for w in (early, expected)
    ]
    assert [policy.pressure(f) for f in facts] == [1.0, 1.0]
    driver.drain()
