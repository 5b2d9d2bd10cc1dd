"""The contract every registered scheduling policy meets (simulator.policies.POLICIES,
discovered, not listed): it builds from its name, runs a small trace to the end, gives the
same result twice, and every TTL it decides lies between 0 and its rules' cap."""

from __future__ import annotations

import math

import pytest

from enginehook.core.host import FinishedTurn
from estimator import RequestFacts
from simulator.policies import POLICIES, get_scheduling_policy
from simulator.sim import Simulation
from simulator.workloads import generate

HW = "llama3.1-8b-h100"
NAMES = sorted(POLICIES)
TRACE = generate("swe", 6, rate=0.5, seed=11)
CALLS = sorted({(t.tool, t.tool_args, t.tool_duration_s) for p in TRACE for t in p.turns if t.tool})


def test_the_registry_is_not_empty() -> None:
    assert {"vllm", "continuum", "cachettl", "oracle"} <= set(NAMES)
    assert len(CALLS) >= 5


@pytest.mark.parametrize("name", NAMES)
def test_builds_from_its_name(name: str) -> None:
    policy = get_scheduling_policy(name)
    assert type(policy) is POLICIES[name]
    assert policy.name == policy.label == name


@pytest.mark.parametrize("name", NAMES)
def test_runs_a_small_trace_to_the_end_and_again_the_same(name: str) -> None:
    first = Simulation(TRACE, get_scheduling_policy(name), HW).run()
    second = Simulation(TRACE, get_scheduling_policy(name), HW).run()
    assert sorted(p.program_id for p in first.programs) == sorted(p.program_id for p in TRACE)
    assert first.policy == name
    assert first.makespan_s > 0
    assert first == second


@pytest.mark.parametrize("name", [n for n in NAMES if POLICIES[n].uses_pins])
def test_ttls_lie_between_zero_and_the_cap(name: str) -> None:
    policy = get_scheduling_policy(name)
    Simulation(TRACE, policy, HW).run()  # the policy has learned from the trace
    cap = policy.rules.ttl_cap_s
    ttls = []
    for tool, args, duration in CALLS:
        for tokens in (500, 20_000, 128_000):
            facts = RequestFacts(tool=tool, tool_args=args, context_tokens=tokens)
            turn = FinishedTurn("p", tool, args, context_tokens=tokens, true_duration_s=duration)
            ttls.append(policy.decide(facts, turn).ttl_s)
    assert all(0.0 <= ttl <= cap and math.isfinite(ttl) for ttl in ttls), (cap, ttls)
    assert max(ttls) > 0  # a long context makes every pinning policy pin
