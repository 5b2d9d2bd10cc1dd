"""The contract every registered TTL policy meets (estimator.POLICIES, discovered, not
listed): it builds from its name, decides before and after learning, and its decisions are
bounded, well formed and reproducible."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from estimator import DEFAULT_TTL_CAP_S, POLICIES, Decision, Models, RequestFacts, get_policy

NAMES = sorted(POLICIES)
TOOLS = ("bash", "python", "grep")
FACTS = [
    RequestFacts(tool=tool, tool_args=args, context_tokens=tokens)
    for tool in TOOLS
    for args in (None, "ls -la", "pytest -x")
    for tokens in (0, 2_000, 128_000)
] + [RequestFacts(tool="bash", reload_cost_s=30.0, queue_delay_s=5.0, offload=True)]


def _learned(name: str, seed: int = 7) -> Models:
    """Models of ``name``'s kind after a small seeded workload of three tools."""
    models = get_policy(name).new_models(min_samples=5)
    rng = np.random.default_rng(seed)
    for i in range(120):
        tool = TOOLS[i % 3]
        models.record_tool_call(tool, "ls -la" if i % 2 else None, float(rng.lognormal(0, 1)))
        models.record_queue_delay(float(rng.exponential(0.5)))
        if i % 10 == 9:
            models.record_program_end(10)
    return models


def _cap(policy: object) -> float:
    cap = getattr(policy, "ttl_cap_s", DEFAULT_TTL_CAP_S)
    assert isinstance(cap, float)
    return cap


def _well_formed(decision: Decision, cap: float) -> None:
    assert isinstance(decision, Decision)
    assert 0.0 <= decision.ttl_s <= cap
    assert 0.0 <= decision.return_probability <= 1.0
    assert math.isfinite(decision.expected_benefit_s)
    assert decision.benefit_s >= 0.0
    assert decision.basis


def test_the_registry_is_not_empty() -> None:
    assert {"cachettl", "continuum", "fixed", "none"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_builds_from_its_name(name: str) -> None:
    policy = get_policy(name)
    assert type(policy) is POLICIES[name]
    assert policy.name == name
    assert repr(policy).startswith(type(policy).__name__ + "(")


@pytest.mark.parametrize("name", NAMES)
def test_decides_before_any_learning(name: str) -> None:
    policy = get_policy(name)
    models = policy.new_models()
    for facts in FACTS:
        _well_formed(policy.decide(facts, models), _cap(policy))


@pytest.mark.parametrize("name", NAMES)
def test_decisions_after_learning_are_bounded_and_reproducible(name: str) -> None:
    first, second = get_policy(name), get_policy(name)
    models_a, models_b = _learned(name), _learned(name)
    for facts in FACTS:
        decision = first.decide(facts, models_a)
        _well_formed(decision, _cap(first))
        assert second.decide(facts, models_b) == decision


@pytest.mark.parametrize(
    "name", [n for n in NAMES if "ttl_cap_s" in inspect.signature(POLICIES[n]).parameters]
)
def test_a_given_cap_bounds_every_ttl(name: str) -> None:
    models = _learned(name)
    uncapped = max(get_policy(name).decide(facts, models).ttl_s for facts in FACTS)
    capped = max(get_policy(name, ttl_cap_s=0.5).decide(facts, models).ttl_s for facts in FACTS)
    assert capped <= 0.5 < uncapped
