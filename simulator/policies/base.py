"""The base of the simulator's policies: parameters, the registry, and vLLM's behaviour.

A policy tells the simulation's :class:`enginehook.core.lifecycle.PinController` three things:
its :class:`~enginehook.core.rules.SchedulingRules` (queue order, pressure rule, victims, TTL
cap, pin budget), whether and how long to pin (``decide``, the controller's
:class:`~enginehook.core.lifecycle.Decider`) and what it learns from the events the controller
emits. Everything else runs in the controller the vLLM hook runs too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from enginehook.core.host import FinishedTurn
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import ProgramEndReport, ToolCallReport
from estimator import Decision, HardwareProfile, Models, RequestFacts, get_profile
from estimator.signatures import SHELL_TOOLS
from simulator.trace import Program

__all__ = [
    "POLICIES",
    "Param",
    "SchedulingPolicy",
    "get_scheduling_policy",
    "paper_tool_key",
    "register_scheduling_policy",
    "rule_params",
    "split_policy_list",
]


def paper_tool_key(tool: str, args: str | None) -> str:
    """The paper's tool type (its Appendix A): the first word of a shell command, else the
    tool's name.

    >>> paper_tool_key("bash", "cd /testbed && pytest -x"), paper_tool_key("fetch_url", "{}")
    ('cd', 'fetch_url')
    """
    if tool in SHELL_TOOLS and args:
        words = args.split()
        if words:
            return words[0].rsplit("/", 1)[-1]
    return tool


@dataclass(frozen=True, slots=True)
class Param:
    """One tunable of a policy: how to read it from text, its default, its help."""

    parse: Callable[[str], Any]
    default: Any
    help: str


def _rule_parser(name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = SchedulingRules.parse({name: text}, base=SchedulingRules())
        return getattr(value, name)

    return parse


def rule_params(rules: SchedulingRules) -> dict[str, Param]:
    """A parameter per scheduling rule, defaulting to ``rules``' values."""
    helps = SchedulingRules.help()
    return {
        name: Param(_rule_parser(name), getattr(rules, name), helps[name])
        for name in SchedulingRules.names()
    }


class SchedulingPolicy:
    """Base: vLLM's behaviour (FCFS, no pins). Parameters (``PARAMS``) are given as
    keyword arguments or in a spec string ``name(key=value,...)``; a pinning policy's
    rule parameters may also come as a whole object, ``rules=SchedulingRules(...)``."""

    name: ClassVar[str] = "vllm"
    help: ClassVar[str] = "FCFS, end-of-turn release, LRU prefix cache"
    uses_pins: ClassVar[bool] = False
    #: The rules an instance starts from; parameters named like a rule override them.
    RULES: ClassVar[SchedulingRules] = SchedulingRules(ordering="fcfs")
    PARAMS: ClassVar[dict[str, Param]] = {}
    #: A running request that cannot grow preempts the running request that the queue
    #: order ranks last (vLLM's priority scheduling), not simply the newest (FCFS).
    preempt_by_order: ClassVar[bool] = False

    def __init__(self, **params: Any) -> None:
        base = params.pop("rules", None) or self.RULES
        unknown = sorted(set(params) - set(self.PARAMS))
        if unknown:
            valid = ", ".join(sorted(self.PARAMS)) or "none"
            raise ValueError(
                f"policy {self.name!r} has no parameter {unknown[0]!r}; valid: {valid}"
            )
        rule_names = set(SchedulingRules.names())
        rules: dict[str, Any] = {}
        for key, param in self.PARAMS.items():
            default = getattr(base, key) if key in rule_names else param.default
            value = params.get(key, default)
            if isinstance(value, str) and param.parse is not str:
                try:
                    value = param.parse(value)
                except ValueError as error:
                    what = "" if key in rule_names else f" parameter {key!r}"  # rules name it
                    raise ValueError(f"policy {self.name!r}{what}: {error}") from None
            if key in rule_names:
                rules[key] = value
            else:
                setattr(self, key, value)
        try:
            self.rules = base.replace(**rules)
        except ValueError as error:
            raise ValueError(f"policy {self.name!r}: {error}") from None
        self.label = self.name
        self.models: Models | None = None
        self.profile: HardwareProfile | None = None
        self.offload = False
        self.other_context: Callable[[], int] = lambda: 0

    def bind(self, profile: HardwareProfile | str, offload: bool) -> None:
        """Attach to one run (hardware profile, CPU tier or not)."""
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.offload = offload

    def see_trace(self, programs: Sequence[Program]) -> None:
        """The run's whole trace, before it starts (only an oracle may look)."""

    def attach(self, host: Any) -> None:
        """The run's :class:`simulator.sim.Simulation`, once its engine and controller
        exist: a policy that models an engine's own mechanism (vLLM's cache-aware
        admission) or its own admission (AgentInfer) installs it here."""

    def tool_key(self, tool: str, args: str | None) -> str:
        """The tool name the policy learns and decides by (the paper's parser: a shell
        command's first word)."""
        return paper_tool_key(tool, args)

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        """The TTL of a finished turn (only pinning policies are asked)."""
        return Decision(0.0, 0.0, 0.0, "none")

    # Learning hooks (only models-backed policies use them).
    def learn(self, event: ToolCallReport | ProgramEndReport) -> None:
        """An event of the run's controller: a completed tool call (duration = next
        arrival − finish, pin outcome, admission delay; delays of turns whose cache had
        been released are samples of T) or a program's end."""
        if isinstance(event, ProgramEndReport):
            self.observe_program_end(event.total_turns, event.tenant)
            return
        self.observe_tool(event.tool, event.tool_args, event.duration_s, event.tenant)
        if event.queue_delay_sample:
            self.observe_queue_delay(event.admission_delay_s, event.tenant)

    def observe_tool(self, tool: str, args: str | None, duration: float, tenant: str) -> None:
        pass

    def observe_queue_delay(self, delay: float, tenant: str) -> None:
        pass

    def observe_program_end(self, turns: int, tenant: str) -> None:
        pass


POLICIES: dict[str, type[SchedulingPolicy]] = {}


def register_scheduling_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    """Class decorator: make a policy available by ``cls.name``."""
    if cls.name in POLICIES or cls.name == "isolated":
        raise ValueError(f"a scheduling policy named {cls.name!r} is already registered")
    POLICIES[cls.name] = cls
    return cls


_SPEC = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\((.*)\))?\s*$")


def split_policy_list(text: str) -> list[str]:
    """Split ``"a,b(x=1,y=2),c"`` on the commas outside parentheses.

    >>> split_policy_list("vllm, cachettl(ttl_cap_s=30,pressure=always)")
    ['vllm', 'cachettl(ttl_cap_s=30,pressure=always)']
    """
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return [p for p in parts if p]


def get_scheduling_policy(spec: str, **params: Any) -> SchedulingPolicy:
    """A fresh policy from ``name`` or ``name(key=value,...)``; errors list valid names."""
    match = _SPEC.match(spec)
    if match is None:
        raise ValueError(f"cannot read policy {spec!r}; expected NAME or NAME(key=value,...)")
    name, arguments = match.group(1), match.group(2)
    if name not in POLICIES:
        valid = ", ".join(sorted([*POLICIES, "isolated"]))
        raise ValueError(f"unknown policy {name!r}; valid: {valid}")
    given = dict(params)
    for item in (arguments or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"policy {spec!r}: expected key=value, got {item.strip()!r}")
        given[key.strip()] = value.strip()
    policy = POLICIES[name](**given)
    policy.label = spec.strip() if arguments else name
    return policy


register_scheduling_policy(SchedulingPolicy)
