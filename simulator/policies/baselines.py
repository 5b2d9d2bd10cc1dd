"""Baselines that never pin: program-level FCFS and Autellix's PLAS (``vllm`` itself is
:class:`simulator.policies.base.SchedulingPolicy`)."""

from __future__ import annotations

from enginehook.core.rules import SchedulingRules
from simulator.policies.base import SchedulingPolicy, register_scheduling_policy

__all__ = ["Autellix", "ProgramFcfs"]


@register_scheduling_policy
class ProgramFcfs(SchedulingPolicy):
    name = "program-fcfs"
    help = "vllm with program-level FCFS (the paper's ablation step 1)"
    RULES = SchedulingRules(ordering="program-fcfs")


@register_scheduling_policy
class Autellix(SchedulingPolicy):
    """PLAS: priority = the program's attained service (model time of its completed calls),
    discretised into levels [0, 1), [1, 3), [3, 7), [7, ∞) s; FCFS within a level (the
    controller's ``plas`` ordering). As in vLLM's priority scheduling, a running request
    that cannot grow preempts the running request of the worst priority."""

    name = "autellix"
    help = "program-level least attained service (PLAS), end-of-turn release"
    RULES = SchedulingRules(ordering="plas")
    preempt_by_order = True
