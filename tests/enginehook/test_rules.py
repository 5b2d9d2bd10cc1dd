"""The scheduling rules: one object, each default defined once, strategies by name."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest

from enginehook.config import HookConfig
from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.pins import Pin
from enginehook.core.pressure import PressureRule
from enginehook.core.registries import ORDERINGS, VICTIMS
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import ProgramEndReport
from estimator import DEFAULT_TTL_CAP_S, Decision, RequestFacts
from tests.enginehook.hosts import MinimalHost

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("enginehook", "simulator", "estimator", "controlplane")
#: Names the rules went by before they were one object.
ALIASES = {
    "ttl_cap": "ttl_cap_s",
    "budget_fraction": "budget_share",
    "order_window": "order_window_s",
}


def _literal(node: ast.expr | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None


def _definitions(tree: ast.AST) -> list[tuple[str, object, int]]:
    """``(name, literal default, line)`` of every parameter default, annotated class
    attribute, ``add_argument(..., default=...)`` and dict entry that names a rule."""
    rules = set(SchedulingRules.names()) | set(ALIASES)
    found: list[tuple[str, object, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(
                zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
            )
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d]
            found += [(a.arg, _literal(d), node.lineno) for a, d in pairs if a.arg in rules]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id in rules and node.value is not None:
                found.append((node.target.id, _literal(node.value), node.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flag = str(_literal(node.args[0]) if node.args else "").lstrip("-").replace("-", "_")
            for keyword in node.keywords:
                if keyword.arg == "default" and flag in rules:
                    found.append((flag, _literal(keyword.value), node.lineno))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                name = _literal(key)
                if isinstance(name, str) and name in rules:
                    found.append((name, _literal(value), node.lineno))
    return found


def test_each_rule_default_is_defined_once() -> None:
    """No module restates a rule's default: a parameter, field, flag or settings entry
    named after a rule (or its old name) holding the rule's default value as a literal."""
    defaults = {name: getattr(SchedulingRules(), name) for name in SchedulingRules.names()}
    defaults = {k: getattr(v, "value", v) for k, v in defaults.items()}
    restated = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "rules.py" or "_gen" in path.parts:
                continue
            for name, value, line in _definitions(ast.parse(path.read_text())):
                default = defaults[ALIASES.get(name, name)]
                if value is not None and value == default:
                    restated.append(f"{path.relative_to(ROOT)}:{line}: {name} = {value!r}")
    assert restated == [], "defaults restated outside enginehook/core/rules.py"


def test_the_ttl_cap_constant_is_the_rules_and_the_estimators() -> None:
    from estimator import CachettlPolicy

    assert SchedulingRules().ttl_cap_s == DEFAULT_TTL_CAP_S == CachettlPolicy().ttl_cap_s
    assert HookConfig().rules == SchedulingRules()


def test_every_rule_has_help_and_parses_from_text() -> None:
    helps = SchedulingRules.help()
    assert set(helps) == set(SchedulingRules.names())
    assert all(len(text) > 10 for text in helps.values())
    rules = SchedulingRules.parse(
        {
            "pressure": "always",
            "tier_pressure": "none",
            "ttl_cap_s": "inf",
            "victim": "latest-expiry",
        }
    )
    assert rules.pressure is PressureRule.ALWAYS
    assert rules.tier_pressure is None
    assert math.isinf(rules.ttl_cap_s)
    assert rules.in_force(cpu_tier=True) == (PressureRule.ALWAYS, 0.0)
    with pytest.raises(ValueError, match="unknown scheduling rule 'cap'; valid: pressure"):
        SchedulingRules.parse({"cap": 1})
    with pytest.raises(
        ValueError, match="ordering must be one of: fcfs, las, pinned-las, pinned-program, plas"
    ):
        SchedulingRules(ordering="lifo")
    with pytest.raises(ValueError, match=r"budget_share must be in \[0, 1\], got 1.5"):
        SchedulingRules(budget_share=1.5)


def _pin(program: str, blocks: int, loss: float, arrival: float, expires: float) -> Pin[None]:
    return Pin(program, blocks, 0.0, expires, expires, 1.0, loss, program_arrival=arrival)


