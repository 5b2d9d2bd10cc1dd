"""TTL policies: how long to keep a finished request's KV cache pinned.

A policy is a small object with one method, ``decide(facts, models) -> Decision``, and is
chosen by name from one registry (``get_policy``). The same objects run in the engine
hook, the simulator and the control plane.

Every policy maximises (or approximates) the objective of Continuum (arXiv 2511.02230),
``F(τ)·B − τ`` with ``B = T·η + PrefillReload(r)``; they differ in which duration
distribution F they trust and which safeguards they add.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from estimator._checks import check_count, check_finite, check_non_negative
from estimator.hierarchy import CONTRADICTION_ALPHA, Level
from estimator.models import Models
from estimator.profiles import DEFAULT_PROFILE, HardwareProfile
from estimator.ttl import best_ttl_mixture, exponential_ttl, mixture_cdf

__all__ = [
    "DEFAULT_TTL_CAP_S",
    "DEFAULT_TTL_SLACK",
    "POLICIES",
    "CachettlPolicy",
    "ContinuumPolicy",
    "Decision",
    "FixedTtlPolicy",
    "NoPinPolicy",
    "RequestFacts",
    "TtlPolicy",
    "get_policy",
    "register_policy",
]

#: ``basis`` of a decision taken by the exponential cold-start rule.
COLD_START = "cold-start"

#: The hard TTL cap, seconds: ``cachettl``'s default and the pin controller's
#: (``enginehook.core.rules.SchedulingRules.ttl_cap_s``).
DEFAULT_TTL_CAP_S = 300.0

#: ``cachettl``'s TTL slack: a pin is held for this multiple of the exact optimum τ*
#: (capped); 1 holds the optimum itself. Longer holds measured in the simulator:
#: simulator/README.md, "TTL slack".
DEFAULT_TTL_SLACK = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFacts:
    """What is known about a finished request that called a tool (keyword arguments only).

    ``reload_cost_s`` and ``queue_delay_s`` override PrefillReload(r) and T when given.
    ``offload``: the KV also sits in a CPU tier, so rebuilding it is a reload;
    ``offloaded_tokens``: how much of the context the tier holds (None: all of it).
    ``share``: the tenant opted into cross-tenant statistics (may use shared priors).
    ``waiting_tokens`` / ``free_tokens``: KV demand of the requests waiting now and the
    free KV capacity now, in tokens (load signals; None when the caller does not know).
    """

    tool: str
    tool_args: str | None = None
    context_tokens: int = 0
    tenant: str = "default"
    program_id: str | None = None
    turns_served: int = 0
    reload_cost_s: float | None = None
    queue_delay_s: float | None = None
    offload: bool = False
    share: bool = False
    waiting_tokens: int | None = None
    free_tokens: int | None = None
    offloaded_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tool, str) or not self.tool:
            raise ValueError(f"tool must be a non-empty string, got {self.tool!r}")
        check_count("context_tokens", self.context_tokens)
        check_count("turns_served", self.turns_served)
        if self.reload_cost_s is not None:
            check_non_negative("reload_cost_s", self.reload_cost_s)
        if self.queue_delay_s is not None:
            check_non_negative("queue_delay_s", self.queue_delay_s)
        if self.waiting_tokens is not None:
            check_count("waiting_tokens", self.waiting_tokens)
        if self.free_tokens is not None:
            check_count("free_tokens", self.free_tokens)
        if self.offloaded_tokens is not None:
            check_count("offloaded_tokens", self.offloaded_tokens)


@dataclass(frozen=True, slots=True)
class Decision:
    """A TTL decision.

    ``return_probability`` is F(τ), the chance the program is back within τ;
    ``benefit_s`` is B, the latency a hit saves; ``expected_benefit_s`` the net
    expectation F(τ)·B − τ (0 when not pinning); ``basis`` the model level or rule used.
    """

    ttl_s: float
    return_probability: float
    expected_benefit_s: float
    basis: str
    benefit_s: float = 0.0


class TtlPolicy(ABC):
    """Base class: a named policy with a ``decide`` method and its preferred models."""

    name: ClassVar[str]
    #: Whether this policy's duration models drop old regimes on drift.
    forgets_on_drift: ClassVar[bool] = True

    def new_models(self, profile: str | HardwareProfile = DEFAULT_PROFILE, **kwargs: Any) -> Models:
        """Fresh models configured the way this policy expects."""
        kwargs.setdefault("forget_on_drift", self.forgets_on_drift)
        return Models.for_profile(profile, **kwargs)

    @abstractmethod
    def decide(self, facts: RequestFacts, models: Models) -> Decision:
        """Choose the TTL for one finished request."""

    def benefit_s(self, facts: RequestFacts, models: Models) -> float:
        """B = T·η + PrefillReload(r), with the request's overrides applied."""
        stats = models.workload(facts.tenant)
        queue = facts.queue_delay_s if facts.queue_delay_s is not None else stats.queue.get()
        reload = facts.reload_cost_s
        if reload is None:
            reload = models.cost.prefill_reload_s(
                facts.context_tokens, offload=facts.offload, offloaded_tokens=facts.offloaded_tokens
            )
        return queue * self.eta(facts, models) + reload

    def eta(self, facts: RequestFacts, models: Models) -> float:
        """The memory factor applied to T: the tenant's global η."""
        return models.workload(facts.tenant).eta.get()

    def _params(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"


POLICIES: dict[str, type[TtlPolicy]] = {}


def register_policy(cls: type[TtlPolicy]) -> type[TtlPolicy]:
    """Class decorator: make a policy available to ``get_policy`` under ``cls.name``."""
    if cls.name in POLICIES:
        raise ValueError(f"a TTL policy named {cls.name!r} is already registered")
    POLICIES[cls.name] = cls
    return cls


def get_policy(name: str, **params: Any) -> TtlPolicy:
    """Build the policy called ``name``; the error lists the valid names.

    >>> get_policy("continuum")
    ContinuumPolicy()
    >>> get_policy("lru")
    Traceback (most recent call last):
    ...
    ValueError: unknown TTL policy 'lru'; valid: cachettl, continuum, fixed, none
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        valid = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown TTL policy {name!r}; valid: {valid}") from None
    return cls(**params)


def _cold_start(benefit: float, cap_s: float | None = None) -> Decision:
    """The paper's rule: durations ~ Exp(mean 1 s), η = 1 ⇒ τ = ln(B/1 s) for B > 1 s."""
    ttl = exponential_ttl(benefit)
    if cap_s is not None:
        ttl = min(ttl, cap_s)
    probability = 1.0 - math.exp(-ttl)
    return Decision(ttl, probability, max(0.0, probability * benefit - ttl), COLD_START, benefit)


def _search(
    facts: RequestFacts,
    models: Models,
    levels: Sequence[Level],
    benefit: float,
    cap_s: float | None,
    pressure: float = 1.0,
    prior_samples: float = 0.0,
    contradiction_alpha: float = 0.0,
    slack: float = 1.0,
) -> Decision:
    """Maximise F(τ)·B − λ·τ (λ = ``pressure``, the paper's λ = 1): the same exact search
    on the benefit B/λ. F is the first level with enough samples (the paper's back-off);
    with ``prior_samples`` α > 0, the thinner levels skipped on the way are blended in.

    Blending is the posterior predictive of a Dirichlet process: a level with n samples
    and empirical CDF Fₙ, whose prior is its parent's distribution G with strength α,
    predicts (n·Fₙ + α·G)/(n + α). Applied from the chosen level (or the exponential
    cold-start law) up to the most specific level, a call's own few samples move its TTL
    at once instead of counting for nothing until they number K. With
    ``contradiction_alpha`` > 0 a thin level whose samples clearly contradict the qualified
    level's decides alone (:meth:`DurationHierarchy.chain`). With ``slack`` s > 1 the pin
    is held for s·τ* (at most the cap), its F taken there (:func:`_widen`).
    """
    chain = models.durations.chain(
        facts.tool, facts.tool_args, facts.tenant, levels, contradiction_alpha
    )
    chosen = chain.chosen
    load_benefit = benefit / pressure
    if prior_samples > 0.0 and chain.thin:
        parts, rest = [], 1.0
        for _, model in chain.thin:
            n = model.n_samples
            parts.append((rest * n / (n + prior_samples), model.sorted_samples()))
            rest *= prior_samples / (n + prior_samples)
        names = [level.value for level, _ in chain.thin]
        if chosen.model is not None and chosen.level is not None:
            parts.append((rest, chosen.model.sorted_samples()))
            names.append(chosen.level.value)
            rest = 0.0
        else:
            names.append(COLD_START)
        ttl, probability = best_ttl_mixture(parts, load_benefit, cap_s, exp_weight=rest)
        basis = "+".join(names)
        cdf: Callable[[float], float] = functools.partial(mixture_cdf, parts=parts, exp_weight=rest)
    elif chosen.model is None or chosen.level is None:
        decision = _cold_start(load_benefit, cap_s)
        probability = decision.return_probability
        ttl, basis = decision.ttl_s, decision.basis
        cdf = _exponential_cdf
    else:
        ttl, probability = chosen.model.best_ttl(load_benefit, cap_s)
        basis = chosen.level.value
        cdf = chosen.model.cdf
    if slack > 1.0 and ttl > 0.0:
        ttl, probability = _widen(ttl, slack, cap_s, cdf)
    expected = probability * benefit - pressure * ttl if ttl > 0 else 0.0
    return Decision(ttl, probability, expected, basis, benefit)


def _exponential_cdf(duration_s: float) -> float:
    """F of the cold-start law, Exp(mean 1 s)."""
    return -math.expm1(-duration_s)


def _widen(
    ttl: float, slack: float, cap_s: float | None, cdf: Callable[[float], float]
) -> tuple[float, float]:
    """``(s·τ*, F(s·τ*))``, the TTL at most ``cap_s``: the optimum with slack.

    The exact search puts τ* on a sample of the window, the longest of a cluster of
    durations that still pays, so a new call of the same law lands just past it about as
    often as just before it: the window estimates the law, it is not the law. A pin that
    lapses by a hair loses the whole benefit B, while holding it s times longer costs
    (s − 1)·τ* more, little for the short calls where such near misses are common.

    >>> _widen(0.06, 2.0, None, lambda t: min(1.0, t / 0.2))
    (0.12, 0.6)
    >>> _widen(0.06, 2.0, 0.1, lambda t: min(1.0, t / 0.2))
    (0.1, 0.5)
    """
    wide = ttl * slack if cap_s is None else min(ttl * slack, cap_s)
    return wide, cdf(wide)


@register_policy
class ContinuumPolicy(TtlPolicy):
    """Continuum's policy (arXiv 2511.02230): the tool's CDF, else all tools', else Exp(1 s).

    >>> models = get_policy("continuum").new_models(min_samples=3)
    >>> for d in [0.1, 0.2, 0.3, 0.4, 30.0]:
    ...     models.record_tool_call("grep", None, d)
    >>> facts = RequestFacts(tool="grep", reload_cost_s=1.0, queue_delay_s=0.0)
    >>> get_policy("continuum").decide(facts, models)
    Decision(ttl_s=0.4, return_probability=0.8, expected_benefit_s=0.4, basis='tool', benefit_s=1.0)
    """

    name = "continuum"
    forgets_on_drift = False

    def decide(self, facts: RequestFacts, models: Models) -> Decision:
        benefit = self.benefit_s(facts, models)
        return _search(facts, models, (Level.TOOL, Level.TENANT), benefit, None)


@register_policy
class CachettlPolicy(TtlPolicy):
    """Ours: per-invocation keys with back-off, drift forgetting, shared
    cross-tenant priors for cold start (when the tenant shares), a hard TTL cap, a holding
    cost priced by the load of the moment (``load_aware``; λ = 1 when the caller passes no
    load signals), η from the program's own progress (``per_program``) and, with
    ``prior_samples`` α > 0, levels with too few samples blended into the back-off (see
    ``_search``); a thin level whose own samples clearly contradict the level the back-off
    reached decides alone (``contradiction_alpha``, a Kolmogorov–Smirnov test; 0: off);
    a pin is held ``ttl_slack`` times the optimum (see ``_widen``; 1: the optimum itself).
    The defaults are those the simulator's ablation kept
    (simulator/README.md, "cachettl vs the paper").

    >>> models = get_policy("cachettl").new_models(min_samples=2)
    >>> for d in [0.1, 0.1, 0.1]:
    ...     models.record_tool_call("bash", "ls -la", d)
    >>> for d in [20.0, 25.0, 30.0]:
    ...     models.record_tool_call("bash", "pytest -x", d)
    >>> policy = get_policy("cachettl", ttl_cap_s=60.0)
    >>> ls = RequestFacts(tool="bash", tool_args="ls src", reload_cost_s=1.0)
    >>> policy.decide(ls, models).ttl_s
    0.1
    >>> get_policy("cachettl", ttl_cap_s=60.0, ttl_slack=2.0).decide(ls, models).ttl_s
    0.2
    >>> pytest = RequestFacts(tool="bash", tool_args="pytest", reload_cost_s=1.0)
    >>> policy.decide(pytest, models).ttl_s
    0.0
    """

    name = "cachettl"
    forgets_on_drift = True

    def __init__(
        self,
        ttl_cap_s: float = DEFAULT_TTL_CAP_S,
        load_aware: bool = True,
        load_floor: float = 0.25,
        per_program: bool = True,
        prior_samples: float = 0.0,
        contradiction_alpha: float = CONTRADICTION_ALPHA,
        ttl_slack: float = DEFAULT_TTL_SLACK,
    ) -> None:
        self.ttl_cap_s = check_non_negative("ttl_cap_s", ttl_cap_s)
        self.ttl_slack = check_finite("ttl_slack", ttl_slack)
        if self.ttl_slack < 1.0:
            raise ValueError(f"ttl_slack must be >= 1, got {ttl_slack!r}")
        self.prior_samples = check_non_negative("prior_samples", prior_samples)
        self.contradiction_alpha = check_non_negative("contradiction_alpha", contradiction_alpha)
        if self.contradiction_alpha >= 1:
            raise ValueError(f"contradiction_alpha must be < 1, got {contradiction_alpha!r}")
        self.load_aware = load_aware
        self.load_floor = check_non_negative("load_floor", load_floor)
        if not 0.0 < load_floor <= 1.0:
            raise ValueError(f"load_floor must be in (0, 1], got {load_floor!r}")
        self.per_program = per_program

    def pressure(self, facts: RequestFacts) -> float:
        """λ: the share of this pin's memory that waiting work would use now.

        The paper charges every pin as if the queue were always blocked (λ = 1). With load
        signals, λ = (waiting demand − free capacity) / pinned tokens, clamped to
        [``load_floor``, 1]; the floor prices the load that may arrive during τ.
        """
        if not self.load_aware or facts.waiting_tokens is None or facts.free_tokens is None:
            return 1.0
        held = max(facts.context_tokens, 1)
        share = (facts.waiting_tokens - facts.free_tokens) / held
        return min(1.0, max(self.load_floor, share))

    def eta(self, facts: RequestFacts, models: Models) -> float:
        """η, or with ``per_program`` the program's own progress:
        η_program = 1 − E[remaining | k served] / E[turns] — 0 for a program that has just
        started or for memoryless lengths (where the global η is 0 too), → 1 near the end.
        """
        remaining = models.workload(facts.tenant).remaining
        if not self.per_program or remaining.n_programs == 0:
            return super().eta(facts, models)
        expected_total = remaining.expected_remaining(0)
        left = remaining.expected_remaining(facts.turns_served)
        return min(1.0, max(0.0, 1.0 - left / expected_total)) if expected_total else 0.0

    def decide(self, facts: RequestFacts, models: Models) -> Decision:
        benefit = self.benefit_s(facts, models)
        levels: tuple[Level, ...] = (Level.INVOCATION, Level.TOOL, Level.TENANT)
        if facts.share:
            levels += (Level.SHARED,)
        return _search(
            facts,
            models,
            levels,
            benefit,
            self.ttl_cap_s,
            self.pressure(facts),
            self.prior_samples,
            self.contradiction_alpha,
            self.ttl_slack,
        )


@register_policy
class FixedTtlPolicy(TtlPolicy):
    """A static TTL for every tool call (the authors' preview code pins for 2 s).

    With ``skip_slow_tools``, a tool whose running mean exceeds the TTL is not pinned,
    as in that code.

    >>> get_policy("fixed", ttl_s=2.0).decide(RequestFacts(tool="ls"), Models.for_profile()).ttl_s
    2.0
    """

    name = "fixed"

    def __init__(self, ttl_s: float = 2.0, skip_slow_tools: bool = True) -> None:
        self.ttl_s = check_non_negative("ttl_s", ttl_s)
        self.skip_slow_tools = skip_slow_tools

    def decide(self, facts: RequestFacts, models: Models) -> Decision:
        model = models.durations.model(Level.TOOL, facts.tool, None, facts.tenant)
        if self.skip_slow_tools and model is not None and model.mean() > self.ttl_s:
            return Decision(0.0, 0.0, 0.0, "fixed", 0.0)
        probability = model.cdf(self.ttl_s) if model is not None else 0.0
        return Decision(self.ttl_s, probability, 0.0, "fixed", 0.0)


@register_policy
class NoPinPolicy(TtlPolicy):
    """Never pin: the engines' end-of-turn release.

    >>> get_policy("none").decide(RequestFacts(tool="ls"), Models.for_profile()).ttl_s
    0.0
    """

    name = "none"

    def decide(self, facts: RequestFacts, models: Models) -> Decision:
        return Decision(0.0, 0.0, 0.0, "none", 0.0)
