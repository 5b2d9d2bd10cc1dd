"""The rollout in the pin controller, without vLLM: a tool outside the rollout in force is
decided and reported as a shadow call (its blocks never taken), with what its pin would
have met; the engine's own setting is read from ``additional_config`` or the environment,
with errors that name where the value came from."""

from __future__ import annotations

import pytest

from controlplane.records import MissReason, NotPinnedCause, PinOutcome
from enginehook.config import HookConfig
from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rollout import Rollout, RolloutState
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import ToolCallReport, event_from_record, event_record
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost


class _Fixed:
    """A policy that always decides ``ttl`` seconds."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(self.ttl, 0.9, 1.0, "fixed", 2.0)


def _controller(rollout: RolloutState, ttl: float = 2.0) -> tuple[PinController[str], MinimalHost]:
    host = MinimalHost()
    rules = SchedulingRules(ttl_cap_s=60.0)
    controller = PinController(
        rules, host, pool_blocks=100, decider=_Fixed(ttl), engine_id="e", rollout=rollout
    )
    return controller, host


def _round(controller: PinController[str], program: str, tool: str, back_after_s: float):
    """A turn calling ``tool`` finishes at 100 s; the program comes back ``back_after_s``
    later and is admitted. Returns (what ``finished`` did, blocks taken, the event)."""
    taken: list[str] = []

    def take() -> tuple[int, str]:
        taken.append(program)
        return 4, f"blocks-of-{program}"

    controller.arrived(program, 90.0, 90.0)
    turn = FinishedTurn(program, tool, context_tokens=500)
    finish = controller.finished(turn, 100.0, take)
    controller.expire(100.0 + back_after_s)
    controller.arrived(program, 100.0 + back_after_s, 100.0 + back_after_s)
    admitted = controller.admitted(program, 100.0 + back_after_s + 0.01)
    assert admitted.turn is not None
    return finish, taken, admitted.turn.event


def test_a_tool_outside_the_rollout_is_decided_and_reported_never_pinned() -> None:
    controller, host = _controller(RolloutState(Rollout.of("only", ["pytest"])))
    finish, taken, event = _round(controller, "a", "bash", back_after_s=1.5)
    assert finish.shadow
    assert not finish.took
    assert taken == []
    assert finish.decision is not None
    assert finish.decision.ttl_s == 2.0
    assert len(controller.pins) == 0
    assert isinstance(event, ToolCallReport)
    assert (event.shadow, event.chosen_ttl_s, event.pin_outcome) == (True, 2.0, PinOutcome.HIT)
    # what really happened: nothing was pinned, and the cache says so
    assert event.cache.reason is MissReason.NOT_PINNED
    assert event.queue_delay_sample is False  # a would-hit, as a real hit, is no sample of T
    assert event_from_record(event_record(event)) == event
    finish, taken, event = _round(controller, "b", "pytest", back_after_s=1.5)
    assert finish.pinned
    assert taken == ["b"]
    assert (event.shadow, event.pin_outcome) == (False, PinOutcome.HIT)
    assert host.events[-1] is event


def test_a_shadow_pin_would_expire_after_its_ttl_and_ttl_zero_would_not_pin() -> None:
    controller, _ = _controller(RolloutState(shadow=True, remote=Rollout.of("all")))
    _, _, late = _round(controller, "a", "bash", back_after_s=2.5)
    assert (late.shadow, late.pin_outcome) == (True, PinOutcome.EXPIRED)
    assert late.queue_delay_sample  # released, as a real expired pin's turn: a sample of T
    zero, _ = _controller(RolloutState(shadow=True), ttl=0.0)
    _, taken, none = _round(zero, "z", "bash", back_after_s=0.1)
    assert taken == []
    assert (none.shadow, none.chosen_ttl_s, none.pin_outcome) == (True, 0.0, PinOutcome.NOT_PINNED)
    assert none.cache.not_pinned_cause is NotPinnedCause.TTL_ZERO


def test_the_rules_ttl_cap_applies_to_the_ttl_a_shadow_pin_would_have() -> None:
    controller, _ = _controller(RolloutState(shadow=True), ttl=500.0)
    _, _, event = _round(controller, "a", "bash", back_after_s=100.0)
    assert (event.chosen_ttl_s, event.pin_outcome) == (60.0, PinOutcome.EXPIRED)


def test_the_engines_own_setting_from_additional_config_or_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("CACHETTL_MODE", "shadow")
    monkeypatch.setenv("CACHETTL_SKIP_TOOLS", "web_search, sleep")
    config = HookConfig.from_additional({})
    assert (config.mode, config.skip_tools) == ("shadow", ["sleep", "web_search"])
    assert config.rollout().keeps_vllm_order
    listed = HookConfig.from_additional({"cachettl": {"mode": "pin", "skip_tools": ["x"]}})
    assert listed.rollout().in_force() == Rollout.of("except", ["x"])  # the config's own wins
    monkeypatch.setenv("CACHETTL_MODE", "watch")
    with pytest.raises(ValueError, match=r"^\$CACHETTL_MODE must be one of pin, shadow"):
        HookConfig.from_additional({})
    monkeypatch.delenv("CACHETTL_MODE")
    monkeypatch.setenv("CACHETTL_PIN_TOOLS", "bash")
    with pytest.raises(ValueError, match="pin_tools and skip_tools exclude each other"):
        HookConfig.from_additional({})
    monkeypatch.delenv("CACHETTL_SKIP_TOOLS")
    monkeypatch.setenv("CACHETTL_PIN_TOOLS", "bash,")
    with pytest.raises(ValueError, match=r"^\$CACHETTL_PIN_TOOLS: tool 2 is empty"):
        HookConfig.from_additional({})
    with pytest.raises(
        ValueError, match=r"^additional_config\.cachettl\.pin_tools: tool 1 is empty"
    ):
        HookConfig.from_additional({"cachettl": {"pin_tools": [""]}})