def test_victim_strategies() -> None:
    pins = [_pin("a", 4, 2.0, 1.0, 10.0), _pin("b", 4, 0.5, 3.0, 20.0), _pin("c", 8, 0.1, 2.0, 5.0)]

    def names(chosen: list[Pin[Any]]) -> list[str]:
        return [p.program_id for p in chosen]

    assert names(VICTIMS["lowest-loss"](pins, 6, 0.0, {"c"})) == ["b", "a"]  # waiting: last
    assert names(VICTIMS["lowest-loss"](pins, 12, 0.0, {"c"})) == ["b", "a", "c"]
    assert names(VICTIMS["latest-arrival"](pins, 6, 0.0, ())) == ["b", "c"]
    assert names(VICTIMS["latest-expiry"](pins, 100, 0.0, ())) == ["b"]  # one per attempt
    assert VICTIMS["lowest-loss"](pins, 0, 0.0, ()) == []


class _Fixed:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.seen: list[RequestFacts] = []

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        self.seen.append(facts)
        return Decision(self.ttl, 0.9, 1.0, "fixed", 2.0)


def _controller(rules: SchedulingRules, ttl: float = 5.0) -> tuple[PinController[str], MinimalHost]:
    host = MinimalHost()
    return PinController(rules, host, pool_blocks=100, decider=_Fixed(ttl), engine_id="t"), host


def test_a_sub_agent_is_scheduled_as_part_of_its_parent() -> None:
    controller, _ = _controller(SchedulingRules())
    controller.arrived("parent", 0.0, 0.0)
    controller.arrived("other", 5.0, 5.0)
    for program in ("parent", "other"):  # served, nothing pinned
        controller.finished(FinishedTurn(program, None, context_tokens=320), 6.0, lambda: (0, ""))
    controller.arrived("parent/agent", 9.0, 9.0, parent="parent")
    controller.arrived("orphan", 9.0, 9.0, parent="ended-long-ago")  # unknown: its own
    controller.arrived("new", 9.0, 9.0)
    first = controller.arrivals.first
    assert (first("parent/agent", -1), first("orphan", -1)) == (0.0, 9.0)
    # Its first request has the parent's service: not a new program, so the new session
    # goes first, and the sub-agent takes the parent's place, ahead of the newer program.
    assert controller.attained_tokens("parent/agent") == controller.attained_tokens("parent") > 0
    assert controller.attained_tokens("orphan") == 0
    keys = {p: controller.order_key(0, False, p, 9.0, p) for p in ("other", "parent/agent", "new")}
    assert keys["new"] < keys["parent/agent"] < keys["other"]


def test_the_lifecycle_of_one_program() -> None:
    controller, host = _controller(SchedulingRules())
    controller.arrived("p", 0.0, 0.0)
    assert controller.admitted("p", 0.1).pin is None  # first turn: nothing pinned, nothing pending
    finish = controller.finished(FinishedTurn("p", "bash", "ls", 320), 1.0, lambda: (20, "h"))
    assert (finish.took, finish.pinned, finish.handle) == (True, True, "h")
    assert controller.pinned("p")
    controller.arrived("p", 1.5, 1.5)
    pin = controller.admitted("p", 1.7).pin
    assert pin is not None
    assert pin.handle == "h"
    assert host.freed == [("p", "hit")]
    (event,) = host.events
    assert (event.pin_outcome.label, event.duration_s) == ("hit", 0.5)  # type: ignore[attr-defined]
    controller.finished(FinishedTurn("p", None, last_turn=True), 3.0, lambda: (0, ""))
    assert host.events[-1].total_turns == 2  # type: ignore[attr-defined]
    assert controller.arrivals.first("p", -1.0) == -1.0  # forgotten


def test_expiry_keeps_a_pin_whose_program_waits_and_relieve_spares_the_requester() -> None:
    controller, host = _controller(SchedulingRules(pressure=PressureRule.ALWAYS))
    for program in ("a", "b"):
        controller.arrived(program, 0.0, 0.0)
        turn = FinishedTurn(program, "bash", None, 160)
        controller.finished(turn, 0.0, lambda p=program: (10, p))  # type: ignore[misc]
    host.waiting = [("a", 400)]
    assert [pin.program_id for pin in controller.expire(6.0)] == ["b"]
    assert controller.pinned("a")  # overdue, but its program's next request is waiting
    assert not controller.pinned("b")
    controller.finished(FinishedTurn("b", "bash", None, 160), 6.0, lambda: (10, "b"))
    released = controller.relieve(50, "a", for_running=False, nothing_running=False, now=6.5)
    assert released == 1
    assert controller.pinned("a")
    assert ("b", "pressure") in host.freed


