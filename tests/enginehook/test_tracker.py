"""Tool-call tracker, tool-call detection and client hints."""

from __future__ import annotations

import json

import pytest

from controlplane.records import PinOutcome
from enginehook.core.pins import ReleaseReason
from enginehook.core.pressure import PressureRule, may_release
from enginehook.core.tracker import (
    ProgramEndReport,
    ToolCallReport,
    ToolCallTracker,
    event_from_record,
    event_record,
    outcome_of_release,
)
from enginehook.hints.flat import Hints
from enginehook.vllm.detect import DetectedCall, detect_tool_call


def test_duration_is_next_arrival_minus_finish_and_hit_is_not_a_queue_sample():
    t = ToolCallTracker("e")
    assert t.turn_finished("p", 1.0, tool="bash", tool_args="ls", ttl_s=2.0, pinned=True) == 0
    assert not t.returning("p")
    t.arrived("p", 1.75)
    t.arrived("p", 9.0)  # a second request of the program does not move the arrival
    assert t.returning("p")
    ev = t.admitted("p", 2.0, pin_held=True)
    assert ev is not None
    assert (ev.duration_s, ev.pin_outcome, ev.admission_delay_s) == (0.75, PinOutcome.HIT, 0.25)
    assert not ev.queue_delay_sample
    assert t.admitted("p", 3.0, pin_held=False) is None


def test_expired_pin_gives_a_queue_delay_sample():
    t = ToolCallTracker("e")
    t.turn_finished("p", 0.0, tool="bash", ttl_s=1.0, pinned=True)
    t.pin_released("p", ReleaseReason.TTL)
    t.arrived("p", 3.0)
    ev = t.admitted("p", 3.5, pin_held=False)
    assert ev is not None
    assert ev.pin_outcome is PinOutcome.EXPIRED
    assert ev.queue_delay_sample
    assert ev.admission_delay_s == 0.5


@pytest.mark.parametrize(
    ("pinned", "reason", "outcome"),
    [
        (False, None, PinOutcome.NOT_PINNED),
        (True, ReleaseReason.PRESSURE, PinOutcome.RELEASED_UNDER_PRESSURE),
        (True, ReleaseReason.BUDGET, PinOutcome.RELEASED_UNDER_PRESSURE),
        (True, ReleaseReason.SHUTDOWN, PinOutcome.UNSPECIFIED),
        (True, None, PinOutcome.UNSPECIFIED),  # gone at admission, no release seen
    ],
)
def test_outcomes(pinned, reason, outcome):
    t = ToolCallTracker("e")
    t.turn_finished("p", 0.0, tool="x", pinned=pinned)
    if reason is not None:
        t.pin_released("p", reason)
    t.arrived("p", 1.0)
    ev = t.admitted("p", 1.0, pin_held=False)
    assert ev is not None
    assert ev.pin_outcome is outcome
    # T learns from known releases only, on the hook as on the control plane.
    assert ev.queue_delay_sample is (outcome is not PinOutcome.UNSPECIFIED)


def test_every_release_reason_has_one_outcome():
    outcomes = {reason: outcome_of_release(reason) for reason in ReleaseReason}
    assert outcomes == {
        ReleaseReason.HIT: PinOutcome.HIT,
        ReleaseReason.TTL: PinOutcome.EXPIRED,
        ReleaseReason.PRESSURE: PinOutcome.RELEASED_UNDER_PRESSURE,
        ReleaseReason.BUDGET: PinOutcome.RELEASED_UNDER_PRESSURE,
        ReleaseReason.PROGRAM_END: PinOutcome.UNSPECIFIED,
        ReleaseReason.REPLACED: PinOutcome.UNSPECIFIED,
        ReleaseReason.SHUTDOWN: PinOutcome.UNSPECIFIED,
        ReleaseReason.CLOSED: PinOutcome.UNSPECIFIED,  # the session ends: no return follows
        ReleaseReason.MOVED: PinOutcome.MOVED,  # it returned to another engine
        ReleaseReason.DROPPED: PinOutcome.MOVED,  # a router sends it to another engine
    }


