"""What the hook needs of one engine, checked when its scheduler starts.

:func:`check_engine` refuses what the hook cannot run without: a vLLM whose internals differ
from the tested ones (:mod:`enginehook.vllm.compat`), rules it cannot carry out, and the
scheduler class that does not match async scheduling (:func:`hook_scheduler_cls` names the
right one).

What the hook cannot use does not stop the engine: without prefix caching a pin could
never be hit, and state (Mamba), chunked-local, cross-attention and sliding-window-only KV
layouts keep blocks the pin table does not handle (full attention alone or with
sliding-window groups is pinned per group). :func:`passthrough_reason` names such a
case; the hook then passes through (vLLM's own scheduling, no pins), logs one warning and
sets the ``cachettl_passthrough`` metric.
"""

from __future__ import annotations

import logging
from typing import Any

from enginehook.vllm.compat import check_vllm

__all__ = [
    "check_engine",
    "check_kv_layout",
    "hook_scheduler_cls",
    "kv_layout_problem",
    "passthrough_reason",
]


def kv_layout_problem(kv_cache_config: Any) -> str | None:
    """Why the hook cannot pin this KV layout (``None``: it can).

    Pinnable: full-attention groups, alone or with sliding-window groups (hybrid models
    such as Gemma-3 or GPT-OSS). A pin holds each group's hashed blocks, which for a
    sliding-window group are the ones inside the window (vLLM has already replaced the
    others with null blocks), i.e. what vLLM's hybrid manager needs for the next turn's
    prefix hit. Mamba and other state layouts, chunked-local and cross attention are not.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups)
    kinds = [type(g.kv_cache_spec) for g in groups]
    other = [k.__name__ for k in kinds if k not in (FullAttentionSpec, SlidingWindowSpec)]
    if other:
        return (
            f"CacheTTL engine hook pins full-attention and sliding-window KV cache groups; "
            f"this model has {', '.join(sorted(set(other)))} (state and other layouts are "
            f"not supported)"
        )
    full = [
        g
        for g in groups
        if type(g.kv_cache_spec) is FullAttentionSpec
        and getattr(g.kv_cache_spec, "sliding_window", None) is None
    ]
    if not full:
        return (
            "CacheTTL engine hook needs a full-attention KV cache group; this model's layout "
            "is SlidingWindowSpec only"
        )
    return None


def check_kv_layout(kv_cache_config: Any) -> None:
    """Raise ``RuntimeError`` unless the hook can pin the model's KV layout."""
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


def hook_scheduler_cls(async_scheduling: bool | None = None) -> str:
    """The hook's ``--scheduler-cls`` for an engine: ``CacheTTLAsyncScheduler`` where vLLM
    schedules asynchronously (GPUs, by default), ``CacheTTLScheduler`` where it cannot
    (the CPU platform turns async scheduling off). ``None``: decide by the platform."""
    if async_scheduling is None:
        from vllm.platforms import current_platform

        async_scheduling = not current_platform.is_cpu()
    name = "CacheTTLAsyncScheduler" if async_scheduling else "CacheTTLScheduler"
    return f"enginehook.vllm.scheduler.{name}"


def check_engine(scheduler: Any) -> None:
    """What the hook cannot run without (raises ``RuntimeError``): a vLLM whose internals
    are the expected ones (an untested version among them is logged as a warning, refused
    with ``strict_vllm_version``), rules it can carry out (no program-level admission
    yet), and the scheduler flavour that matches async scheduling."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    warning = check_vllm(strict=scheduler.cachettl.strict_vllm_version)
    if warning:
        logging.getLogger("enginehook").warning("%s", warning)
    admission = scheduler.cachettl.rules.admission
    if admission != "none":
        raise RuntimeError(
            f"additional_config.cachettl.admission={admission!r}: program-level admission runs "
            "in the simulator only; the vLLM hook cannot hold a paused program's requests yet "
            "(leave admission at 'none')"
        )
    config = scheduler.vllm_config
    if config.scheduler_config.async_scheduling and not isinstance(scheduler, AsyncScheduler):
        raise RuntimeError(
            "async scheduling is on: use enginehook.scheduler.CacheTTLAsyncScheduler "
            "(or pass --no-async-scheduling)"
        )
