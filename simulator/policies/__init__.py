"""Scheduling policies of the simulator, chosen by name from one registry.

Every policy runs in the simulation's :class:`enginehook.core.lifecycle.PinController`, the object
the vLLM hook runs: a policy supplies its :class:`enginehook.core.rules.SchedulingRules` (queue
order, pressure rule, victims, TTL cap, pin budget), the TTL of a finished turn (``decide``)
and what it learns from the controller's events.

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
cachettl             ours (:mod:`simulator.policies.cachettl`): a switch per improvement
oracle               knows each tool's true duration, pins exactly when it pays
oracle-law           cachettl deciding on each call's true duration law, not its draw
thunderagent         ThunderAgent: pauses/resumes whole programs to fit KV, no pins
llmd-fairness        llm-d program-aware fairness: least attained service per session
sglang-session       SGLang session radix cache: kept until close, LRU after free cache
agentinfer           AgentInfer 0.2.0 Progress-TTL: others held out at admission, no pins
cachettl-agentinfer  AgentInfer's admission in front of cachettl (pins, program order)
vllm-cache-aware     vLLM 0.34 cache_aware_admission_window: cached prompts first, no pins
===================  =====================================================================
"""

from simulator.policies.agentinfer import AgentInfer, CachettlAgentInfer
from simulator.policies.base import (
    POLICIES,
    Param,
    SchedulingPolicy,
    get_scheduling_policy,
    paper_tool_key,
    register_scheduling_policy,
    rule_params,
    split_policy_list,
)
from simulator.policies.baselines import Autellix, ProgramFcfs
from simulator.policies.cachettl import BASE, DEFAULTS, IMPROVEMENTS, Cachettl
from simulator.policies.hindsight import OracleLaw
from simulator.policies.peers import LlmdFairness, SglangSession, ThunderAgent
from simulator.policies.pinning import (
    PAPER_RULES,
    Continuum,
    ContinuumPreview,
    Infercept,
    Oracle,
    PinningPolicy,
    StaticTtl,
)
from simulator.policies.stock import CacheAwareAdmission

__all__ = [
    "BASE",
    "DEFAULTS",
    "IMPROVEMENTS",
    "PAPER_RULES",
    "POLICIES",
    "AgentInfer",
    "Autellix",
    "CacheAwareAdmission",
    "Cachettl",
    "CachettlAgentInfer",
    "Continuum",
    "ContinuumPreview",
    "Infercept",
    "LlmdFairness",
    "Oracle",
    "OracleLaw",
    "Param",
    "PinningPolicy",
    "ProgramFcfs",
    "SchedulingPolicy",
    "SglangSession",
    "StaticTtl",
    "ThunderAgent",
    "get_scheduling_policy",
    "paper_tool_key",
    "register_scheduling_policy",
    "rule_params",
    "split_policy_list",
]