@pytest.mark.parametrize(
    ("pinned", "reason"),
    [
        (True, None),  # the pin lived until the move
        (True, ReleaseReason.MOVED),  # released as moved first
        (True, ReleaseReason.DROPPED),
        (True, ReleaseReason.TTL),  # it had expired before the move
        (False, None),
    ],
)
def test_a_program_that_moved_reports_its_tool_call_as_moved(pinned, reason):
    # counted among the tool's calls (an unspecified outcome is not), never a sample of T:
    # its next turn was admitted at another engine
    t = ToolCallTracker("e")
    t.turn_finished("p", 0.0, tool="bash", ttl_s=2.0, pinned=pinned)
    if reason is not None:
        t.pin_released("p", reason)
    ev = t.moved("p", 1.5)
    assert ev is not None
    assert (ev.pin_outcome, ev.duration_s) == (PinOutcome.MOVED, 1.5)
    assert not ev.queue_delay_sample


@pytest.mark.parametrize("outcome", list(PinOutcome))
def test_json_form_round_trips_with_the_outcome_by_label(outcome):
    ev = ToolCallReport(
        event_id="e:p:0",
        program_id="p",
        tenant="t",
        tool="bash",
        tool_args=None,
        duration_s=0.5,
        finished_at=1.0,
        turn_index=0,
        chosen_ttl_s=2.0,
        pin_outcome=outcome,
        admission_delay_s=0.1,
        basis="tool",
    )
    line = json.dumps(event_record(ev))
    assert json.loads(line)["pin_outcome"] == outcome.name.lower()
    assert event_from_record(json.loads(line)) == ev
    end = ProgramEndReport("e:p:end", "p", "t", 3, 9.0)
    assert event_from_record(json.loads(json.dumps(event_record(end)))) == end


def test_records_of_earlier_releases_still_read():
    old = {
        "kind": "tool_call",
        "event_id": "e:p:0",
        "program_id": "p",
        "tenant": "t",
        "tool_name": "bash",
        "tool_args": "ls",
        "duration_s": 0.5,
        "finished_at": 1.0,
        "turn_index": 0,
        "ttl_s": 2.0,
        "outcome": "pressure",
        "admission_delay_s": 0.1,
        "basis": "tool",
    }
    event = event_from_record(old)
    assert isinstance(event, ToolCallReport)
    assert event.pin_outcome is PinOutcome.RELEASED_UNDER_PRESSURE
    assert event_from_record({**old, "outcome": "other"}).pin_outcome is PinOutcome.UNSPECIFIED  # type: ignore[union-attr]
    assert event.chosen_ttl_s == 2.0
    end = {"kind": "program_end", "event_id": "e:p:end", "program_id": "p", "tenant": "t"}
    assert event_from_record({**end, "total_turns": 3, "ended_at": 9.0}) == ProgramEndReport(
        "e:p:end", "p", "t", 3, 9.0
    )
    with pytest.raises(ValueError, match="unknown pin outcome 'lost'; valid: unspecified, hit"):
        event_from_record({**old, "outcome": "lost"})
    with pytest.raises(ValueError, match="kind must be 'tool_call' or 'program_end'"):
        event_from_record({**old, "kind": "turn"})


def test_event_ids_unique_per_turn_and_program_end_counts_turns():
    t = ToolCallTracker("eng")
    ids = []
    for k in range(3):
        t.turn_finished("p", float(k), tool="bash")
        t.arrived("p", k + 0.5)
        ev = t.admitted("p", k + 0.5, pin_held=False)
        assert ev is not None
        ids.append(ev.event_id)
    t.turn_finished("p", 4.0, tool=None)
    end = t.program_end("p", 4.0)
    assert end is not None
    assert end.total_turns == 4
    assert end.event_id == "eng:p:0:end"
    assert ids == ["eng:p:0:0", "eng:p:0:1", "eng:p:0:2"]
    assert t.program_end("p", 5.0) is None


