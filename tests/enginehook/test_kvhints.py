"""KV-hint envelopes with the retention action: parsing from vLLM's struct, JSON and the
HTTP path's ``vllm_xargs`` text, the merge with flat hints, and what the controller does
with a ceiling and a release."""

from __future__ import annotations

import doctest
import json
import re
from typing import Any

import pytest

import controlplane.kvhints
import enginehook.hints.flat
from controlplane.kvhints import (
    RETENTION_ACTION,
    XARGS_KEY,
    Retention,
    envelope_from_proto,
    envelope_to_proto,
    parse_kv_hints,
    retention_envelope,
    to_vllm,
)
from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import PinOutcome, ToolCallReport
from enginehook.hints.flat import Hints, request_hints
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost


def _envelope(*actions: dict[str, Any]) -> dict[str, Any]:
    return {"protocol_version": "1", "message_id": "m-1", "actions": list(actions)}


def _action(payload: Any, kind: str = RETENTION_ACTION, version: str = "1") -> dict[str, Any]:
    return {"action_id": "a", "action_type": kind, "action_version": version, "payload": payload}


@pytest.mark.parametrize("module", [controlplane.kvhints, enginehook.hints.flat])
def test_docstring_examples(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


def test_every_payload_field_is_read_from_json_its_text_and_vllms_struct() -> None:
    payload = {
        "ttl_s": 12,
        "ttl_ceiling_s": 300.0,
        "last_turn": False,
        "tool": "bash",
        "tool_args": "pytest -x",
        "pin": True,
        "release": True,
        "added_in_a_later_minor": [1, 2],
    }
    envelope = _envelope(_action({"k": 1}, kind="kv.fetch"), _action(payload, version="1.3"))
    want = Retention(12.0, 300.0, False, "bash", "pytest -x", True, True)
    assert parse_kv_hints(envelope) == want
    assert parse_kv_hints(json.dumps(envelope)) == want
    struct = to_vllm(envelope)
    assert type(struct).__module__.startswith("vllm.v1.kv_hints")
    assert parse_kv_hints(struct) == want


def test_other_action_types_and_majors_are_ignored() -> None:
    assert parse_kv_hints(_envelope()) is None
    assert parse_kv_hints(_envelope(_action({"ttl_s": "x"}, kind="kv.prefetch"))) is None
    assert parse_kv_hints(_envelope(_action({"ttl_s": -5}, version="2"))) is None
    assert parse_kv_hints(_envelope(_action({"ttl_s": 1}, version="2.0"))) is None


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        (_envelope(_action({"ttl_s": -1})), "kv_hints.actions[0].payload.ttl_s must be a finite"),
        (_envelope(_action({"ttl_s": True})), "actions[0].payload.ttl_s must be a finite number"),
        (_envelope(_action({"ttl_ceiling_s": "5"})), "payload.ttl_ceiling_s must be a finite"),
        (_envelope(_action({"release": 1})), "kv_hints.actions[0].payload.release must be true"),
        (_envelope(_action({"tool": 3})), "kv_hints.actions[0].payload.tool must be a string"),
        (_envelope(_action({"tool": "x" * 5000})), "payload.tool must be at most 4096"),
        (_envelope(_action([1])), "kv_hints.actions[0].payload must be an object"),
        (_envelope(_action({}, kind="kv.fetch"), {"action_type": 1}), "actions[1].action_type"),
        (_envelope(_action({}, version="one")), "actions[0].action_version must be MAJOR"),
        (_envelope(_action({}), _action({})), "actions[1]: at most one cachettl.retention"),
        ({"protocol_version": "1", "message_id": "m", "actions": {}}, "kv_hints.actions must be"),
        ({"message_id": "m", "actions": []}, "kv_hints.protocol_version must be a string"),
        ([], "kv_hints must be an object"),
        ("{not json", "kv_hints must be a JSON object"),
    ],
)
def test_a_malformed_envelope_names_the_field_path(envelope: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_kv_hints(envelope)


def test_a_parent_session_is_a_flat_hint() -> None:
    assert request_hints({"parent_session_id": "run-1"}).parent_session_id == "run-1"
    assert request_hints({"parent_session_id": ""}).parent_session_id is None
    with pytest.raises(ValueError, match=r"vllm_xargs\.parent_session_id must be a string"):
        request_hints({"parent_session_id": 7})


def test_the_envelope_wins_over_flat_hints_key_by_key() -> None:
    flat = {"pin_ttl_s": 60, "pin_ttl_max_s": 600, "tool": "bash", "pin": 1, "last_turn": 0}
    body = retention_envelope(Retention(ttl_ceiling_s=30.0, pin=False))
    hints = request_hints({**flat, XARGS_KEY: json.dumps(body)})
    assert hints == Hints(tool="bash", pin_ttl_s=60.0, pin=False, pin_ttl_max_s=30.0)
    # vLLM's Request.kv_hints, then the HTTP body's envelope over it.
    offline = to_vllm(retention_envelope(Retention(ttl_s=5.0, tool="grep")))
    both = request_hints({XARGS_KEY: json.dumps(body)}, offline)
    assert (both.pin_ttl_s, both.tool, both.pin, both.pin_ttl_max_s) == (5.0, "grep", False, 30.0)
    assert request_hints({"release": "true"}).release is True
    with pytest.raises(ValueError, match=r"vllm_xargs\.pin_ttl_max_s must be a finite number"):
        request_hints({"pin_ttl_max_s": "soon"})
    with pytest.raises(ValueError, match=r"kv_hints\.actions must be a list"):
        request_hints({XARGS_KEY: json.dumps({"protocol_version": "1", "message_id": "m"})})


def test_read_hints_of_a_vllm_request_logs_and_ignores_a_bad_envelope(caplog) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from enginehook.vllm.requests import read_hints

    good = to_vllm(retention_envelope(Retention(ttl_ceiling_s=2.0, release=True)))
    params = SamplingParams(extra_args={"pin_ttl_s": 3})
    request = Request("r1", [1, 2, 3], params, None, session_id="s", kv_hints=good)
    assert read_hints(request) == Hints(pin_ttl_s=3.0, pin_ttl_max_s=2.0, release=True)
    bad = to_vllm(_envelope(_action({"ttl_s": -1})))
    request = Request("r2", [1, 2, 3], params, None, session_id="s", kv_hints=bad)
    assert read_hints(request) == Hints()
    assert "kv_hints.actions[0].payload.ttl_s must be a finite number >= 0" in caplog.text


def test_the_wire_form_round_trips() -> None:
    envelope = retention_envelope(Retention(ttl_s=42.5, tool="bash", release=False))
    message = envelope_to_proto(envelope)
    assert message.actions[0].payload.fields["ttl_s"].number_value == 42.5
    back = envelope_from_proto(message)
    assert back == envelope
    assert parse_kv_hints(back) == Retention(ttl_s=42.5, tool="bash", release=False)


class _Fixed:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(
            turn.pin_ttl_s if turn.pin_ttl_s is not None else self.ttl, 0.9, 1.0, "fixed"
        )


def _controller(ttl: float, cap: float = 300.0) -> tuple[PinController[str], MinimalHost]:
    host = MinimalHost(free=10_000)
    rules = SchedulingRules(ttl_cap_s=cap)
    return PinController(rules, host, pool_blocks=100, decider=_Fixed(ttl), engine_id="t"), host


def _finish(controller: PinController[str], turn: FinishedTurn, now: float = 1.0) -> float:
    controller.arrived(turn.program_id, 0.0, 0.0)
    finish = controller.finished(turn, now, lambda: (4, "h"))
    pin = controller.pins.get(turn.program_id)
    return pin.ttl_s if finish.pinned and pin is not None else 0.0


def test_a_ceiling_caps_the_decided_ttl_and_the_engine_cap_still_applies() -> None:
    controller, _ = _controller(ttl=3600.0, cap=1800.0)
    assert _finish(controller, FinishedTurn("free", "bash")) == 1800.0  # the engine's cap
    assert _finish(controller, FinishedTurn("5min", "bash", pin_ttl_max_s=300.0)) == 300.0
    assert _finish(controller, FinishedTurn("1h", "bash", pin_ttl_max_s=3600.0)) == 1800.0
    client = FinishedTurn("own", "bash", pin_ttl_s=900.0, pin_ttl_max_s=60.0)
    assert _finish(controller, client) == 60.0  # over the client's own pin_ttl_s too
    assert _finish(controller, FinishedTurn("zero", "bash", pin_ttl_max_s=0.0)) == 0.0
    assert "zero" not in controller.pins


def test_a_release_frees_the_pin_at_once_and_its_turn_ends_the_program() -> None:
    controller, host = _controller(ttl=60.0)
    assert _finish(controller, FinishedTurn("p", "bash", "ls", 320)) == 60.0
    controller.arrived("p", 2.0, 2.0)
    pin = controller.close("p")
    assert pin is not None
    assert pin.handle == "h"
    assert host.freed == [("p", "closed")]
    assert "p" not in controller.pins
    assert controller.admitted("p", 2.1).pin is None
    (event,) = host.events
    assert isinstance(event, ToolCallReport)
    assert event.pin_outcome is PinOutcome.UNSPECIFIED  # like a program end: no outcome
    finish = controller.finished(FinishedTurn("p", None, last_turn=True), 3.0, lambda: (4, "x"))
    assert (finish.took, finish.pinned) == (False, False)
    assert host.events[-1].total_turns == 2  # type: ignore[attr-defined]
    assert controller.close("p") is None  # nothing left to release


# -- vLLM's offline API: Request.kv_hints in a real CPU engine with the hook ---------------


@pytest.fixture(scope="module")
def driver(tiny_model: Any, inproc: None) -> Any:
    from transformers import AutoTokenizer

    from tests.enginehook.driver import Driver, make_llm, shutdown

    hook = {"policy": "fixed", "policy_params": {"ttl_s": 60.0, "skip_slow_tools": False}}
    llm = make_llm(tiny_model, hook)
    yield Driver(llm, AutoTokenizer.from_pretrained(str(tiny_model)))
    shutdown(llm)


def _add(driver: Any, rid: str, ids: list[int], session: str, retention: Retention) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    hints = to_vllm(retention_envelope(retention))
    driver.engine.add_request(
        rid, {"prompt_token_ids": ids}, params, session_id=session, kv_hints=hints
    )


@pytest.mark.slow
def test_offline_kv_hints_set_the_ttl_and_a_release_frees_the_pin_before_any_step(driver) -> None:
    scheduler = driver.scheduler
    for session, retention, ttl in [
        ("off-ttl", Retention(ttl_s=7.0, tool="bash"), 7.0),
        ("off-ceiling", Retention(ttl_ceiling_s=5.0, tool="bash"), 5.0),  # the policy says 60
    ]:
        _add(driver, f"{session}-0", driver.words(200), session, retention)
        driver.drain()
        assert scheduler.pins.get(session).ttl_s == ttl
    prompt = driver.words(200)
    _add(driver, "off-rel-0", prompt, "off-rel", Retention(tool="bash"))
    driver.drain()
    assert "off-rel" in scheduler.pins
    _add(driver, "off-rel-1", prompt + driver.words(20), "off-rel", Retention(release=True))
    assert "off-rel" not in scheduler.pins  # at once: on arrival, before the engine steps
    assert scheduler.metrics.snapshot()["releases"]["closed"] == 1
    driver.drain()
    assert "off-rel" not in scheduler.pins  # and nothing is pinned after the release
    for session in ("off-ttl", "off-ceiling"):
        scheduler.controller.end_program(session, scheduler.clock())
    assert len(scheduler.pins) == 0
