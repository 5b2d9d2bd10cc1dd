"""Shadow mode and tool-by-tool rollout on the real CPU engine with a real control plane
(in-process gRPC server, SQLite store).

Two engines, one after the other. Stock vLLM runs a replay of agent programs first. Then the
hook's engine, linked to a control plane whose tenant's rollout is ``shadow`` (set with
``cachettl rollout set`` before the engine starts), runs the same replay: it schedules the
same requests, with the same tokens, at every step, and reports the pins it would have made
and what they would have met. The same engine then follows ``cachettl rollout set`` without a
restart: a tool outside the rollout is not pinned, the tool is added, its next call is.

The replay is driven step by step (:class:`Replay`): each program's next turn is added a
fixed number of engine steps after its previous turn finished, and the hook's clock moves
0.1 s per step, so both runs see the same requests at the same steps as long as they
schedule alike (a difference would show at the first step it happens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli import main
from controlplane.rpc.server import ServerOptions
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store
from controlplane.storage.rollouts import Rollout
from tests.enginehook.driver import Driver, FakeClock, make_llm, shutdown
from tests.enginehook.test_cplink import _wait
from tests.support import ServerThread

pytestmark = pytest.mark.slow

#: Seconds the hook's clock moves per engine step.
STEP_S = 0.1
#: The TTL every tool call would be pinned for (a fixed policy): 10 steps.
TTL_S = 1.0
HOOK: dict[str, Any] = {
    "policy": "fixed",
    "policy_params": {"ttl_s": TTL_S, "skip_slow_tools": False},
    "ttl_cap_s": 600.0,
    "tenant": "acme",
    "coherence": False,
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


@dataclass
class Plane:
    """The control plane: its database, store and server, and the tenant's token file."""

    url: str
    store: Store
    target: str
    token_file: Path

    def rollout(self, *flags: str) -> None:
        assert main(["rollout", "set", "--tenant", "acme", *flags, "--db", self.url]) == 0


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """A control plane whose tenant ``acme`` is rolled out in shadow."""
    folder = tmp_path_factory.mktemp("rollout-plane")
    url = f"sqlite:///{folder / 'cachettl.sqlite3'}"
    store = create_store(url)
    control = ControlPlane(store, min_samples=3)
    (folder / "token").write_text(control.create_tenant("acme")[1])
    options = ServerOptions(listen="127.0.0.1:0", watch_interval_s=0.1, tail_interval_s=0.1)
    server = ServerThread(control, options)
    found = Plane(url, store, server.target, folder / "token")
    found.rollout("--shadow")
    yield found
    server.stop()
    store.close()


@pytest.fixture(scope="module")
def stock(tiny_model: Path, inproc: None) -> Replay:
    driver = _engine(tiny_model, None)
    replay = Replay(driver)
    try:
        replay.run()
    finally:
        shutdown(driver.llm)
    return replay


@dataclass
class Hooked:
    """The hook's engine after the shadow replay: what it scheduled and reported."""

    driver: Driver
    replay: Replay
    events: list[dict[str, Any]]
    counters: dict[str, Any]


def _delivered(driver: Driver) -> bool:
    """Every event written to the event log and acknowledged by the control plane."""
    sink = driver.scheduler.services.sink  # the event log, over the control-plane link
    return bool(sink.flush(20.0) and sink._inner.flush(20.0))


def _rollout(driver: Driver) -> Rollout | None:
    remote: Rollout | None = driver.scheduler.rollout.remote
    return remote


@pytest.fixture(scope="module")
def hooked(
    stock: Replay, plane: Plane, tiny_model: Path, inproc: None, tmp_path_factory: Any
) -> Iterator[Hooked]:
    folder = tmp_path_factory.mktemp("hooked")
    log = folder / "events.jsonl"
    hook = {
        **HOOK,
        "event_log": str(log),
        "control_plane": plane.target,
        "token_file": str(plane.token_file),
        "spill_dir": str(folder / "spill"),
    }
    driver = _engine(tiny_model, hook)
    try:
        scheduler = driver.scheduler
        clock = FakeClock()
        scheduler.clock = clock
        assert _wait(lambda: _rollout(driver) == Rollout.of("shadow"))
        replay = Replay(driver, clock)
        replay.run()
        assert _delivered(driver)
        counters = dict(scheduler.metrics.snapshot()["shadow_pins"])
        counters["pins_taken"] = scheduler.metrics.pins_taken
        counters["shadow_mode"] = "cachettl_shadow_mode 1" in scheduler.metrics.prometheus()
        counters["waiting_is_vllms"] = type(scheduler.waiting).__module__.startswith("vllm.")
        events = [json.loads(line) for line in log.read_text().splitlines()]
        yield Hooked(driver, replay, events, counters)
    finally:
        shutdown(driver.llm)


