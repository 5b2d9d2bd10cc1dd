"""Scheduling policies of the simulator, chosen by name from one registry.

A policy supplies three things to the engine: the order of the waiting queue (``key``),
whether and how long to pin a finished request's KV cache (``decide``), and which pins to
give up under memory pressure (``victims``). Pins themselves live in the shipped
:class:`enginehook.pins.PinTable`; TTLs come from the shipped :mod:`estimator` policies
with their models learned online during the run.

===================  =====================================================================
name                 behaviour
===================  =====================================================================
vllm                 FCFS (preempted first), end-of-turn release, LRU prefix cache
program-fcfs         vllm with program-level FCFS (ablation step 1)
static-ttl           program FCFS + pinned first + the cold-start TTL ln(B) (ablation 2)
autellix             PLAS: program-level least attained service, 4 geometric levels
infercept            preserve while elapsed tool time < discard waste (min-waste rule)
continuum-preview    the authors' preview code: fixed 2 s pin, skip tools with mean > 2 s
continuum            the paper (estimator policy ``continuum``), models learned online
cachettl             ours (``simulator.ours``): a switch per improvement over the paper
oracle               knows each tool's true duration, pins exactly when it pays
===================  =====================================================================
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from enginehook.pins import Pin
from enginehook.pressure import PressureRule, choose_victims, may_release, take_until_covered
from enginehook.priority import effective_program_arrival, priority_key
from enginehook.tracker import ToolCallEvent
from estimator import (
    CostModel,
    Decision,
    DurationHierarchy,
    HardwareProfile,
    Models,
    RequestFacts,
    SignatureRegistry,
    TtlPolicy,
    get_policy,
    get_profile,
)
from estimator.signatures import SHELL_TOOLS, json_signature, shell_signature
from estimator.ttl import exponential_ttl
from simulator.engine import Request

#: What the simulator stores with a pin: (cached full blocks, the program's first arrival).
PinHandle = tuple[int, float]

__all__ = [
    "POLICIES",
    "Cachettl",
    "Param",
    "PinHandle",
    "SchedulingPolicy",
    "get_scheduling_policy",
    "paper_tool_key",
    "register_scheduling_policy",
    "split_policy_list",
    "with_defaults",
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


def _auto_signature(tool: str, args: str) -> str:
    """JSON arguments by their keys, anything else as a shell command line."""
    if args.lstrip().startswith("{"):
        return json_signature(tool, args)
    return shell_signature(tool, args)


@dataclass(frozen=True, slots=True)
class Param:
    """One tunable of a policy: how to read it from text, its default, its help."""

    parse: Callable[[str], Any]
    default: Any
    help: str


def _choice(*names: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in names:
            raise ValueError(f"must be one of: {', '.join(names)}")
        return value

    return parse


def _non_negative(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise ValueError("must be a number >= 0")
    return number


def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("must be an integer >= 0")
    return number


class SchedulingPolicy:
    """Base: vLLM's behaviour (FCFS, no pins). Parameters (``PARAMS``) are given as
    keyword arguments or in a spec string ``name(key=value,...)``."""

    name: ClassVar[str] = "vllm"
    help: ClassVar[str] = "FCFS, end-of-turn release, LRU prefix cache"
    uses_pins: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, Param]] = {}

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.PARAMS))
        if unknown:
            valid = ", ".join(sorted(self.PARAMS)) or "none"
            raise ValueError(
                f"policy {self.name!r} has no parameter {unknown[0]!r}; valid: {valid}"
            )
        for key, param in self.PARAMS.items():
            value = params.get(key, param.default)
            if isinstance(value, str) and param.parse is not str:
                try:
                    value = param.parse(value)
                except ValueError as error:
                    raise ValueError(f"policy {self.name!r} parameter {key!r}: {error}") from None
            setattr(self, key, value)
        self.label = self.name
        self.models: Models | None = None
        self.profile: HardwareProfile | None = None
        self.offload = False
        self.pinned_programs: Callable[[], Container[str]] = frozenset
        self.other_context: Callable[[], int] = lambda: 0

    def bind(
        self,
        profile: HardwareProfile | str,
        offload: bool,
        pinned: Callable[[], Container[str]],
    ) -> None:
        """Attach to one run (hardware profile, CPU tier or not, live pins)."""
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.offload = offload
        self.pinned_programs = pinned

    def key(self, r: Request) -> tuple[Any, ...]:
        return (0 if r.preempted else 1, r.arrival, r.request_id)

    def tool_key(self, tool: str, args: str | None) -> str:
        """The tool name the policy learns and decides by (the paper's parser: a shell
        command's first word)."""
        return paper_tool_key(tool, args)

    def preemption_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when one cannot grow (vLLM FCFS: the newest)."""
        return running[-1]

    def decide(self, facts: RequestFacts, true_duration_s: float, now: float) -> Decision:
        return Decision(0.0, 0.0, 0.0, "none")

    def victims(
        self,
        pins: list[Pin[PinHandle]],
        needed: int,
        now: float,
        waiting: Collection[str],
        for_running: bool,
        nothing_running: bool,
    ) -> list[Pin[PinHandle]]:
        """Pins to release so that ``needed`` more blocks can be found."""
        return []

    @property
    def ttl_cap(self) -> float:
        """Hard TTL cap for the pin table (inf: none)."""
        return math.inf

    @property
    def pin_budget_share(self) -> float:
        """Share of the KV pool pins may hold at once."""
        return 1.0

    # Learning hooks (only models-backed policies use them).
    def observe_tool_call(self, event: ToolCallEvent) -> None:
        """A returning turn was admitted: its tool call's duration (next arrival − finish),
        pin outcome and admission delay. Delays of turns whose cache had been released
        (any outcome but ``hit``) are samples of T."""
        self.observe_tool(event.tool_name, event.tool_args, event.duration_s, event.tenant)
        if event.queue_delay_sample:
            self.observe_queue_delay(event.admission_delay_s, event.tenant)

    def observe_tool(self, tool: str, args: str | None, duration: float, tenant: str) -> None:
        pass

    def observe_queue_delay(self, delay: float, tenant: str) -> None:
        pass

    def observe_program_end(self, turns: int, tenant: str) -> None:
        pass

    def observe_service(self, program_id: str, seconds: float) -> None:
        pass


POLICIES: dict[str, type[SchedulingPolicy]] = {}


def register_scheduling_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    """Class decorator: make a policy available by ``cls.name``."""
    if cls.name in POLICIES or cls.name == "isolated":
        raise ValueError(f"a scheduling policy named {cls.name!r} is already registered")
    POLICIES[cls.name] = cls
    return cls


_register = register_scheduling_policy
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


_register(SchedulingPolicy)


@_register
class ProgramFcfs(SchedulingPolicy):
    name = "program-fcfs"
    help = "vllm with program-level FCFS (the paper's ablation step 1)"

    def key(self, r: Request) -> tuple[Any, ...]:
        return (0 if r.preempted else 1, r.program_arrival, r.arrival, r.request_id)


@_register
class Autellix(SchedulingPolicy):
    """PLAS: priority = the program's attained service (model time of its completed calls),
    discretised into levels [0, 1), [1, 3), [3, 7), [7, ∞) s; FCFS within a level. As in
    vLLM's priority scheduling, a running request that cannot grow preempts the running
    request of the worst priority (not simply the newest)."""

    name = "autellix"
    help = "program-level least attained service (PLAS), end-of-turn release"
    THRESHOLDS = (1.0, 3.0, 7.0)

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._service: dict[str, float] = {}

    def observe_service(self, program_id: str, seconds: float) -> None:
        self._service[program_id] = self._service.get(program_id, 0.0) + seconds

    def key(self, r: Request) -> tuple[Any, ...]:
        service = self._service.get(r.program_id, 0.0)
        level = sum(1 for t in self.THRESHOLDS if service >= t)
        return (0 if r.preempted else 1, level, r.arrival, r.request_id)

    def preemption_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.key)


def _latest_arrival(pins: list[Pin[PinHandle]], needed: int) -> list[Pin[PinHandle]]:
    """The paper: latest program arrival first, until the blocks cover ``needed``."""
    order = sorted(pins, key=lambda p: (-(p.handle or (0, 0.0))[1], p.program_id))
    return take_until_covered(order, needed)


_PRESSURE = Param(
    PressureRule.parse, PressureRule.ALWAYS, "when a failed allocation may release pins"
)
_VICTIMS = Param(
    _choice("latest-arrival", "lowest-loss", "latest-expiry"),
    "latest-arrival",
    "which pins go first under pressure (latest-expiry: one per step)",
)
_CAP = Param(_non_negative, math.inf, "hard TTL cap, seconds")
_MIN_SAMPLES = Param(_count, 100, "samples a duration model needs before it is trusted (K)")
_BUDGET = Param(_non_negative, 1.0, "share of the KV pool pins may hold at once")
_WINDOW = Param(
    _non_negative,
    0.0,
    "a returning turn overtakes only requests that arrived less than this before it (0: no bound)",
)
_PINNING_PARAMS = {
    "pressure": _PRESSURE,
    "victim": _VICTIMS,
    "ttl_cap_s": _CAP,
    "min_samples": _MIN_SAMPLES,
    "budget_share": _BUDGET,
    "order_window_s": _WINDOW,
    "tier_pressure": Param(
        PressureRule.parse, None, "pressure where a CPU tier exists (unset: pressure)"
    ),
    "tier_window_s": Param(
        _non_negative, None, "order_window_s where a CPU tier exists (unset: order_window_s)"
    ),
}


class _Pinning(SchedulingPolicy):
    """Pins chosen by an estimator policy with models learned online during the run."""

    uses_pins = True
    estimator_policy: ClassVar[str] = "continuum"
    PARAMS = _PINNING_PARAMS
    pressure: PressureRule
    victim: str
    ttl_cap_s: float
    min_samples: int
    budget_share: float
    order_window_s: float
    tier_pressure: PressureRule | None
    tier_window_s: float | None

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._ttl = self.ttl_policy()
        self._without_tier = (self.pressure, self.order_window_s)

    def ttl_policy(self) -> TtlPolicy:
        """The estimator policy that chooses TTLs."""
        return get_policy(self.estimator_policy)

    @property
    def forget_on_drift(self) -> bool:
        return self._ttl.forgets_on_drift

    @property
    def ttl_cap(self) -> float:
        return self.ttl_cap_s

    @property
    def pin_budget_share(self) -> float:
        return self.budget_share

    def bind(
        self,
        profile: HardwareProfile | str,
        offload: bool,
        pinned: Callable[[], Container[str]],
    ) -> None:
        super().bind(profile, offload, pinned)
        assert self.profile is not None
        # With a CPU tier a lost pin costs a reload: the tier settings, where given, apply.
        pressure, window = self._without_tier
        if offload:
            pressure = self.tier_pressure if self.tier_pressure is not None else pressure
            window = self.tier_window_s if self.tier_window_s is not None else window
        self.pressure, self.order_window_s = pressure, window
        durations = DurationHierarchy(
            min_samples=self.min_samples,
            forget_on_drift=self.forget_on_drift,
            signatures=self.signatures(),
        )
        self.models = Models(durations, CostModel.from_profile(self.profile))

    def signatures(self) -> SignatureRegistry:
        """How tool arguments become invocation keys."""
        return SignatureRegistry(default=_auto_signature)

    def key(self, r: Request) -> tuple[Any, ...]:
        pinned = r.program_id in self.pinned_programs()
        first = effective_program_arrival(r.program_arrival, r.arrival, self.order_window_s)
        return priority_key(r.preempted, pinned, first, r.arrival, r.request_id)

    def decide(self, facts: RequestFacts, true_duration_s: float, now: float) -> Decision:
        assert self.models is not None
        return self._ttl.decide(facts, self.models)

    def victims(
        self,
        pins: list[Pin[PinHandle]],
        needed: int,
        now: float,
        waiting: Collection[str],
        for_running: bool,
        nothing_running: bool,
    ) -> list[Pin[PinHandle]]:
        if not pins or not may_release(
            self.pressure, for_running=for_running, nothing_running=nothing_running
        ):
            return []
        if self.victim == "lowest-loss":
            return choose_victims(pins, needed, now, waiting, allow_waiting=True)
        if self.victim == "latest-expiry":
            return [max(pins, key=lambda p: (p.expires_at, p.program_id))]
        return _latest_arrival(pins, needed)

    def observe_tool(self, tool: str, args: str | None, duration: float, tenant: str) -> None:
        assert self.models is not None
        self.models.record_tool_call(self.tool_key(tool, args), args, duration, tenant)

    def observe_queue_delay(self, delay: float, tenant: str) -> None:
        assert self.models is not None
        self.models.record_queue_delay(delay, tenant)

    def observe_program_end(self, turns: int, tenant: str) -> None:
        assert self.models is not None
        self.models.record_program_end(turns, tenant)


def with_defaults(**defaults: Any) -> dict[str, Param]:
    params = dict(_PINNING_PARAMS)
    for key, value in defaults.items():
        base = params[key]
        params[key] = Param(base.parse, value, base.help)
    return params


@_register
class Continuum(_Pinning):
    """The paper (DESIGN.md §3): its TTL, pins released for any blocked admission, victims
    by latest program arrival."""

    name = "continuum"
    help = "the paper's TTL (estimator 'continuum'), models learned online"


@_register
class StaticTtl(_Pinning):
    name = "static-ttl"
    help = "program FCFS + the cold-start TTL ln(prefill time) for every call (ablation 2)"

    def decide(self, facts: RequestFacts, true_duration_s: float, now: float) -> Decision:
        assert self.models is not None
        benefit = self.models.cost.prefill_reload_s(facts.context_tokens, offload=self.offload)
        ttl = exponential_ttl(benefit)
        return Decision(ttl, 1.0 - math.exp(-ttl), 0.0, "static", benefit)


@_register
class ContinuumPreview(_Pinning):
    """The authors' preview code: 2 s pins unless the tool's running mean exceeds 2 s;
    no preempted-first key; one victim per step, the pin with the latest expiry, only for
    running work or an idle engine."""

    name = "continuum-preview"
    help = "authors' preview code: fixed 2 s pin, skips tools whose mean exceeds 2 s"
    PARAMS = with_defaults(pressure=PressureRule.RUNNING, victim="latest-expiry")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._fixed = get_policy("fixed", ttl_s=2.0)

    def key(self, r: Request) -> tuple[Any, ...]:
        pinned = r.program_id in self.pinned_programs()
        return (0 if pinned else 1, r.program_arrival, r.arrival, r.request_id)

    def decide(self, facts: RequestFacts, true_duration_s: float, now: float) -> Decision:
        assert self.models is not None
        return self._fixed.decide(facts, self.models)


@_register
class Oracle(_Pinning):
    """Knows the tool's true duration d: pins for d when the hit is worth it (d < B);
    pressure handled as ``cachettl`` does."""

    name = "oracle"
    help = "knows each tool's true duration; pins for exactly that long when it pays"
    PARAMS = with_defaults(
        pressure=PressureRule.RUNNING,
        victim="lowest-loss",
        tier_pressure=PressureRule.ALWAYS,
        tier_window_s=5.0,
    )

    def decide(self, facts: RequestFacts, true_duration_s: float, now: float) -> Decision:
        assert self.models is not None
        benefit = self._ttl.benefit_s(facts, self.models)
        if true_duration_s < benefit:
            ttl = true_duration_s + 1e-6
            return Decision(ttl, 1.0, benefit - ttl, "oracle", benefit)
        return Decision(0.0, 0.0, 0.0, "oracle", benefit)


@_register
class Infercept(_Pinning):
    """Min-waste preserve/discard: preserve while the tool's elapsed time is below the
    discard waste per unit of held memory, T_fwd(C_i)·(C_i + C_other)/C_i (its Eqs. 1–2
    with the elapsed-time estimate), i.e. a TTL of that length; FCFS by program arrival."""

    name = "infercept"
    help = "min-waste preserve/discard with the elapsed-time estimate; FCFS"

    def key(self, r: Request) -> tuple[Any, ...]:
        return (0 if r.preempted else 1, r.program_arrival, r.arrival, r.request_id)

    def decide(self, facts: RequestFacts, true_duration_s: float, now: float) -> Decision:
        assert self.models is not None
        context = max(facts.context_tokens, 1)
        forward = self.models.cost.prefill_reload_s(context, offload=self.offload)
        ttl = forward * (1.0 + self.other_context() / context)
        return Decision(ttl, 0.0, 0.0, "infercept", forward)


import simulator.ours  # noqa: E402  (registers ``cachettl``)

if TYPE_CHECKING:
    from simulator.ours import Cachettl


def __getattr__(name: str) -> Any:
    if name == "Cachettl":  # defined in simulator.ours, which imports this module
        return simulator.ours.Cachettl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
