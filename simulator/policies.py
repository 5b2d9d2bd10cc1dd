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
cachettl             ours (estimator policy ``cachettl``), models learned online
oracle               knows each tool's true duration, pins exactly when it pays
===================  =====================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Container
from typing import Any, ClassVar

from enginehook.pins import Pin
from enginehook.pressure import PressureRule, choose_victims, may_release
from enginehook.priority import priority_key
from estimator import Decision, Models, RequestFacts, SignatureRegistry, get_policy
from estimator.signatures import SHELL_TOOLS, json_signature, shell_signature
from estimator.ttl import exponential_ttl
from simulator.engine import Request

#: What the simulator stores with a pin: (cached full blocks, the program's first arrival).
PinHandle = tuple[int, float]

__all__ = ["POLICIES", "PinHandle", "SchedulingPolicy", "get_scheduling_policy", "paper_tool_key"]


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


class SchedulingPolicy:
    """Base: vLLM's behaviour (FCFS, no pins)."""

    name: ClassVar[str] = "vllm"
    help: ClassVar[str] = "FCFS, end-of-turn release, LRU prefix cache"
    uses_pins: ClassVar[bool] = False
    learns: ClassVar[bool] = False

    def __init__(self) -> None:
        self.models: Models | None = None
        self.profile = "llama3.1-8b-h100"
        self.offload = False
        self.pinned_programs: Callable[[], Container[str]] = frozenset
        self.other_context: Callable[[], int] = lambda: 0

    def bind(self, profile: str, offload: bool, pinned: Callable[[], Container[str]]) -> None:
        """Attach to one run (hardware profile, CPU tier or not, live pins)."""
        self.profile = profile
        self.offload = offload
        self.pinned_programs = pinned

    def key(self, r: Request) -> tuple[Any, ...]:
        return (0 if r.preempted else 1, r.arrival, r.request_id)

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

    # Learning hooks (only models-backed policies use them).
    def observe_return(
        self, program_id: str, turn: int, tool: str, args: str | None, duration: float, tenant: str
    ) -> None:
        """Turn ``turn + 1`` arrived: the tool ``turn`` called took ``duration`` (server
        side: this arrival − that turn's finish)."""
        self.observe_tool(tool, args, duration, tenant)

    def observe_admission(
        self, program_id: str, delay: float, outcome: str, ttl_s: float, tenant: str
    ) -> None:
        """A returning turn was admitted ``delay`` after arriving; ``outcome`` is what
        happened to its program's pin (``hit``, ``ttl``, ``pressure``, ``not_pinned`` …).
        Delays of turns whose cache had been released feed T."""
        if outcome != "hit":
            self.observe_queue_delay(delay, tenant)

    def observe_tool(self, tool: str, args: str | None, duration: float, tenant: str) -> None:
        pass

    def observe_queue_delay(self, delay: float, tenant: str) -> None:
        pass

    def observe_program_end(self, turns: int, tenant: str) -> None:
        pass

    def observe_service(self, program_id: str, seconds: float) -> None:
        pass


POLICIES: dict[str, type[SchedulingPolicy]] = {}