def test_shadow_mode_schedules_as_stock_vllm_at_every_step(stock: Replay, hooked: Hooked):
    replay, counters = hooked.replay, hooked.counters
    # the replay is one with contention: requests queued behind others
    assert stock.waiting_peak >= 2
    assert len(stock.steps) > 100
    for i, (ours, theirs) in enumerate(zip(replay.steps, stock.steps, strict=False)):
        assert ours == theirs, f"step {i}: shadow scheduled {ours}, stock {theirs}"
    assert len(replay.steps) == len(stock.steps)
    assert replay.preemptions == stock.preemptions
    assert counters["pins_taken"] == 0
    assert counters["waiting_is_vllms"]


def test_shadow_run_reports_the_pins_it_would_have_made(hooked: Hooked, plane: Plane):
    calls = [e for e in hooked.events if e["kind"] == "tool_call"]
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
    counters = hooked.counters
    assert counters["would_hit"] == hits > 0
    assert counters["would_expire"] == len(calls) - hits > 0
    assert counters["shadow_mode"]
    ends = [e for e in hooked.events if e["kind"] == "program_end"]
    assert sorted(e["program_id"] for e in ends) == [name for name, _, _ in PROGRAMS]
    # the control plane stored them as shadow calls, and counts no pin
    stored = [row.call for row in plane.store.read_tool_calls(0, 1000)]
    assert len(stored) == len(calls)
    assert all(call.shadow for call in stored)


def _turn(driver: Driver, program: str, turn: int, tool: str | None) -> None:
    """One turn of ``program`` (calling ``tool``; ``None``: its last turn)."""
    xargs = {"tool": tool} if tool else {"last_turn": 1}
    driver.run(f"{program}-{turn}", driver.words(200), 8, session=program, xargs=xargs)


def test_a_tool_outside_the_rollout_is_not_pinned_until_rollout_set_adds_it(
    hooked: Hooked, plane: Plane
):
    driver = hooked.driver
    scheduler = driver.scheduler
    plane.rollout("--only", "pytest")
    assert _wait(lambda: _rollout(driver) == Rollout.of("only", ["pytest"]))
    _turn(driver, "R", 0, "bash")  # outside the rollout: decided, reported, not pinned
    assert scheduler.pins.get("R") is None
    assert type(scheduler.waiting).__module__.startswith("enginehook.")  # the hook's order
    _turn(driver, "R", 1, None)

    plane.rollout("--only", "bash,pytest")
    assert _wait(lambda: _rollout(driver) == Rollout.of("only", ["bash", "pytest"]))
    _turn(driver, "S", 0, "bash")  # the same engine, no restart: now pinned
    pin = scheduler.pins.get("S")
    assert pin is not None
    assert pin.ttl_s == TTL_S
    _turn(driver, "S", 1, None)
    assert scheduler.metrics.pins_taken == 1

    assert _delivered(driver)
    calls = {row.call.program_id: row.call for row in plane.store.read_tool_calls(0, 1000)}
    assert calls["R"].shadow
    assert calls["R"].chosen_ttl_s == TTL_S
    assert calls["R"].pin_outcome.label == "hit"  # it came back within the TTL it would pin
    assert not calls["S"].shadow
    assert calls["S"].pin_outcome.label == "hit"
    text = scheduler.metrics.prometheus()
    assert 'cachettl_rollout{mode="only",tools="bash,pytest"} 1' in text
    assert "cachettl_shadow_mode 0" in text


def test_a_shadow_rollout_gives_the_waiting_queue_back_to_vllms_order(hooked: Hooked, plane: Plane):
    """``rollout set --shadow`` on a running engine: nothing is pinned and the waiting queue
    is vLLM's own (first come, first served), with the requests that were waiting; the
    hook's order returns when the rollout leaves shadow."""
    driver = hooked.driver
    scheduler = driver.scheduler
    plane.rollout("--all")
    assert _wait(lambda: _rollout(driver) == Rollout.of("all"))
    _turn(driver, "T", 0, "pytest")
    assert scheduler.pins.get("T") is not None
    ours = type(scheduler.waiting)
    assert ours.__module__.startswith("enginehook.")
    plane.rollout("--shadow")
    assert _wait(lambda: _rollout(driver) == Rollout.of("shadow"))
    _turn(driver, "U", 0, "pytest")  # in the rollout before: not pinned in shadow
    assert scheduler.pins.get("U") is None
    assert type(scheduler.waiting).__module__.startswith("vllm.")
    # a newer program's request queues before an older one's returning turn, as in vLLM
    driver.add("V-0", driver.words(50), 2, session="V")
    driver.add("U-1", driver.words(50), 2, session="U", xargs={"last_turn": 1})
    assert [r.request_id.rsplit("-", 1)[0] for r in scheduler.waiting] == ["V-0", "U-1"]
    plane.rollout("--all")
    assert _wait(lambda: _rollout(driver) == Rollout.of("all"))
    driver.finished_order.clear()
    driver.drain()
    assert type(scheduler.waiting) is ours
    assert sorted(driver.finished_order) == ["U-1", "V-0"]
