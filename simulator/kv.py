"""Paged KV memory with vLLM's prefix cache, and an optional CPU tier.

vLLM (V1) hashes full blocks and, when a request frees them, appends them to the tail of a
free queue in reverse order (last block first) while keeping their hash; allocation pops
the head of the queue, evicting the cached content there. A program's context only grows
from turn to turn, so its cached blocks always form a prefix that is eaten from the tail:
the pool therefore keeps, per program, the length of that prefix (one *segment* of the
free queue) instead of individual blocks. Blocks with no reusable content (the partial last
block, leftovers) are *empty* free blocks, handed out before any cached one.

>>> pool = BlockPool(10)
>>> pool.allocate(6)
True
>>> pool.release("p", held=6, cached=5)       # 5 full blocks stay hittable
>>> pool.free, pool.cached_prefix("p")
(10, 5)
>>> pool.allocate(7)                          # 5 empty blocks, then 2 evicted from p's tail
True
>>> pool.cached_prefix("p"), pool.evicted_blocks
(3, 2)
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BlockPool", "CpuTier"]


class BlockPool:
    """``num_blocks`` blocks: used (requests, pins), cached-free (LRU), empty-free."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"KV capacity must be at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.used = 0
        self._empty = num_blocks
        self._segments: OrderedDict[str, int] = OrderedDict()  # oldest first
        self._cached = 0
        self.evicted_blocks = 0

    @property
    def free(self) -> int:
        """Blocks an allocation can take (empty plus cached-but-free)."""
        return self._empty + self._cached

    def cached_prefix(self, program_id: str) -> int:
        """Leading blocks of the program's context still cached in the free queue."""
        return self._segments.get(program_id, 0)

    def take_prefix(self, program_id: str, blocks: int) -> int:
        """A prefix hit: move up to ``blocks`` cached blocks of the program to *used*.

        The rest of the program's segment (beyond the hit) loses its content.
        """
        cached = self._segments.pop(program_id, 0)
        self._cached -= cached
        hit = min(cached, max(blocks, 0))
        self._empty += cached - hit
        self.used += hit
        return hit

    def allocate(self, blocks: int) -> bool:
        """Take ``blocks`` free blocks (empty first, then LRU cached); False if short."""
        if blocks <= 0:
            return True
        if blocks > self._empty + self._cached:
            return False
        take = min(self._empty, blocks)
        self._empty -= take
        rest = blocks - take
        while rest:
            program_id, count = next(iter(self._segments.items()))
            evict = min(count, rest)
            rest -= evict
            self._cached -= evict
            self.evicted_blocks += evict
            if evict == count:
                del self._segments[program_id]
            else:
                self._segments[program_id] = count - evict
        self.used += blocks
        return True

    def release(self, program_id: str, held: int, cached: int) -> None:
        """Free ``held`` used blocks; the first ``cached`` (full, hashed) become the
        program's hittable prefix at the tail of the LRU queue, the rest empty."""
        cached = max(0, min(cached, held))
        self.used -= held
        old = self._segments.pop(program_id, 0)
        self._cached -= old
        self._empty += old + held - cached
        if cached:
            self._segments[program_id] = cached
            self._cached += cached

    def forget(self, program_id: str) -> None:
        """Drop the program's cached prefix (its content can never be hit again)."""
        old = self._segments.pop(program_id, 0)
        self._cached -= old
        self._empty += old


class CpuTier:
    """Host-memory KV store (LMCache-like): every finished or preempted request's prefix
    is written through; least recently stored programs are dropped beyond the capacity.

    >>> tier = CpuTier(100)
    >>> tier.store("a", 60); tier.store("b", 60)
    >>> tier.tokens("a"), tier.tokens("b")
    (0, 60)
    """

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"CPU tier capacity must be >= 1 token, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._programs: OrderedDict[str, int] = OrderedDict()
        self._total = 0

    def tokens(self, program_id: str) -> int:
        """Cached prefix tokens of the program on the host."""
        return self._programs.get(program_id, 0)

    def store(self, program_id: str, tokens: int) -> None:
        """Write (or refresh) the program's prefix; evict the least recent beyond capacity."""
        self._total -= self._programs.pop(program_id, 0)
        tokens = min(tokens, self.capacity_tokens)
        self._programs[program_id] = tokens
        self._total += tokens
        while self._total > self.capacity_tokens:
            _, dropped = self._programs.popitem(last=False)
            self._total -= dropped

    def forget(self, program_id: str) -> None:
        """The program ended."""
        self._total -= self._programs.pop(program_id, 0)