def _register(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    POLICIES[cls.name] = cls
    return cls


def get_scheduling_policy(name: str) -> SchedulingPolicy:
    """A fresh policy called ``name``; the error lists the valid names."""
    try:
        return POLICIES[name]()
    except KeyError:
        valid = ", ".join(sorted([*POLICIES, "isolated"]))
        raise ValueError(f"unknown policy {name!r}; valid: {valid}") from None


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
    discretised into levels [0, 1), [1, 3), [3, 7), [7, ∞) s; FCFS within a level."""

    name = "autellix"
    help = "program-level least attained service (PLAS), end-of-turn release"
    THRESHOLDS = (1.0, 3.0, 7.0)

    def __init__(self) -> None:
        super().__init__()
        self._service: dict[str, float] = {}

    def observe_service(self, program_id: str, seconds: float) -> None:
        self._service[program_id] = self._service.get(program_id, 0.0) + seconds

    def key(self, r: Request) -> tuple[Any, ...]:
        service = self._service.get(r.program_id, 0.0)
        level = sum(1 for t in self.THRESHOLDS if service >= t)
        return (0 if r.preempted else 1, level, r.arrival, r.request_id)


class _Pinning(SchedulingPolicy):
    """Pins with the paper's waiting order and latest-arrival pressure victims."""

    uses_pins = True
    estimator_policy: ClassVar[str] = "continuum"
    pressure: ClassVar[PressureRule] = PressureRule.ALWAYS

    def __init__(self) -> None:
        super().__init__()
        self._ttl = get_policy(self.estimator_policy)

    def bind(self, profile: str, offload: bool, pinned: Callable[[], Container[str]]) -> None:
        super().bind(profile, offload, pinned)
        self.models = self._ttl.new_models(profile)
        self.models.durations.signatures = SignatureRegistry(default=_auto_signature)

    def key(self, r: Request) -> tuple[Any, ...]:
        pinned = r.program_id in self.pinned_programs()
        return priority_key(r.preempted, pinned, r.program_arrival, r.arrival, r.request_id)

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
        if not may_release(self.pressure, for_running=for_running, nothing_running=nothing_running):
            return []
        order = sorted(pins, key=lambda p: (-(p.handle or (0, 0.0))[1], p.program_id))
        chosen: list[Pin[PinHandle]] = []
        total = 0
        for pin in order:  # the paper: latest program arrival first, until it fits
            if total >= needed:
                break
            chosen.append(pin)
            total += pin.blocks
        return chosen

    def observe_tool(self, tool: str, args: str | None, duration: float, tenant: str) -> None:
        assert self.models is not None
        self.models.record_tool_call(paper_tool_key(tool, args), args, duration, tenant)

    def observe_queue_delay(self, delay: float, tenant: str) -> None:
        assert self.models is not None
        self.models.record_queue_delay(delay, tenant)

    def observe_program_end(self, turns: int, tenant: str) -> None:
        assert self.models is not None
        self.models.record_program_end(turns, tenant)


@_register
class Continuum(_Pinning):
    name = "continuum"
    help = "the paper's TTL (estimator 'continuum'), models learned online"


@_register
class Cachettl(_Pinning):
    name = "cachettl"
    help = "ours (estimator 'cachettl'), models learned online, lowest-loss victims"
    estimator_policy = "cachettl"
    pressure = PressureRule.RUNNING

    def victims(
        self,
        pins: list[Pin[PinHandle]],
        needed: int,
        now: float,
        waiting: Collection[str],
        for_running: bool,
        nothing_running: bool,
    ) -> list[Pin[PinHandle]]:
        if not may_release(self.pressure, for_running=for_running, nothing_running=nothing_running):
            return []
        return choose_victims(pins, needed, now, waiting, allow_waiting=True)


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
    no preempted-first key; one victim per step, the pin with the latest expiry."""

    name = "continuum-preview"
    help = "authors' preview code: fixed 2 s pin, skips tools whose mean exceeds 2 s"

    def __init__(self) -> None:
        super().__init__()
        self._fixed = get_policy("fixed", ttl_s=2.0)

    def key(self, r: Request) -> tuple[Any, ...]:
        pinned = r.program_id in self.pinned_programs()
        return (0 if pinned else 1, r.program_arrival, r.arrival, r.request_id)

    def decide(self, facts: RequestFacts, true_duration_s: float, now: float) -> Decision:
        assert self.models is not None
        return self._fixed.decide(facts, self.models)

    def victims(
        self,
        pins: list[Pin[PinHandle]],
        needed: int,
        now: float,
        waiting: Collection[str],
        for_running: bool,
        nothing_running: bool,
    ) -> list[Pin[PinHandle]]:
        if not pins or not (for_running or nothing_running):
            return []
        return [max(pins, key=lambda p: (p.expires_at, p.program_id))]


@_register
class Oracle(Cachettl):
    """Knows the tool's true duration d: pins for d when the hit is worth it (d < B);
    pressure handled as ``cachettl`` does."""

    name = "oracle"
    estimator_policy = "continuum"
    help = "knows each tool's true duration; pins for exactly that long when it pays"

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
