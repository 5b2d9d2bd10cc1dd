"""The KV usage an engine with pins publishes (imports nothing of vLLM's).

Routers and gateways admit, place and hold work by the engine's ``vllm:kv_cache_usage_perc``
(vllm-router's program-scheduling token admission and its per-rank diagnostics, llm-d's
KV-utilization scorer, the DP load balancer's stats). vLLM computes it as one minus the
share of free blocks, and a block a pin holds is not free: an engine whose only KV is pins
and which runs nothing reads as full, so a router holds the very turns those pins wait for.

vLLM counts a cached block that no request holds as free: any allocation may take it. A
pinned block is the same kind of block with a claim on it that yields to running work
(the pressure rules of :mod:`enginehook.core.pressure`), so by default the published
usage counts the blocks that only pins hold as free and publishes their share beside it
(``cachettl_kv_pinned_perc`` on the hook's endpoint). A block that a request also holds
(a shared prefix) stays used. ``SchedulingRules.pins_in_kv_usage`` publishes vLLM's own
count instead.

>>> class B:  # a block: its reference count
...     def __init__(self, refs): self.ref_cnt = refs
>>> shared, own = B(2), B(1)
>>> pins_only_blocks([[shared, own]])  # the shared block is a running request's too
1
>>> pins_only_blocks([[shared, own], [shared]])  # two pins hold it, nobody else
2
>>> published_usage(0.75, pins_only=2, total=8, count_pins=False)
0.5
>>> published_usage(0.75, pins_only=2, total=8, count_pins=True)
0.75
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["PinnedUsage", "pins_only_blocks", "published_usage"]

#: How long a count of pins-only blocks is reused (a router scrapes every second or so;
#: ``make_stats`` runs every engine step).
REFRESH_S = 0.25


def pins_only_blocks(handles: Iterable[Sequence[Any]]) -> int:
    """Distinct blocks among pins' ``handles`` that no request holds: every reference to
    the block (its ``ref_cnt``) is a pin's."""
    refs: dict[int, list[Any]] = {}
    for handle in handles:
        for block in handle:
            entry = refs.get(id(block))
            if entry is None:
                refs[id(block)] = [block, 1]
            else:
                entry[1] += 1
    return sum(1 for block, pinned in refs.values() if block.ref_cnt <= pinned)


def published_usage(usage: float, *, pins_only: int, total: int, count_pins: bool) -> float:
    """vLLM's ``usage`` (share of blocks not free) with the ``pins_only`` blocks of a pool
    of ``total`` counted as free unless ``count_pins``."""
    if count_pins or total <= 0:
        return usage
    return min(1.0, max(0.0, usage - pins_only / total))


class PinnedUsage:
    """The pins-only block count, recounted at most every :data:`REFRESH_S` or when the
    number of pins changes (an O(pinned blocks) walk, kept off most engine steps)."""

    def __init__(self, total_blocks: int, clock: Callable[[], float]) -> None:
        #: Blocks of the pool a request can use (vLLM's count leaves out its null block).
        self.total = max(0, total_blocks - 1)
        self._clock = clock
        self._at = -float("inf")
        self._pins = -1
        self._blocks = 0

    def blocks(self, handles: Callable[[], Iterable[Sequence[Any]]], pins: int) -> int:
        """Blocks only pins hold (``handles``: every live pin's blocks; ``pins``: how
        many pins there are)."""
        now = self._clock()
        if pins == 0:
            self._blocks, self._pins = 0, 0
        elif pins != self._pins or now - self._at >= REFRESH_S:
            self._blocks, self._pins, self._at = pins_only_blocks(handles()), pins, now
        return self._blocks

    def share(self, blocks: int) -> float:
        """``blocks`` as a share of the usable pool."""
        return blocks / self.total if self.total else 0.0
