"""A router that asks the control plane gets the TTL the engine would choose.

The engine hook's local path (``enginehook.link.decide.TtlDecider``) and ``DecideTtl`` over a
real gRPC server on a port learn the same events (made by the hook's own tracker, every pin
outcome among them, sent through the hook's one conversion) and are asked the same facts,
load signals included: they must give the same TTL, basis and return probability.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest

from controlplane.records import PinOutcome
from controlplane.rpc.client import ControlPlaneClient, TtlDecision
from controlplane.service import ControlPlane
from controlplane.storage import Store
from enginehook.core.pins import ReleaseReason
from enginehook.core.tracker import ProgramEndReport, ToolCallReport, ToolCallTracker
from enginehook.link.decide import TtlDecider
from enginehook.link.transport import to_program_end, to_tool_call
from estimator import Decision
from tests.support import running

TENANT = "acme"
K = 20  # min_samples: some keys pass it, some are thin, some never seen
POLICY = {"ttl_cap_s": 300.0}
#: (tool, arguments, median duration in seconds)
TOOLS = [
    ("bash", "ls -la", 0.05),
    ("bash", "pytest -x", 12.0),
    ("bash", "grep -rn todo src", 0.4),
    ("search", '{"q": "kv cache"}', 1.5),
    ("edit", None, 0.2),
]
Event = ToolCallReport | ProgramEndReport


def _turn(
    tracker: ToolCallTracker, rng: random.Random, program: str, now: float
) -> tuple[float, ToolCallReport]:
    """One tool call through the hook's tracker, with a random pin fate."""
    tool, args, median = rng.choice(TOOLS)
    pinned = rng.random() < 0.7
    ttl = round(rng.uniform(0.5, 5.0), 3) if pinned else 0.0
    tracker.turn_finished(program, now, tool=tool, tool_args=args, ttl_s=ttl, pinned=pinned)
    fate = rng.random()
    if pinned and fate < 0.25:
        tracker.pin_released(program, ReleaseReason.TTL)
    elif pinned and fate < 0.4:
        tracker.pin_released(program, ReleaseReason.PRESSURE)
    elif pinned and fate < 0.45:
        tracker.pin_released(program, ReleaseReason.REPLACED)  # no outcome: UNSPECIFIED
    held = pinned and fate >= 0.45
    now += round(rng.lognormvariate(math.log(median), 0.8), 6)
    tracker.arrived(program, now)
    now += round(rng.expovariate(3.0), 6)
    event = tracker.admitted(program, now, pin_held=held)
    assert event is not None
    return now, event


def _events(seed: int = 7) -> list[Event]:
    rng = random.Random(seed)
    tracker = ToolCallTracker("eng", tenant=TENANT)
    events: list[Event] = []
    now = 0.0
    for p in range(45):
        program = f"prog-{p}"
        for _ in range(rng.randint(1, 7)):
            now, event = _turn(tracker, rng, program, now)
            events.append(event)
        if p % 9 == 4:  # its next turn arrives at another engine: the call is reported moved
            tracker.turn_finished(program, now, tool="bash", tool_args="ls src", ttl_s=2.0)
            now += round(rng.lognormvariate(math.log(0.05), 0.8), 6)
            moved = tracker.moved(program, now)
            assert moved is not None
            events.append(moved)
            continue
        tracker.turn_finished(program, now, tool=None)
        end = tracker.program_end(program, now)
        assert end is not None
        events.append(end)
    return events


def _send(client: ControlPlaneClient, events: list[Event]) -> None:
    """In the hook's order: runs of tool calls as one batch, program ends one by one."""
    batch: list[ToolCallReport] = []
    for event in [*events, None]:
        if isinstance(event, ToolCallReport):
            batch.append(event)
            continue
        if batch:
            client.record_tool_calls([to_tool_call(e) for e in batch])
            batch = []
        if event is not None:
            end = to_program_end(event)
            client.record_program_end(end.program_id, end.total_turns, end.finished_at)


