"""Policies that pin: the paper, its ablation steps, the authors' preview code, InferCept
and the oracle. TTLs come from the shipped :mod:`estimator` policies with models learned
online during the run; the rules around the pins are :class:`SchedulingRules`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from enginehook.core.host import FinishedTurn
from enginehook.core.pressure import PressureRule
from enginehook.core.rules import SchedulingRules
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
)
from estimator.signatures import json_signature, shell_signature
from estimator.ttl import exponential_ttl
from simulator.policies.base import (
    Param,
    SchedulingPolicy,
    register_scheduling_policy,
    rule_params,
)

__all__ = [
    "PAPER_RULES",
    "Continuum",
    "ContinuumPreview",
    "Infercept",
    "Oracle",
    "PinningPolicy",
    "StaticTtl",
    "count",
]

#: Continuum's rules (arXiv 2511.02230): program order with pinned programs first (new programs'
#: first turns included), pins released for any blocked allocation, victims by latest program
#: arrival, no cap, no budget, the same rules with a CPU tier.
PAPER_RULES = SchedulingRules(
    pressure=PressureRule.ALWAYS,
    tier_pressure=None,
    ordering="program",
    order_window_s=0.0,
    tier_order_window_s=None,
    first_turn_head_start_s=0.0,
    first_turn_reclaim=False,
    first_turn_over_pins=False,
    budget_share=1.0,
    ttl_cap_s=math.inf,
    victim="latest-arrival",
)


def count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("must be an integer >= 0")
    return number


def _auto_signature(tool: str, args: str) -> str:
    """JSON arguments by their keys, anything else as a shell command line."""
    if args.lstrip().startswith("{"):
        return json_signature(tool, args)
    return shell_signature(tool, args)


class PinningPolicy(SchedulingPolicy):
    """Pins chosen by an estimator policy with models learned online during the run."""

    uses_pins = True
    estimator_policy: ClassVar[str] = "continuum"
    RULES = PAPER_RULES
    PARAMS: ClassVar[dict[str, Param]] = {
        **rule_params(PAPER_RULES),
        "min_samples": Param(count, 100, "samples a duration model needs before it is trusted (K)"),
    }
    min_samples: int

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._ttl = self.ttl_policy()

    def ttl_policy(self) -> TtlPolicy:
        """The estimator policy that chooses TTLs."""
        return get_policy(self.estimator_policy)

    @property
    def forget_on_drift(self) -> bool:
        return self._ttl.forgets_on_drift

    def bind(self, profile: HardwareProfile | str, offload: bool) -> None:
        super().bind(profile, offload)
        assert self.profile is not None
        durations = DurationHierarchy(
            min_samples=self.min_samples,
            forget_on_drift=self.forget_on_drift,
            signatures=self.signatures(),
        )
        self.models = Models(durations, CostModel.from_profile(self.profile))

    def signatures(self) -> SignatureRegistry:
        """How tool arguments become invocation keys."""
        return SignatureRegistry(default=_auto_signature)

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        facts = dataclasses.replace(facts, tool=self.tool_key(facts.tool, facts.tool_args))
        return self.choose(facts, turn)

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        """The TTL for ``facts`` (whose tool is already :meth:`tool_key`'s)."""
        assert self.models is not None
        return self._ttl.decide(facts, self.models)

    def observe_tool(self, tool: str, args: str | None, duration: float, tenant: str) -> None:
        assert self.models is not None
        self.models.record_tool_call(self.tool_key(tool, args), args, duration, tenant)

    def observe_queue_delay(self, delay: float, tenant: str) -> None:
        assert self.models is not None
        self.models.record_queue_delay(delay, tenant)

    def observe_program_end(self, turns: int, tenant: str) -> None:
        assert self.models is not None
        self.models.record_program_end(turns, tenant)


@register_scheduling_policy
class Continuum(PinningPolicy):
    """Continuum (arXiv 2511.02230): its TTL and :data:`PAPER_RULES`."""

    name = "continuum"
    help = "the paper's TTL (estimator 'continuum'), models learned online"


@register_scheduling_policy
class StaticTtl(PinningPolicy):
    name = "static-ttl"
    help = "program FCFS + the cold-start TTL ln(prefill time) for every call (ablation 2)"

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        assert self.models is not None
        benefit = self.models.cost.prefill_reload_s(facts.context_tokens, offload=self.offload)
        ttl = exponential_ttl(benefit)
        return Decision(ttl, 1.0 - math.exp(-ttl), 0.0, "static", benefit)


#: The authors' preview code: no preempted-first order, one victim per attempt (the pin
#: that would expire last), only for running work or an idle engine.
PREVIEW_RULES = PAPER_RULES.replace(
    ordering="pinned-program", pressure=PressureRule.RUNNING, victim="latest-expiry"
)


@register_scheduling_policy
class ContinuumPreview(PinningPolicy):
    """The authors' preview code: 2 s pins unless the tool's running mean exceeds 2 s;
    :data:`PREVIEW_RULES`."""

    name = "continuum-preview"
    help = "authors' preview code: fixed 2 s pin, skips tools whose mean exceeds 2 s"
    RULES = PREVIEW_RULES
    PARAMS: ClassVar[dict[str, Param]] = {**PinningPolicy.PARAMS, **rule_params(PREVIEW_RULES)}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._fixed = get_policy("fixed", ttl_s=2.0)

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        assert self.models is not None
        return self._fixed.decide(facts, self.models)


#: What the oracle runs: our rules without the TTL cap (it knows every duration).
ORACLE_RULES = SchedulingRules(ttl_cap_s=math.inf)


@register_scheduling_policy
class Oracle(PinningPolicy):
    """Knows the tool's true duration d: pins for d when the hit is worth it (d < B);
    memory handled as ``cachettl`` does (:data:`ORACLE_RULES`)."""

    name = "oracle"
    help = "knows each tool's true duration; pins for exactly that long when it pays"
    RULES = ORACLE_RULES
    PARAMS: ClassVar[dict[str, Param]] = {**PinningPolicy.PARAMS, **rule_params(ORACLE_RULES)}

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        assert self.models is not None
        assert turn.true_duration_s is not None
        benefit = self._ttl.benefit_s(facts, self.models)
        if turn.true_duration_s < benefit:
            ttl = turn.true_duration_s + 1e-6
            return Decision(ttl, 1.0, benefit - ttl, "oracle", benefit)
        return Decision(0.0, 0.0, 0.0, "oracle", benefit)


@register_scheduling_policy
class Infercept(PinningPolicy):
    """Min-waste preserve/discard: preserve while the tool's elapsed time is below the
    discard waste per unit of held memory, T_fwd(C_i)·(C_i + C_other)/C_i (its Eqs. 1–2
    with the elapsed-time estimate), i.e. a TTL of that length; FCFS by program arrival."""

    name = "infercept"
    help = "min-waste preserve/discard with the elapsed-time estimate; FCFS"
    RULES = PAPER_RULES.replace(ordering="program-fcfs")
    PARAMS: ClassVar[dict[str, Param]] = {**PinningPolicy.PARAMS, **rule_params(RULES)}

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        assert self.models is not None
        context = max(facts.context_tokens, 1)
        forward = self.models.cost.prefill_reload_s(context, offload=self.offload)
        ttl = forward * (1.0 + self.other_context() / context)
        return Decision(ttl, 0.0, 0.0, "infercept", forward)
