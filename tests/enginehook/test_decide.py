"""TTL decisions from estimator policies on the local snapshot, and local learning."""

from __future__ import annotations

import pytest

from enginehook.core.tracker import ToolCallTracker
from enginehook.link.decide import TtlDecider
from estimator import Level


def test_local_learning_moves_the_policy_off_cold_start():
    decider = TtlDecider("continuum", min_samples=5)
    first = decider.decide(tool="bash", tool_args="ls", context_tokens=4000, turns_served=1)
    assert first.basis == "cold-start"
    t = ToolCallTracker("e")
    for k in range(10):
        t.turn_finished("p", 10.0 * k, tool="bash", tool_args="ls")
        t.arrived("p", 10.0 * k + 0.2)
        ev = t.admitted("p", 10.0 * k + 0.3, pin_held=False)
        assert ev is not None
        decider.learn(ev)
    later = decider.decide(
        tool="bash", tool_args="ls", context_tokens=4000, turns_served=1, reload_cost_s=1.0
    )
    assert later.basis == "tool"
    assert later.ttl_s == pytest.approx(0.2)
    assert decider.models.workload("default").queue.n_samples == 10


def test_snapshot_replacement_and_client_override():
    decider = TtlDecider("none")
    assert decider.decide(tool="x", tool_args=None, context_tokens=1, turns_served=0).ttl_s == 0
    other = decider.policy.new_models()
    decider.replace_models(other, version="v7")
    assert decider.models is other
    assert decider.snapshot_version == "v7"
    d = decider.decide(tool="x", tool_args=None, context_tokens=1, turns_served=0, pin_ttl_s=4)
    assert (d.ttl_s, d.basis) == (4, "client")


def test_learning_in_the_background():
    decider = TtlDecider("continuum", min_samples=2)
    t = ToolCallTracker("e")
    for k in range(5):
        t.turn_finished("p", float(k), tool="grep")
        t.arrived("p", k + 0.1)
        event = t.admitted("p", k + 0.1, pin_held=True)
        assert event is not None
        decider.learn_later(event)
    assert decider.wait_learned()
    model = decider.models.durations.model(Level.TOOL, "grep")
    assert model is not None
    assert model.n_samples == 5
    decider.close()