@pytest.fixture
def both(store: Store) -> Iterator[tuple[TtlDecider, ControlPlaneClient, list[Event]]]:
    events = _events()
    decider = TtlDecider("cachettl", POLICY, tenant=TENANT, min_samples=K)
    for event in events:
        decider.learn(event)
    plane = ControlPlane(store, "cachettl", POLICY, min_samples=K)
    _, token = plane.create_tenant(TENANT)
    with running(plane) as server, ControlPlaneClient(server.target, token) as client:
        _send(client, events)
        yield decider, client, events


FACTS = [
    (tool, args, context, turns, offload, offloaded)
    for tool, args in [
        ("bash", "ls -la"),
        ("bash", "ls src"),
        ("bash", "grep -rn x"),
        ("bash", "pytest -x tests/"),
        ("search", '{"q": "other"}'),
        ("edit", None),
        ("never-seen", None),
    ]
    for context, turns, offload, offloaded in [(8_000, 1, False, None), (32_000, 5, True, 16_000)]
]
#: (waiting_tokens, free_tokens): unknown, idle, saturated, in between.
LOADS = [(None, None), (0, 500_000), (400_000, 0), (30_000, 10_000)]


def _same(local: Decision, remote: TtlDecision) -> None:
    # The wire carries durations in nanoseconds: equal up to that rounding.
    assert remote.basis == local.basis
    assert remote.ttl_s == pytest.approx(local.ttl_s, rel=1e-9, abs=1e-9)
    assert remote.return_probability == pytest.approx(local.return_probability, abs=1e-12)
    assert remote.benefit_s == pytest.approx(local.benefit_s, rel=1e-9, abs=1e-9)


def test_the_control_plane_decides_as_the_engine_does(both) -> None:
    decider, client, events = both
    outcomes = {e.pin_outcome for e in events if isinstance(e, ToolCallReport)}
    assert outcomes == set(PinOutcome)  # every outcome is learned (or not) the same way
    bases, load_moved = set(), 0
    for tool, args, context, turns, offload, offloaded in FACTS:
        ttls = []
        for waiting, free in LOADS:
            local = decider.decide(
                tool=tool,
                tool_args=args,
                context_tokens=context,
                turns_served=turns,
                program_id="prog-new",
                waiting_tokens=waiting,
                free_tokens=free,
                offload=offload,
                offloaded_tokens=offloaded,
            )
            remote = client.decide_ttl(
                tool,
                args or "",
                context,
                program_id="prog-new",
                turns_served=turns,
                waiting_tokens=waiting,
                free_tokens=free,
                offload=offload,
                offloaded_tokens=offloaded,
            )
            _same(local, remote)
            bases.add(local.basis)
            ttls.append(local.ttl_s)
        load_moved += len(set(ttls)) > 1
    assert bases == {"invocation", "tool", "all-tools"}  # never-seen: the tenant's pool
    assert load_moved >= 3  # the load signals reach the policy, on both sides


def test_without_load_signals_holding_is_priced_as_if_the_queue_were_full(both) -> None:
    decider, client, _ = both
    busy = dict(waiting_tokens=400_000, free_tokens=0)
    full = client.decide_ttl("bash", "grep -rn x", 8_000, turns_served=3)
    saturated = client.decide_ttl("bash", "grep -rn x", 8_000, turns_served=3, **busy)
    idle = client.decide_ttl(
        "bash", "grep -rn x", 8_000, turns_served=3, waiting_tokens=0, free_tokens=10**6
    )
    assert (full.ttl_s, full.basis) == (saturated.ttl_s, saturated.basis)
    assert idle.ttl_s > full.ttl_s  # an idle engine holds through slower calls
    local = decider.decide(
        tool="bash",
        tool_args="grep -rn x",
        context_tokens=8_000,
        turns_served=3,
        waiting_tokens=0,
        free_tokens=10**6,
    )
    _same(local, idle)
