"""vLLM 0.34's own cache-aware admission (``--cache-aware-admission-window``), a stock arm.

vLLM 0.34.0, ``vllm/v1/core/sched/scheduler.py``, ``Scheduler._reorder_waiting_by_cached_prefix``
(called at the top of the waiting phase of ``Scheduler.schedule`` when no request was
preempted in the step), with ``SchedulerConfig.cache_aware_admission_window`` and
``cache_aware_admission_threshold`` (``vllm/config/scheduler.py``; defaults 0, i.e. off, and
0.5):

- nothing happens with fewer than two waiting requests, or while the KV cache's usage
  (``KVCacheManager.usage``: blocks held by requests over the pool) is below the threshold;
- the window is the first ``window`` waiting requests in queue order; only plain waiting
  ones (status ``WAITING``, nothing computed: here, not preempted) may move, every other
  keeps its exact slot;
- those slots are refilled deepest cached prefix first (``get_num_cached_tokens``: the
  prefix-cache hit in tokens), queue order breaking ties; the queue beyond the window is
  untouched.

It is program-blind: it knows neither programs nor tools, only which waiting prompts the
prefix cache still holds, and it pins nothing (end-of-turn release, LRU prefix cache, FCFS
as :class:`~simulator.policies.base.SchedulingPolicy`). vLLM applies it only with prefix
caching and the ``fcfs`` policy, as here.
"""

from __future__ import annotations

from typing import Any, ClassVar

from simulator.policies.base import Param, SchedulingPolicy, register_scheduling_policy

__all__ = ["CacheAwareAdmission", "reorder_window"]


def _window(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"window must be >= 0, got {value}")
    return value


def _threshold(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {value}")
    return value


def reorder_window(head: list[Any], movable: list[bool], cached: list[int]) -> list[Any]:
    """vLLM's reorder of one window: the movable slots refilled deepest cached prefix
    first (ties: queue order), every other slot unchanged.

    >>> reorder_window(["a", "b", "c", "d"], [True, False, True, True], [0, 99, 64, 64])
    ['c', 'b', 'd', 'a']
    """
    slots = [i for i, ok in enumerate(movable) if ok]
    if len(slots) < 2:
        return list(head)
    order = sorted(slots, key=lambda i: (-cached[i], i))
    reordered = list(head)
    for slot, source in zip(slots, order, strict=True):
        reordered[slot] = head[source]
    return reordered


@register_scheduling_policy
class CacheAwareAdmission(SchedulingPolicy):
    """vLLM with ``cache_aware_admission_window`` on (see the module docstring)."""

    name = "vllm-cache-aware"
    help = "vLLM 0.34 cache_aware_admission_window: cached-prefix prompts first in a window"
    PARAMS: ClassVar[dict[str, Param]] = {
        "window": Param(
            _window, 32, "cache_aware_admission_window: waiting requests looked at (0: off)"
        ),
        "threshold": Param(
            _threshold, 0.5, "cache_aware_admission_threshold: KV usage below which it is off"
        ),
    }
    window: int
    threshold: float

    def attach(self, host: Any) -> None:
        engine = host.engine
        admit = engine._admit

        def admit_after_reorder(now: float, budget: int, scheduled: list[Any]) -> Any:
            self._reorder(engine, host.config.block_size)
            return admit(now, budget, scheduled)

        engine._admit = admit_after_reorder

    def _reorder(self, engine: Any, block_size: int) -> None:
        waiting, pool = engine.waiting, engine.pool
        if self.window <= 0 or len(waiting) < 2 or pool.used / pool.num_blocks < self.threshold:
            return
        queue = list(waiting)  # sorted, in queue order
        head = queue[: self.window]
        movable = [not r.preempted and r.computed == 0 for r in head]
        cached = [
            min(pool.cached_prefix(r.program_id), (r.prompt_tokens - 1) // block_size) for r in head
        ]
        reordered = reorder_window(head, movable, cached)
        if reordered != head:
            waiting.remove_many(head)
            waiting.extend_front(reordered)
