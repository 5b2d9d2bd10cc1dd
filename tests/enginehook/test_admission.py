"""ThunderAgent's program-level admission (enginehook.core.admission) and its controller rule."""

import pytest

from enginehook.core.admission import BUFFER_PER_PROGRAM, FORCE_RESUME_S, ProgramAdmission
from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules


def test_a_new_program_waits_when_it_does_not_fit_or_others_are_paused():
    a = ProgramAdmission(capacity_tokens=1_000)
    assert a.arrived("p", 800, now=0.0)
    assert not a.arrived("q", 200, now=0.0)  # 800 + 100 + 200 + 100 > 1,000
    assert a.held("q")
    # a small program that would fit still waits behind the paused one (fairness)
    assert not a.arrived("r", 10, now=0.0)
    assert a.paused_count() == 2


def test_over_capacity_pauses_acting_programs_smallest_first_then_marks_reasoning():
    a = ProgramAdmission(capacity_tokens=10_000)
    for pid, tokens in (("small", 1_000), ("mid", 2_000), ("big", 3_000)):
        assert a.arrived(pid, tokens, now=0.0)
    a.acting("small", 1_500, now=1.0)
    a.acting("mid", 2_500, now=1.0)
    # contexts grew: used = 1,500 + 2,500 + 3,000 + 300 = 7,300 (fits); grow "big"
    a.arrived("big", 6_000, now=2.0)  # its next request (REASONING with 6,000)
    a.tick(5.0)  # 1,500 + 2,500 + 6,000 + 300 = 10,300 > 10,000: pause the small acting
    assert a.held("small")
    assert not a.held("mid")
    assert not a.held("big")
    assert not a.arrived("small", 1_600, now=6.0)  # its return waits


def test_a_marked_reasoning_program_is_paused_when_its_request_ends():
    a = ProgramAdmission(capacity_tokens=5_000)
    assert a.arrived("p", 2_000, now=0.0)
    assert a.arrived("q", 2_500, now=0.0)
    a.arrived("p", 2_600, now=1.0)  # both REASONING, 5,300 > 5,000
    a.tick(1.0)
    assert not a.held("p")
    assert not a.held("q")
    a.acting("p", 2_700, now=2.0)
    assert not a.held("p")
    a.acting("q", 2_600, now=2.0)  # the smallest (q, 2,500) was marked
    assert a.held("q")


def test_paused_programs_are_resumed_at_the_next_check_once_they_fit():
    a = ProgramAdmission(capacity_tokens=3_000, interval_s=5.0)
    assert a.arrived("run", 2_500, now=0.0)
    assert not a.arrived("new", 500, now=0.0)
    a.acting("run", 2_600, now=1.0)
    a.tick(1.0)  # 2,600 + 100 used: "new" (500 + 100) still does not fit
    assert a.held("new")
    a.ended("run")
    assert a.tick(2.0) == []  # not due before 6.0
    assert a.tick(6.0) == ["new"]
    assert not a.held("new")


def test_a_paused_program_with_a_waiting_request_goes_before_new_programs():
    a = ProgramAdmission(capacity_tokens=3_000)
    assert a.arrived("p", 1_000, now=0.0)
    assert a.arrived("hog", 1_500, now=0.0)
    a.acting("p", 1_200, now=1.0)
    a.arrived("hog", 1_900, now=1.0)  # 1,200 + 1,900 + 200 > 3,000: pause acting p
    a.tick(1.0)
    assert a.held("p")
    assert not a.arrived("new", 1_100, now=2.0)
    assert not a.arrived("p", 1_900, now=3.0)  # p returns while paused
    a.acting("hog", 1_950, now=4.0)
    a.ended("hog")  # free 3,000: p (2,000) first; new (1,200) no longer fits beside it
    assert a.tick(6.0) == ["p"]
    assert a.held("new")


def test_best_fit_decreasing_takes_priority_groups_then_largest_first():
    a = ProgramAdmission(capacity_tokens=2_000)
    assert a.arrived("hog", 1_900, now=0.0)
    for pid, tokens in (("n1", 400), ("n2", 700), ("n3", 900)):
        assert not a.arrived(pid, tokens, now=0.0)
    a.ended("hog")
    # free 2,000: ascending within the group: n1 (500) + n2 (800) fit, n3 (1,000) does not
    assert a.tick(1.0) == ["n2", "n1"]  # resumed largest first
    assert a.held("n3")


def test_a_program_paused_for_thirty_minutes_is_forced_back():
    a = ProgramAdmission(capacity_tokens=1_000)
    assert a.arrived("hog", 850, now=0.0)
    assert not a.arrived("late", 500, now=0.0)
    a.tick(FORCE_RESUME_S - 1.0)
    assert a.held("late")
    assert a.tick(FORCE_RESUME_S + 10.0) == ["late"]


def test_capacity_counts_a_buffer_per_active_program():
    a = ProgramAdmission(capacity_tokens=1_000, acting_token_weight=0.5)
    a.arrived("p", 400, now=0.0)
    assert a.used_tokens() == 400 + BUFFER_PER_PROGRAM
    a.acting("p", 600, now=1.0)
    assert a.used_tokens() == 0.5 * 600 + BUFFER_PER_PROGRAM


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="capacity_tokens must be >= 1"):
        ProgramAdmission(0)
    with pytest.raises(ValueError, match="interval_s must be a finite number > 0"):
        ProgramAdmission(10, interval_s=0.0)
    with pytest.raises(ValueError, match="admission must be one of: none, thunderagent"):
        SchedulingRules(admission="gate")
    with pytest.raises(ValueError, match="admission_interval_s must be > 0"):
        SchedulingRules(admission_interval_s=0.0)


class _Host:
    def __init__(self) -> None:
        self.events: list[object] = []

    def free_tokens(self) -> int:
        return 0

    def waiting_requests(self):
        return iter(())

    def waiting_programs(self):
        return ()

    def pinned_tokens(self, pin):
        return 0

    def pin_released(self, pin, reason):
        pass

    def emit(self, event):
        self.events.append(event)


def test_the_controller_holds_paused_programs_and_sorts_them_last():
    rules = SchedulingRules(ordering="fcfs", admission="thunderagent")
    controller: PinController[int] = PinController(
        rules, _Host(), pool_blocks=64, decider=None, engine_id="t", block_size=16
    )  # 1,024 tokens
    controller.arrived("p", 0.0, 0.0, prompt_tokens=800)
    controller.arrived("q", 1.0, 1.0, prompt_tokens=300)
    assert controller.may_admit("p")
    assert not controller.may_admit("q")
    held = controller.order_key(0, False, "q", 1.0, "q#0")
    free = controller.order_key(0, False, "p", 5.0, "p#1")
    assert free < held
    controller.finished(FinishedTurn("p", None, last_turn=True), 2.0, lambda: (0, 0))
    assert controller.next_admission_check() is not None
    assert controller.admission_tick(5.0)
    assert controller.may_admit("q")


def test_without_admission_nothing_is_held_and_keys_are_the_orderings():
    controller: PinController[int] = PinController(
        SchedulingRules(ordering="fcfs"), _Host(), pool_blocks=4, decider=None, engine_id="t"
    )
    controller.arrived("p", 0.0, 0.0, prompt_tokens=10_000)
    assert controller.may_admit("p")
    assert controller.next_admission_check() is None
    assert controller.order_key(0, False, "p", 0.0, "p#0") == (0, 1, 0.0, "p#0")
    assert not controller.admission_tick(100.0)
