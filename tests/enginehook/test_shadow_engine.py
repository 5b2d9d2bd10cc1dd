"""Shadow mode on the real CPU engine: the same replay through stock vLLM and through the
hook with ``mode: shadow`` schedules the same requests, with the same tokens, at every
step, and the shadow run reports the pins it would have made and what they would have met.

The replay is driven step by step (:class:`Replay`): each program's next turn is added a
fixed number of engine steps after its previous turn finished, and the hook's clock moves
0.1 s per step, so both runs see the same requests at the same steps as long as they
schedule alike (a difference would show at the first step it happens). The two engines run
one after the other in this module (one engine at a time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.enginehook.driver import Driver, FakeClock, make_llm, shutdown

pytestmark = pytest.mark.slow

#: Seconds the hook's clock moves per engine step.
STEP_S = 0.1
#: The TTL every tool call would be pinned for (a fixed policy): 10 steps.
TTL_S = 1.0
SHADOW: dict[str, Any] = {
    "mode": "shadow",
    "policy": "fixed",
    "policy_params": {"ttl_s": TTL_S, "skip_slow_tools": False},
    "ttl_cap_s": 600.0,
}
#: Programs: (name, first step, tool gaps in steps after each turn but the last). Gaps of
#: 3 steps come back within the TTL (would-hit), gaps of 25 after it (would-expire).
PROGRAMS = [
    ("A", 0, [3, 25, 3]),
    ("B", 1, [25, 3]),
    ("C", 2, [3, 3, 25]),
    ("D", 4, [3, 25]),
    ("E", 6, [25, 3, 3]),
]


@dataclass
class Replay:
    """Agent programs over one engine, one ``step()`` at a time; ``steps`` records what
    the scheduler scheduled at each step (request id -> tokens)."""

    driver: Driver
    clock: FakeClock | None = None
    steps: list[dict[str, int]] = field(default_factory=list)
    waiting_peak: int = 0
    preemptions: int = 0

    def run(self) -> None:
        drv = self.driver
        scheduler = drv.scheduler
        schedule = scheduler.schedule

        def recording(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            # vLLM appends a random suffix to each request id: the replay's own id is kept
            tokens = {rid.rsplit("-", 1)[0]: n for rid, n in out.num_scheduled_tokens.items()}
            self.steps.append(dict(sorted(tokens.items())))
            self.waiting_peak = max(self.waiting_peak, len(scheduler.waiting))
            self.preemptions += len(getattr(out, "preempted_req_ids", None) or ())
            return out

        scheduler.schedule = recording
        # (step it arrives, program, turn, prompt ids)
        due: list[tuple[int, str, int, list[int]]] = [
            (start, name, 0, drv.words(500)) for name, start, _ in PROGRAMS
        ]
        gaps = {name: gap for name, _, gap in PROGRAMS}
        prompts: dict[str, list[int]] = {}
        step = 0
        while due or drv.engine.has_unfinished_requests():
            assert step < 3000, "the replay did not finish"
            for item in [d for d in due if d[0] <= step]:
                due.remove(item)
                _, name, turn, ids = item
                last = turn == len(gaps[name])
                xargs = {"last_turn": 1} if last else {"tool": "bash"}
                drv.add(f"{name}-{turn}", ids, 24, session=name, xargs=xargs)
                prompts[f"{name}-{turn}"] = ids
            outputs = drv.engine.step() if drv.engine.has_unfinished_requests() else []
            step += 1
            if self.clock is not None:
                self.clock.advance(STEP_S)
            for out in outputs:
                if not out.finished:
                    continue
                name, turn = out.request_id.split("-")[:2]
                k = int(turn)
                if k < len(gaps[name]):
                    ids = prompts[out.request_id] + list(out.outputs[0].token_ids)
                    due.append((step + gaps[name][k], name, k + 1, ids + drv.words(60)))
        scheduler.schedule = schedule


def _engine(model: Path, hook: dict[str, Any] | None) -> Driver:
    from transformers import AutoTokenizer

    llm = make_llm(model, hook, num_gpu_blocks_override=64, max_num_seqs=3, max_model_len=1024)
    return Driver(llm, AutoTokenizer.from_pretrained(str(model)))


@pytest.fixture(scope="module")
def stock(tiny_model: Path, inproc: None) -> Replay:
    driver = _engine(tiny_model, None)
    replay = Replay(driver)
    try:
        replay.run()
    finally:
        shutdown(driver.llm)
    return replay


@pytest.fixture(scope="module")
def shadow(
    stock: Replay, tiny_model: Path, inproc: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Replay, list[dict[str, Any]], dict[str, Any]]:
    log = tmp_path_factory.mktemp("shadow") / "events.jsonl"
    driver = _engine(tiny_model, {**SHADOW, "event_log": str(log)})
    clock = FakeClock()
    driver.scheduler.clock = clock
    replay = Replay(driver, clock)
    try:
        replay.run()
        scheduler = driver.scheduler
        assert scheduler.services.sink.flush(10.0)
        counters = dict(scheduler.metrics.snapshot()["shadow_pins"])
        counters["pins_taken"] = scheduler.metrics.pins_taken
        counters["shadow_mode"] = "cachettl_shadow_mode 1" in scheduler.metrics.prometheus()
        counters["waiting_is_vllms"] = type(scheduler.waiting).__module__.startswith("vllm.")
    finally:
        shutdown(driver.llm)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return replay, events, counters


def test_shadow_mode_schedules_as_stock_vllm_at_every_step(stock, shadow):
    replay, _, counters = shadow
    # the replay is one with contention: requests queued behind others
    assert stock.waiting_peak >= 2
    assert len(stock.steps) > 100
    for i, (ours, theirs) in enumerate(zip(replay.steps, stock.steps, strict=False)):
        assert ours == theirs, f"step {i}: shadow scheduled {ours}, stock {theirs}"
    assert len(replay.steps) == len(stock.steps)
    assert replay.preemptions == stock.preemptions
    assert counters["pins_taken"] == 0
    assert counters["waiting_is_vllms"]


def test_shadow_run_reports_the_pins_it_would_have_made(shadow):
    _, events, counters = shadow
    calls = [e for e in events if e["kind"] == "tool_call"]
    gaps = {(name, k): gap for name, _, g in PROGRAMS for k, gap in enumerate(g)}
    assert len(calls) == len(gaps)
    for call in calls:
        gap = gaps[call["program_id"], call["turn_index"]]
        expected = "hit" if gap * STEP_S <= TTL_S else "expired"
        assert call["shadow"] is True
        assert call["chosen_ttl_s"] == TTL_S
        assert call["pin_outcome"] == expected, call
        assert call["cache"]["reason"] != "hit"  # nothing was pinned
    hits = sum(1 for c in calls if c["pin_outcome"] == "hit")
    assert counters["would_hit"] == hits > 0
    assert counters["would_expire"] == len(calls) - hits > 0
    assert counters["shadow_mode"]
    ends = [e for e in events if e["kind"] == "program_end"]
    assert sorted(e["program_id"] for e in ends) == [name for name, _, _ in PROGRAMS]
