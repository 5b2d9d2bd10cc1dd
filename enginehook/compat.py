"""Refuse to start on a vLLM whose internals differ from the ones the hook was built on.

The hook overrides narrow scheduler hooks and relies on block reference counts and queue
methods of vLLM's v1 core (listed below). On another version those may have moved; the
engine then fails at start-up with a message naming the tested versions rather than
corrupting the KV cache.

What the hook cannot use does not stop the engine: without prefix caching a pin could
never be hit, and hybrid, sliding-window and other non-full-attention KV layouts keep null
or state blocks the pin table does not handle. :func:`passthrough_reason` names such a
case; the hook then passes through (vLLM's own scheduling, no pins), logs one warning and
sets the ``cachettl_passthrough`` metric.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = [
    "TESTED_VERSIONS",
    "check_engine",
    "check_kv_layout",
    "check_vllm",
    "compat_problems",
    "kv_layout_problem",
    "passthrough_reason",
]

#: vLLM versions whose internals the hook was verified against.
TESTED_VERSIONS = ("0.32.0",)

_SCHEDULER_METHODS = (
    "_free_blocks",
    "_free_request",
    "_request_blocks_can_be_freed",
    "_preempt_request",
    "add_request",
    "schedule",
    "reset_prefix_cache",
    "shutdown",
    "finish_requests",
    "update_from_output",
)
_MANAGER_METHODS = ("pop_blocks_for_free", "allocate_slots", "free")
_QUEUE_METHODS = {
    "add_request",
    "pop_request",
    "peek_request",
    "prepend_request",
    "prepend_requests",
    "remove_request",
    "remove_requests",
    "__bool__",
    "__len__",
    "__iter__",
}


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def compat_problems(version: str | None = None) -> list[str]:
    """What differs from the tested vLLM internals (empty: compatible)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.request_queue import RequestQueue
    from vllm.v1.core.sched.scheduler import Scheduler

    problems: list[str] = []
    version = version if version is not None else _version()
    if version not in TESTED_VERSIONS:
        problems.append(f"vLLM {version} is not a tested version")
    problems += [f"Scheduler.{m} missing" for m in _SCHEDULER_METHODS if not hasattr(Scheduler, m)]
    problems += [
        f"KVCacheManager.{m} missing" for m in _MANAGER_METHODS if not hasattr(KVCacheManager, m)
    ]
    if not hasattr(BlockPool, "free_blocks"):
        problems.append("BlockPool.free_blocks missing")
    abstract = set(getattr(RequestQueue, "__abstractmethods__", ()))
    if abstract != _QUEUE_METHODS:
        problems.append(
            f"RequestQueue abstract methods changed: {sorted(abstract ^ _QUEUE_METHODS)}"
        )
    params = inspect.signature(Scheduler._free_blocks).parameters
    if list(params) != ["self", "request"]:
        problems.append("Scheduler._free_blocks signature changed")
    return problems


def check_vllm(version: str | None = None) -> None:
    """Raise ``RuntimeError`` naming the tested versions if internals differ."""
    problems = compat_problems(version)
    if problems:
        raise RuntimeError(
            "CacheTTL engine hook refuses to start: "
            + "; ".join(problems)
            + f". Tested vLLM versions: {', '.join(TESTED_VERSIONS)}."
        )


def kv_layout_problem(kv_cache_config: Any) -> str | None:
    """Why the hook cannot pin this KV layout (``None``: one full-attention group)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        return (
            f"CacheTTL engine hook supports one full-attention KV cache group; this model has "
            f"{len(groups)} (hybrid layouts are not supported)"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or getattr(spec, "sliding_window", None) is not None:
        return (
            f"CacheTTL engine hook supports full attention only; this model's KV layout is "
            f"{type(spec).__name__} (sliding-window and state layouts are not supported)"
        )
    return None


def check_kv_layout(kv_cache_config: Any) -> None:
    """Raise ``RuntimeError`` unless the model has one full-attention KV cache group."""
    problem = kv_layout_problem(kv_cache_config)
    if problem is not None:
        raise RuntimeError(problem)


def passthrough_reason(scheduler: Any) -> tuple[str, str] | None:
    """``(metric reason, message)`` when the hook must pass through on this engine
    (no prefix caching, a KV layout it cannot pin), else ``None``."""
    if not scheduler.cache_config.enable_prefix_caching:
        return (
            "no_prefix_caching",
            "prefix caching is off, so a pinned prefix could never be hit; pass "
            "--enable-prefix-caching to pin",
        )
    problem = kv_layout_problem(scheduler.kv_cache_config)
    if problem is not None:
        return "kv_layout", problem
    return None


def check_engine(scheduler: Any) -> None:
    """What the hook cannot run without (raises ``RuntimeError``): a tested vLLM whose
    internals are the expected ones, and the scheduler flavour that matches async
    scheduling."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    check_vllm()
    config = scheduler.vllm_config
    if config.scheduler_config.async_scheduling and not isinstance(scheduler, AsyncScheduler):
        raise RuntimeError(
            "async scheduling is on: use enginehook.scheduler.CacheTTLAsyncScheduler "
            "(or pass --no-async-scheduling)"
        )