def test_a_program_id_used_again_gets_fresh_event_ids():
    # A session id reused after its program ended, and a program back after it was
    # forgotten as abandoned, are new runs: their events must not repeat the first run's
    # ids, or the control plane drops them as duplicates.
    t = ToolCallTracker("eng")
    seen = set()
    for start in (0.0, 10.0):
        t.turn_finished("p", start, tool="bash")
        t.arrived("p", start + 1.0)
        first = t.admitted("p", start + 1.0, pin_held=False)
        end = t.program_end("p", start + 2.0)
        assert first is not None
        assert end is not None
        seen |= {first.event_id, end.event_id}
    t.turn_finished("p", 20.0, tool="bash")
    (forgotten,) = t.forget_idle(5000.0, idle_s=3600.0)
    t.turn_finished("p", 5001.0, tool="bash")
    t.arrived("p", 5002.0)
    back = t.admitted("p", 5002.0, pin_held=False)
    assert back is not None
    assert back.turn_index == 0
    seen |= {forgotten.event_id, back.event_id}
    assert seen == {
        "eng:p:0:0",
        "eng:p:0:end",
        "eng:p:1:0",
        "eng:p:1:end",
        "eng:p:2:end",
        "eng:p:3:0",
    }


def test_forget_idle_bounds_memory():
    t = ToolCallTracker("e")
    t.turn_finished("gone", 0.0, tool="bash")
    t.turn_finished("back", 0.0, tool="bash")
    t.arrived("back", 50.0)
    (end,) = t.forget_idle(100.0, idle_s=60.0)
    # An abandoned program ended where its last turn finished, after the turns it was served.
    assert (end.program_id, end.total_turns, end.finished_at) == ("gone", 1, 0.0)
    assert t.turns_served("gone") == 0
    assert t.returning("back")


def test_detection_sources():
    assert detect_tool_call("```bash\nls\n```") == DetectedCall("bash", "ls", "bash-block")
    assert detect_tool_call(None) is None
    assert detect_tool_call("plain answer") is None
    parsed = detect_tool_call("...", parsed=[("search", '{"q": 1}')])
    assert parsed is not None
    assert (parsed.name, parsed.source) == ("search", "parser")
    tag = detect_tool_call('<tool_call>{"name": "read", "arguments": {"path": "a"}}</tool_call>')
    assert tag is not None
    assert (tag.name, tag.arguments) == ("read", '{"path": "a"}')
    bash = detect_tool_call("THOUGHT\n```bash\ncd repo && pytest -x\n```\n")
    assert bash is not None
    assert bash.arguments == "cd repo && pytest -x"
    submit = "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"
    assert detect_tool_call(submit) is None
    hinted = detect_tool_call("```bash\nls\n```", hint="bash")
    assert hinted is not None
    assert (hinted.source, hinted.arguments) == ("hint", "ls")
    assert detect_tool_call("x", hint="bash", last_turn=True) is None
    assert detect_tool_call("<tool_call>not json</tool_call>") is None


def test_hints_parse_vllm_booleans_and_reject_bad_values():
    h = Hints.from_extra_args({"last_turn": 0, "pin": "false", "tool": "bash", "other": [1]})
    assert (h.last_turn, h.pin, h.tool) == (False, False, "bash")
    assert Hints.from_extra_args(None) == Hints()
    with pytest.raises(ValueError, match="last_turn"):
        Hints.from_extra_args({"last_turn": 2})
    with pytest.raises(ValueError, match="tool"):
        Hints.from_extra_args({"tool": 5})
    with pytest.raises(ValueError, match="pin_ttl_s"):
        Hints.from_extra_args({"pin_ttl_s": "soon"})


def test_pressure_rule():
    assert PressureRule.parse("running") is PressureRule.RUNNING
    with pytest.raises(ValueError, match="running"):
        PressureRule.parse("soft")
    assert may_release(PressureRule.RUNNING, for_running=True, nothing_running=False)
    assert not may_release(PressureRule.NEVER, for_running=True, nothing_running=True)
    assert may_release(PressureRule.ALWAYS, for_running=False, nothing_running=False)
