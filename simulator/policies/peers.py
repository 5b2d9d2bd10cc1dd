"""The 2026 peers: ThunderAgent, llm-d's program-aware fairness and SGLang's session radix
cache. Each is a set of
:class:`enginehook.core.rules.SchedulingRules` (so its mechanism runs in the controller both
hosts run) and, for SGLang, a TTL; sources and constants are in simulator/README.md.
"""

from __future__ import annotations

from typing import ClassVar

from enginehook.core.host import FinishedTurn
from enginehook.core.rules import SchedulingRules
from estimator import Decision, RequestFacts
from simulator.policies.base import (
    Param,
    SchedulingPolicy,
    register_scheduling_policy,
    rule_params,
)
from simulator.policies.pinning import PAPER_RULES, PinningPolicy

__all__ = ["LlmdFairness", "SglangSession", "ThunderAgent"]


@register_scheduling_policy
class ThunderAgent(SchedulingPolicy):
    """ThunderAgent (arXiv 2602.13692): program-level admission in front of an unmodified
    vLLM (FCFS, end-of-turn release, LRU prefix cache). Programs are paused and resumed
    whole at tool boundaries so that the KV of the admitted programs fits
    (:mod:`enginehook.core.admission`: capacity model, 5 s check, best-fit-decreasing resume,
    forced resume after 30 min); no pinning."""

    name = "thunderagent"
    help = "ThunderAgent: pause/resume whole programs at tool boundaries to fit KV; no pins"
    RULES = SchedulingRules(ordering="fcfs", admission="thunderagent")
    PARAMS: ClassVar[dict[str, Param]] = {
        k: v for k, v in rule_params(RULES).items() if k in ("admission_interval_s",)
    }


@register_scheduling_policy
class LlmdFairness(SchedulingPolicy):
    """llm-d router EPP v0.9.0 ``program-aware-fairness`` (strategy ``las``): one queue per
    session, dispatched least attained service first (weighted tokens: prompt + 2 ×
    output), oldest head request breaking ties; vLLM behind it releases at end of turn.
    The router holds requests while the pool is saturated, so its order is the order in
    which the engine admits them: modelled as the engine's waiting order (the controller's
    ``las`` ordering)."""

    name = "llmd-fairness"
    help = "llm-d program-aware fairness: per-session queues, least attained service first"
    RULES = SchedulingRules(ordering="las")
    preempt_by_order = False  # vLLM behind the router preempts its newest request


#: SGLang's session radix cache: sessions' KV stays as ordinary cache (no TTL, no budget),
#: released for any allocation that needs it, least recently used first; FCFS queue.
SGLANG_RULES = PAPER_RULES.replace(ordering="fcfs", victim="least-recent")


#: The "TTL" of a session reference: longer than any run (the pin table takes finite TTLs).
_UNTIL_CLOSED_S = 365 * 86400.0


@register_scheduling_policy
class SglangSession(PinningPolicy):
    """SGLang 0.5.23 ``--enable-session-radix-cache``: a finished turn's KV stays in the
    radix cache referenced by its session until the session closes (the program ends);
    eviction consumes unreferenced entries first (here: the LRU prefix cache's free
    blocks), then referenced ones least recently used first (``least-recent`` victims,
    released for any allocation, running or new). No TTL: the reference lasts until the
    session closes or memory is needed."""

    name = "sglang-session"
    help = "SGLang session radix cache: session KV kept until close, evicted LRU after free"
    RULES = SGLANG_RULES
    PARAMS: ClassVar[dict[str, Param]] = {**PinningPolicy.PARAMS, **rule_params(SGLANG_RULES)}

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        return Decision(_UNTIL_CLOSED_S, 1.0, 0.0, "session", 0.0)
