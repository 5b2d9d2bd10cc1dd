"""CacheTTL's vLLM engine hook: TTL pinning, program-level priority, tool-call tracking.

:class:`PinController` is the one object that decides about a finished turn's KV cache;
the vLLM scheduler classes and the simulator both host it, under one
:class:`SchedulingRules`.

The modules imported here are engine-independent (plain ids, block counts and times) so
that the simulator drives the same code; nothing here imports vLLM. The scheduler classes
live in :mod:`enginehook.vllm.scheduler` (imports vLLM) and are loaded by vLLM with
``--scheduler-cls enginehook.scheduler.CacheTTLScheduler``.
"""

from enginehook.core.host import EngineHost, FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.pins import Pin, PinResult, PinTable, ReleaseReason
from enginehook.core.pressure import PressureRule, choose_victims, may_release
from enginehook.core.priority import ProgramArrivals, SortedWaitQueue
from enginehook.core.registries import ORDERINGS, VICTIMS
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import PinOutcome, ProgramEndReport, ToolCallReport, ToolCallTracker
from enginehook.hints.flat import Hints

__all__ = [
    "ORDERINGS",
    "VICTIMS",
    "EngineHost",
    "FinishedTurn",
    "Hints",
    "Pin",
    "PinController",
    "PinOutcome",
    "PinResult",
    "PinTable",
    "PressureRule",
    "ProgramArrivals",
    "ProgramEndReport",
    "ReleaseReason",
    "SchedulingRules",
    "SortedWaitQueue",
    "ToolCallReport",
    "ToolCallTracker",
    "choose_victims",
    "may_release",
]