def test_running_pressure_rule_and_the_load_signals() -> None:
    controller, host = _controller(SchedulingRules())  # pressure: running
    controller.arrived("a", 0.0, 0.0)
    controller.finished(FinishedTurn("a", "bash", None, 160), 0.0, lambda: (10, "a"))
    assert controller.relieve(5, "x", for_running=False, nothing_running=False, now=1.0) == 0
    assert controller.relieve(5, "x", for_running=True, nothing_running=False, now=1.0) == 1
    host.waiting = [("a", 500), (None, 700), ("c", 300), ("d", 5_000)]
    controller.finished(FinishedTurn("a", "bash", None, 200), 2.0, lambda: (10, "a"))
    facts = controller.decider.seen[-1]  # type: ignore[union-attr]
    # Before the pin: a's turn needs its 500 tokens; the walk stops once past free + context.
    assert (facts.waiting_tokens, facts.free_tokens, facts.turns_served) == (1_500, 1_000, 2)
    # With a's 10 blocks pinned its waiting turn needs 500 - 160; d is never counted.
    assert controller.load(200) == (340 + 700 + 300, 1_000)


def test_a_first_turn_reclaims_a_pin_once_it_has_waited_longer_than_the_pins_loss() -> None:
    controller, host = _controller(SchedulingRules())  # pressure: running
    for program in ("a", "r"):
        controller.arrived(program, 0.0, 0.0)
        turn = FinishedTurn(program, "bash", None, 160)
        controller.finished(turn, 0.0, lambda p=program: (10, p))  # type: ignore[misc]
    (pin,) = [p for p in controller.pins if p.program_id == "a"]
    loss = pin.expected_loss_s(1.0)  # F·B = 0.9 × 2 s, 4 of the 5 s still to run: 1.44 s
    assert loss == pytest.approx(1.44)
    assert controller.attained_tokens("r") > 0
    assert controller.attained_tokens("n") == 0

    def relieve(requester: str, waited_s: float) -> int:
        return controller.relieve(
            10, requester, for_running=False, nothing_running=False, now=1.0, waited_s=waited_s
        )

    assert relieve("n", loss - 0.1) == 0  # the newcomer has lost less than a miss would cost
    assert relieve("r", 100.0) == 0  # a returning turn keeps the program order's rule
    host.waiting = [("r", 200)]
    assert relieve("n", loss + 0.1) == 1  # r's pin is about to pay off: only a's goes
    assert host.freed == [("a", "pressure")]
    assert controller.pinned("r")
    assert not controller.pinned("a")
    off, _ = _controller(SchedulingRules(first_turn_reclaim=False))
    off.arrived("a", 0.0, 0.0)
    off.finished(FinishedTurn("a", "bash", None, 160), 0.0, lambda: (10, "a"))
    assert off.relieve(10, "n", for_running=False, nothing_running=False, now=1.0, waited_s=9) == 0
    with pytest.raises(ValueError, match="first_turn_reclaim must be one of: 0, 1"):
        SchedulingRules.parse({"first_turn_reclaim": "sometimes"})
    assert SchedulingRules.parse({"first_turn_reclaim": "off"}).first_turn_reclaim is False


def test_waiting_reclaim_lets_a_returning_turn_take_a_pin_once_it_has_waited_its_loss() -> None:
    """Off by default (a returning turn waits for running work or expiry, as above); on, any
    waiting request of a program reclaims as a first turn does: priced pins of programs with
    nothing waiting, once it has waited longer than their expected loss."""
    assert SchedulingRules().waiting_reclaim is False
    controller, host = _controller(SchedulingRules(waiting_reclaim=True))
    for program in ("a", "b", "r"):
        controller.arrived(program, 0.0, 0.0)
        turn = FinishedTurn(program, "bash", None, 160)
        controller.finished(turn, 0.0, lambda p=program: (10, p))  # type: ignore[misc]
    loss = next(p for p in controller.pins if p.program_id == "a").expected_loss_s(1.0)
    assert controller.attained_tokens("r") > 0  # r returns: not a first turn

    def relieve(requester: str | None, waited_s: float) -> int:
        return controller.relieve(
            10, requester, for_running=False, nothing_running=False, now=1.0, waited_s=waited_s
        )

    assert relieve("r", loss - 0.1) == 0  # it has lost less than a miss would cost
    assert relieve(None, 100.0) == 0  # a request without a program takes none
    host.waiting = [("r", 200), ("b", 200)]
    assert relieve("r", loss + 0.1) == 1  # never its own pin, nor b's (b is waiting)
    assert host.freed == [("a", "pressure")]
    assert controller.pinned("r")
    assert controller.pinned("b")
    assert SchedulingRules.parse({"waiting_reclaim": "on"}).waiting_reclaim is True


