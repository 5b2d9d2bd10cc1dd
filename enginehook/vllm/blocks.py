"""The blocks a pin holds in vLLM, per KV cache group (imports vLLM).

Full-attention groups keep the whole hashed prefix of a finished request; a
sliding-window group keeps the blocks of the window before that prefix's end, which is what
vLLM's hybrid KV cache manager checks for a prefix hit. The prefix a pin covers ends where
every group's hashed blocks end (vLLM hashes a window group one block short on some models).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

__all__ = ["PinnedBlocks", "take_pinned_blocks"]


def _hashed_end(blocks: list[Any], size: int) -> int:
    """Tokens up to the end of the last hashed block of one group's ``blocks``."""
    for i in range(len(blocks) - 1, -1, -1):
        if blocks[i].block_hash is not None and not blocks[i].is_null:
            return (i + 1) * size
    return 0


class PinnedBlocks(list[Any]):
    """A pin's blocks (all KV cache groups, allocation order per group) and the prompt
    tokens they cover (the full-attention groups' prefix)."""

    tokens: int = 0


def take_pinned_blocks(kv_cache_manager: Any, pool: Any, request: Request) -> PinnedBlocks:
    """The blocks of every KV cache group that the next turn's prefix hit needs, for a
    pin (the rest is freed now). Full-attention groups keep the whole hashed prefix;
    a sliding-window group the blocks of the window before that prefix's end (what
    vLLM's hybrid manager checks for a hit), taken back from the prefix cache where
    vLLM already freed them during decoding."""
    managers = kv_cache_manager.coordinator.single_type_managers
    groups = [m.pop_blocks_for_free(request.request_id) for m in managers]
    full = [type(m.kv_cache_spec) is FullAttentionSpec for m in managers]
    # The next turn can hit at most where every group's hashed blocks end.
    ends = [_hashed_end(blocks, m.block_size) for m, blocks in zip(managers, groups, strict=True)]
    covered = min(ends) if ends else 0
    handle, free = PinnedBlocks(), []
    for manager, blocks, is_full in zip(managers, groups, full, strict=True):
        if is_full:
            last = covered // manager.block_size
            kept = [b for b in blocks[:last] if b.block_hash is not None and not b.is_null]
        else:
            kept = _window_blocks(pool, request, manager, blocks, covered)
        ids = {id(b) for b in kept}
        free += [b for b in blocks if id(b) not in ids and not b.is_null]
        handle += kept
    if free:
        pool.free_blocks(reversed(free))
    handle.tokens = covered
    return handle


def _window_blocks(
    pool: Any, request: Request, manager: Any, blocks: list[Any], end: int
) -> list[Any]:
    """A sliding-window group's blocks for a prefix hit ending at token ``end``: the
    request's own where it still holds them, else the prefix cache's copy (touched,
    so the pin owns a reference); a block evicted already is left out."""
    size = manager.block_size
    first = manager.get_num_skipped_tokens(end) // size
    hashes = request.block_hashes if pool.hash_block_size == size else []
    kept: list[Any] = []
    for i in range(first, end // size):
        own = blocks[i] if i < len(blocks) else None
        if own is not None and not own.is_null and own.block_hash is not None:
            kept.append(own)
        elif i < len(hashes):
            cached = pool.get_cached_block(hashes[i], [manager.kv_cache_group_id])
            if cached:
                pool.touch(cached)
                kept += cached
    return kept
