"""A program that moved to another engine: the engine it left drops its pin at once, reports
the tool call with the duration it really had, and counts no long tool call if the program
comes back later."""

from __future__ import annotations

from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import ToolCallReport
from estimator import Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost


class _Fixed:
    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(30.0, 0.9, 1.0, "fixed", 2.0)


def _engine() -> tuple[PinController[str], MinimalHost]:
    host = MinimalHost(block_size=16)
    controller = PinController(
        SchedulingRules(), host, pool_blocks=100, decider=_Fixed(), engine_id="engine-a"
    )
    return controller, host


def _turn(c: PinController[str], at: float, tool: str | None = "bash") -> None:
    c.arrived("p", at, at)
    c.admitted("p", at)
    c.finished(FinishedTurn("p", tool, "pytest -x", 160), at + 1.0, lambda: (10, "blocks"))


def _tool_calls(host: MinimalHost) -> list[ToolCallReport]:
    return [e for e in host.events if isinstance(e, ToolCallReport)]


def test_the_pin_goes_at_once_and_the_call_has_its_true_duration() -> None:
    c, host = _engine()
    _turn(c, 0.0)  # finishes at 1.0, calls bash, pinned for 30 s
    assert c.pinned("p")
    pin = c.moved_away("p", arrived_at=3.5)  # its next turn arrived elsewhere at 3.5
    assert pin is not None
    assert not c.pinned("p")
    assert host.freed == [("p", "moved")]
    [call] = _tool_calls(host)
    assert call.tool == "bash"
    assert call.duration_s == 2.5


def test_a_later_return_here_is_a_new_program_not_one_long_tool_call() -> None:
    c, host = _engine()
    _turn(c, 0.0)
    c.moved_away("p", arrived_at=3.5)
    _turn(c, 100.0)  # back here long after: no 99 s "tool call" may be recorded
    _turn(c, 103.0)  # ... and its next call here is measured as usual
    durations = [e.duration_s for e in _tool_calls(host)]
    assert durations == [2.5, 2.0]


def test_a_move_of_an_unknown_or_toolless_program_changes_nothing() -> None:
    c, host = _engine()
    assert c.moved_away("never-here", arrived_at=1.0) is None
    _turn(c, 0.0, tool=None)
    assert c.moved_away("p", arrived_at=2.0) is None
    assert _tool_calls(host) == []