def test_an_abandoned_program_is_forgotten_and_its_end_reported() -> None:
    controller, host = _controller(SchedulingRules())
    controller.arrived("s", 0.0, 0.0)
    controller.finished(FinishedTurn("s", "bash", None, 160), 1.0, lambda: (10, "s"))
    controller.arrived("s", 2.0, 2.0)
    controller.admitted("s", 2.0)
    controller.finished(FinishedTurn("s", "bash", None, 320), 3.0, lambda: (20, "s"))
    assert controller.forget_idle(50.0, idle_s=60.0) == []  # not idle long enough
    assert controller.forget_idle(100.0, idle_s=60.0) == ["s"]  # a step limit, say
    end = host.events[-1]
    assert isinstance(end, ProgramEndReport)
    assert (end.program_id, end.total_turns, end.finished_at) == ("s", 2, 3.0)
    assert controller.attained_tokens("s") == 0  # forgotten: a later turn starts anew
    assert controller.forget_idle(200.0, idle_s=60.0) == []


def test_orderings_are_registered_and_priority_comes_first() -> None:
    assert {"fcfs", "program", "program-fcfs", "pinned-program", "plas"} <= set(ORDERINGS)
    # The paper's order: no head start, and new programs do not go ahead of pins.
    paper = SchedulingRules(first_turn_head_start_s=0.0, first_turn_over_pins=False)
    controller, _ = _controller(paper)
    controller.arrived("old", 0.0, 0.0)
    controller.arrived("new", 5.0, 5.0)
    keys = {
        "old": controller.order_key(0, False, "old", 9.0, "old-2"),
        "new": controller.order_key(0, False, "new", 5.0, "new-1"),
        "urgent": controller.order_key(-1, False, "new", 6.0, "new-2"),
    }
    assert sorted(keys, key=keys.__getitem__) == ["urgent", "old", "new"]
    # The default: a new program's first turn goes before a returning (unpinned) turn.
    controller, _ = _controller(SchedulingRules())
    controller.arrived("old", 0.0, 0.0)
    controller.finished(FinishedTurn("old", None, last_turn=False), 1.0, lambda: (0, ""))
    controller.arrived("new", 5.0, 5.0)
    returning = controller.order_key(0, False, "old", 9.0, "old-2")
    assert controller.order_key(0, False, "new", 5.0, "new-1") < returning


def test_by_default_a_new_program_goes_ahead_of_a_pinned_returning_turn() -> None:
    """A new session never waits behind pinned returning turns (behind a router, sessions
    of other engines' programs keep arriving); only with the flag off does a pin go first."""
    for rules, new_first in (
        (SchedulingRules(), True),
        (SchedulingRules().replace(first_turn_over_pins=False), False),
    ):
        controller, _ = _controller(rules)
        controller.arrived("old", 0.0, 0.0)
        finish = controller.finished(FinishedTurn("old", "bash", "ls", 320), 1.0, lambda: (20, "h"))
        assert finish.pinned
        assert controller.pinned("old")
        controller.arrived("new", 5.0, 5.0)
        new = controller.order_key(0, False, "new", 5.0, "new-1")
        assert (new < controller.order_key(0, False, "old", 9.0, "old-2")) is new_first


def test_a_strategy_name_is_registered_once() -> None:
    from enginehook.core.registries import register_ordering, register_victims

    with pytest.raises(ValueError, match="a victim strategy named 'lowest-loss' is already"):
        register_victims("lowest-loss")(VICTIMS["latest-expiry"])
    with pytest.raises(ValueError, match="an ordering named 'fcfs' is already registered"):
        register_ordering("fcfs")(ORDERINGS["program"])
    assert VICTIMS["lowest-loss"] is not VICTIMS["latest-expiry"]  # nothing was replaced
