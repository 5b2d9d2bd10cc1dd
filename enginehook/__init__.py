"""CacheTTL's vLLM engine hook: TTL pinning, program-level priority, tool-call tracking.

The modules imported here are engine-independent (plain ids, block counts and times) so
that the simulator drives the same code; nothing here imports vLLM. The scheduler classes
live in :mod:`enginehook.scheduler` (imports vLLM) and are loaded by vLLM with
``--scheduler-cls enginehook.scheduler.CacheTTLScheduler``.
"""

from enginehook.decide import TtlDecider
from enginehook.detect import DetectedCall, detect_tool_call
from enginehook.hints import Hints
from enginehook.pins import Pin, PinResult, PinTable, ReleaseReason
from enginehook.pressure import PressureRule, choose_victims, may_release
from enginehook.priority import ProgramArrivals, SortedWaitQueue, priority_key
from enginehook.tracker import PinOutcome, ProgramEndEvent, ToolCallEvent, ToolCallTracker

__all__ = [
    "DetectedCall",
    "Hints",
    "Pin",
    "PinOutcome",
    "PinResult",
    "PinTable",
    "PressureRule",
    "ProgramArrivals",
    "ProgramEndEvent",
    "ReleaseReason",
    "SortedWaitQueue",
    "ToolCallEvent",
    "ToolCallTracker",
    "TtlDecider",
    "choose_victims",
    "detect_tool_call",
    "may_release",
    "priority_key",
]
