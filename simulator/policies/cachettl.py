"""``cachettl``: our policy, with a switch for each of its improvements over the paper.

Every improvement over Continuum (arXiv 2511.02230) is a parameter, so an ablation can turn
each on alone on top of the paper's behaviour (``BASE``) or all together. With every switch off
(``cachettl(**BASE)``) the policy decides exactly as ``continuum`` does (a test checks it).

==================  ===========================================================  =========
parameter           on                                                           paper
==================  ===========================================================  =========
keys                ``invocation``: (tool, argument signature) with back-off     ``tool``
prior_samples       α > 0: levels with < K samples blended into the back-off     0
contradiction_alpha a thin level whose samples contradict its parent (KS test at    0
                    this significance) decides alone
load_aware          holding priced by λ from waiting KV demand and free KV       λ = 1
drift               ADWIN drift forgetting of duration models                    keep all
share               shared cross-tenant priors for cold start                    none
per_program         η from the program's own progress (turns served)             global η
cpu_reload          a miss costs a CPU reload where a tier exists                on
ttl_cap_s           hard TTL cap                                                 inf
ttl_slack           a pin is held this multiple of the optimal TTL (near misses)  1
budget_share        share of the pool pins may hold                              1
victim              ``lowest-loss`` (waiting programs last)                      latest
pressure            ``running``: release pins only for running work              always
first_turn_reclaim  under ``running``, a new program's first turn may release a     off
                    pin once it has waited longer than the pin's expected loss
waiting_reclaim     any waiting turn reclaims as a first turn does (behind a      off
                    router that admits by the published usage); default off
order_window_s      bound on a returning turn's program-order head start         0
new first           ``first_turn_head_start_s``: a new program's first turn is   0
                    ordered this long before its arrival (inf: before every
                    returning turn, after preempted and pinned ones)
over pins           ``first_turn_over_pins``: new programs' first turns ahead of   off
                    pinned returning turns too (the frontier's fair end)
tier_pressure       ``pressure`` where a CPU tier exists (a miss is a reload)    always
tier_order_window_s ``order_window_s`` where a CPU tier exists                   0
detector            change detector on log-durations (``adwin``, ``adwin-fast``,    adwin
                    ``kswin``, ``page-hinkley``, ``cusum``)
drift_prior         α > 0: after a change the old regime, shifted to the new         0
                    samples' mean log-duration, is a prior of weight α
==================  ===========================================================  =========

With a CPU tier a lost pin costs a reload, not a prefill; the tier settings replace
``pressure`` and ``order_window_s`` there (simulator/README.md, "With a CPU tier"). The
paper's program order alone makes new programs wait behind every returning turn; with new
programs' first turns first it keeps its gain without starving them, with or without a
tier (simulator/README.md, "New programs first"). By default they go ahead of pinned
returning turns too (``first_turn_over_pins``): on 16 seeds of SWE and BFCL at 0.8×, 1× and
1.2× it is no different on mean JCT and P99 in all six cells and shortens the first-turn
wait in five (no different at SWE 0.8×), and behind a router a new session does not wait
behind other programs' pins (results/first_turn_over_pins_*.md, results/cluster_real.md).
The rule switches are
:class:`enginehook.core.rules.SchedulingRules` fields, whose defaults are ``cachettl``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from enginehook.core.host import FinishedTurn
from enginehook.core.rules import SchedulingRules
from enginehook.core.ttl import finite_cap
from estimator import (
    DEFAULT_TTL_SLACK,
    Decision,
    RequestFacts,
    SignatureRegistry,
    TtlPolicy,
    get_policy,
)
from estimator.durations import DETECTORS
from estimator.hierarchy import CONTRADICTION_ALPHA, DurationHierarchy
from estimator.profiles import HardwareProfile
from simulator.policies.base import Param, paper_tool_key, register_scheduling_policy, rule_params
from simulator.policies.pinning import PAPER_RULES, PinningPolicy

__all__ = ["BASE", "DEFAULTS", "IMPROVEMENTS", "RULES", "Cachettl"]


def _flag(value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ValueError("must be one of: 0, 1, true, false, on, off")


def _keys(value: str) -> str:
    if value not in ("invocation", "tool"):
        raise ValueError("must be one of: invocation, tool")
    return value


def _finite_non_negative(value: str) -> float:
    number = float(value)
    if not 0.0 <= number < float("inf"):
        raise ValueError("must be a finite number >= 0")
    return number


def _alpha(value: str) -> float:
    number = float(value)
    if not 0.0 <= number < 1.0:
        raise ValueError("must be in [0, 1)")
    return number


def _slack(value: str) -> float:
    number = float(value)
    if not 1.0 <= number < float("inf"):
        raise ValueError("must be a finite number >= 1")
    return number


def _detector(value: str) -> str:
    if value not in DETECTORS:
        raise ValueError(f"must be one of: {', '.join(DETECTORS)}")
    return value


def _floor(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise ValueError("must be in (0, 1]")
    return number


#: The rules ``cachettl`` runs with by default: :class:`SchedulingRules`' own defaults.
RULES = SchedulingRules()

#: The estimator settings of ``cachettl`` (chosen by the ablation; simulator/README.md).
_ESTIMATOR_DEFAULTS: dict[str, Any] = {
    "keys": "invocation",
    "prior_samples": 0.0,
    "contradiction_alpha": CONTRADICTION_ALPHA,
    "load_aware": True,
    "load_floor": 0.25,
    "drift": True,
    "share": False,
    "per_program": True,
    "cpu_reload": True,
    "ttl_slack": DEFAULT_TTL_SLACK,
    "detector": "adwin",
    "drift_prior": 0.0,
}

#: Every improvement off: the paper's policy (``continuum``) expressed as ``cachettl``.
BASE: dict[str, Any] = {
    "keys": "tool",
    "prior_samples": 0.0,
    "contradiction_alpha": 0.0,
    "load_aware": False,
    "drift": False,
    "share": False,
    "per_program": False,
    "cpu_reload": True,  # the paper's PrefillReload(r): a reload where a tier holds the KV
    "ttl_slack": 1.0,
    **dataclasses.asdict(
        PAPER_RULES.replace(
            tier_pressure=PAPER_RULES.pressure, tier_order_window_s=PAPER_RULES.order_window_s
        )
    ),
}

#: Each improvement's "on" setting (what the ablation turns on alone).
IMPROVEMENTS: dict[str, dict[str, Any]] = {
    "invocation keys": {"keys": "invocation"},
    "blended back-off": {"keys": "invocation", "prior_samples": 20.0},
    "contradiction override": {"keys": "invocation", "contradiction_alpha": CONTRADICTION_ALPHA},
    "load-aware cost": {"load_aware": True},
    "drift forgetting": {"drift": True},
    "shared priors": {"share": True},
    "per-program eta": {"per_program": True},
    f"TTL cap {RULES.ttl_cap_s:g} s": {"ttl_cap_s": RULES.ttl_cap_s},
    "pin budget 30 %": {"budget_share": 0.3},
    "lowest-loss victims": {"victim": RULES.victim},
    "running-only pressure": {"pressure": RULES.pressure},
    "order window 30 s": {"order_window_s": 30.0},
    "new programs first": {"first_turn_head_start_s": RULES.first_turn_head_start_s},
    "new programs over pins": {"first_turn_over_pins": RULES.first_turn_over_pins},
    # Reclaiming refines the running rule (under "always" any request releases pins).
    "running-only pressure, first turns reclaim": {
        "pressure": RULES.pressure,
        "first_turn_reclaim": RULES.first_turn_reclaim,
    },
}

_MIN_SAMPLES = PinningPolicy.PARAMS["min_samples"]

#: The defaults of ``cachettl``: its estimator settings, K and its rules.
DEFAULTS: dict[str, Any] = {
    **_ESTIMATOR_DEFAULTS,
    "min_samples": _MIN_SAMPLES.default,
    **dataclasses.asdict(RULES),
}

_OWN = {
    "keys": Param(_keys, DEFAULTS["keys"], "invocation: (tool, signature) keys; tool: tool only"),
    "prior_samples": Param(
        _finite_non_negative,
        DEFAULTS["prior_samples"],
        "blend thin levels into the back-off (0: off)",
    ),
    "contradiction_alpha": Param(
        _alpha,
        DEFAULTS["contradiction_alpha"],
        "a thin level whose samples contradict its parent at this significance decides (0: off)",
    ),
    "load_aware": Param(_flag, DEFAULTS["load_aware"], "price holding by the load now"),
    "load_floor": Param(_floor, DEFAULTS["load_floor"], "lowest λ of the load-aware cost"),
    "drift": Param(_flag, DEFAULTS["drift"], "forget a tool's old regime on drift"),
    "share": Param(_flag, DEFAULTS["share"], "learn and use cross-tenant priors"),
    "per_program": Param(_flag, DEFAULTS["per_program"], "η from the program's progress"),
    "cpu_reload": Param(_flag, DEFAULTS["cpu_reload"], "price a miss as a CPU reload (tier only)"),
    "ttl_slack": Param(_slack, DEFAULTS["ttl_slack"], "hold pins this multiple of the optimal TTL"),
    "detector": Param(_detector, DEFAULTS["detector"], "change detector on log-durations"),
    "drift_prior": Param(
        _finite_non_negative,
        DEFAULTS["drift_prior"],
        "after a change, the old regime shifted to the new samples as a prior of this weight",
    ),
}


@register_scheduling_policy
class Cachettl(PinningPolicy):
    """Ours (estimator policy ``cachettl``); every improvement is a parameter."""

    name = "cachettl"
    help = "ours (estimator 'cachettl'); each improvement a parameter, see simulator/policies"
    estimator_policy = "cachettl"
    RULES = RULES
    PARAMS: ClassVar[dict[str, Param]] = {
        **rule_params(RULES),
        "min_samples": _MIN_SAMPLES,
        **_OWN,
    }
    keys: str
    prior_samples: float
    contradiction_alpha: float
    load_aware: bool
    load_floor: float
    drift: bool
    share: bool
    per_program: bool
    cpu_reload: bool
    ttl_slack: float
    detector: str
    drift_prior: float

    def bind(self, profile: HardwareProfile | str, offload: bool) -> None:
        super().bind(profile, offload)
        if self.detector == "adwin" and self.drift_prior == 0.0:
            return  # the hierarchy the pinning policies build
        assert self.models is not None
        self.models.durations = DurationHierarchy(
            min_samples=self.min_samples,
            forget_on_drift=self.forget_on_drift,
            signatures=self.signatures(),
            detector=self.detector,
            drift_prior=self.drift_prior,
        )

    def ttl_policy(self) -> TtlPolicy:
        return get_policy(
            "cachettl",
            ttl_cap_s=finite_cap(self.rules.ttl_cap_s),  # the estimator takes finite caps only
            load_aware=self.load_aware,
            load_floor=self.load_floor,
            per_program=self.per_program,
            prior_samples=self.prior_samples,
            contradiction_alpha=self.contradiction_alpha,
            ttl_slack=self.ttl_slack,
        )

    @property
    def forget_on_drift(self) -> bool:
        return self.drift

    def tool_key(self, tool: str, args: str | None) -> str:
        if self.keys == "tool":
            return paper_tool_key(tool, args)
        return tool  # as the engine hook reports it (``bash`` + the command line)

    def signatures(self) -> SignatureRegistry:
        return SignatureRegistry()  # the estimator's default, as shipped

    def with_switches(self, facts: RequestFacts) -> RequestFacts:
        """``facts`` as this policy's switches see them (keys, sharing, CPU reloads)."""
        return dataclasses.replace(
            facts,
            tool_args=facts.tool_args if self.keys == "invocation" else None,
            share=self.share,
            offload=facts.offload and self.cpu_reload,
        )

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        assert self.models is not None
        return self._ttl.decide(self.with_switches(facts), self.models)

    def observe_tool(self, tool: str, args: str | None, duration: float, tenant: str) -> None:
        assert self.models is not None
        key = self.tool_key(tool, args)
        kept = args if self.keys == "invocation" else None
        self.models.record_tool_call(key, kept, duration, tenant, share=self.share)
