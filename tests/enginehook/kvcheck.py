"""Read the KV that an in-process vLLM CPU engine holds, to test prefix hits on what they
mean: the KV a pinned prefix hit attends to is the KV a recompute of that prefix produces.

Greedy outputs are no such check: in bfloat16 the pinned path (prefill of turn 1, decode
of its outputs, prefill of turn 2's suffix) and a recompute (one prefill) round differently
on CPUs without AVX-512 BF16, and a greedy sequence turns one rounding difference into a
different token; nor does an equal output show that every pinned block was intact.

vLLM's CPU attention backend keeps one tensor per attention layer, shaped
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` and addressed by the scheduler's
block ids; viewed as ``[num_blocks, num_kv_heads, 2, block_size * head_size]`` its first
half per head holds the block's keys and its second its values (the interior order of a
half is the kernel's, the same for every block, so two blocks compare element by element).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.enginehook.driver import BLOCK, Driver

__all__ = [
    "KV_TOLERANCE",
    "Mismatch",
    "PromptKv",
    "block_contents",
    "kv_mismatches",
    "layer_caches",
    "run_capturing_prompt_kv",
]

#: Largest relative L2 error, ``‖got − ref‖ / ‖ref‖``, allowed between one head's keys (or
#: values) of one block of a prefix hit and of a recompute of the same tokens, in any
#: layer. The two paths round differently: turn 1 decoded the tokens at the end of the
#: pinned prefix one at a time, the recompute prefills them with the rest. 0.05 is at least
#: what every element off by 6 units in the last place of bfloat16 (ε = 2⁻⁷) gives; the
#: largest error measured on an AVX-512 BF16 CPU is 9e-4 (bfloat16; 0 in layer 0). What a
#: pin must never hold — another sequence's KV, zeros — is off by about 1 or more (zeros
#: exactly 1, unrelated KV of the same scale about √2): twenty times the tolerance, in any
#: dtype (``test_the_kv_checks_report_a_pinned_block_overwritten``).
KV_TOLERANCE = 0.05


def layer_caches(driver: Driver) -> dict[str, tuple[int, Any]]:
    """Each attention layer's KV cache tensor and its KV cache group, by layer name."""
    runner = driver.engine.engine_core.engine_core.model_executor.driver_worker.worker
    context = runner.model_runner.compilation_config.static_forward_context
    caches: dict[str, tuple[int, Any]] = {}
    for group, spec in enumerate(driver.scheduler.kv_cache_config.kv_cache_groups):
        for name in spec.layer_names:
            tensor = context[name].kv_cache
            assert tensor.dim() == 4, tensor.shape  # the CPU backend's layout (above)
            assert tensor.shape[2] == BLOCK, tensor.shape
            caches[name] = (group, tensor)
    return caches


def block_contents(driver: Driver, block_ids: list[int]) -> dict[str, Any]:
    """A copy of blocks ``block_ids`` in every layer's tensor (in a hybrid model's layers
    of every group: a block belongs to one group, whose layers alias the others' memory)."""
    return {name: tensor[block_ids].clone() for name, (_, tensor) in layer_caches(driver).items()}


@dataclass(frozen=True)
class PromptKv:
    """A request's KV for the full blocks of its prompt, copied right after its prefill:
    per KV cache group the block ids (``None`` where the group holds no block there, e.g.
    before a sliding window) and per layer the copied blocks (in the same order)."""

    block_ids: tuple[list[int | None], ...]
    kv: dict[str, Any]
    groups: dict[str, int]  # each layer's KV cache group


@dataclass(frozen=True)
class Mismatch:
    """One block whose keys or values differ from the reference beyond the tolerance."""

    layer: str
    block: int  # its index in the prompt (tokens block*BLOCK to (block+1)*BLOCK)
    half: str  # "key" or "value"
    error: float  # the largest relative L2 error over the block's heads


def _find_request(driver: Driver, rid: str) -> Any:
    """The scheduler's request for the engine's request ``rid`` (vLLM appends ``-`` and 8
    characters of its own)."""
    found = [
        r
        for key, r in driver.scheduler.requests.items()
        if key == rid or (key.startswith(rid + "-") and len(key) == len(rid) + 9)
    ]
    assert len(found) == 1, (rid, list(driver.scheduler.requests))
    return found[0]


def run_capturing_prompt_kv(
    driver: Driver, rid: str, ids: list[int], max_tokens: int, **kw: Any
) -> tuple[Any, PromptKv]:
    """Run one request to its end (alone: nothing else may be unfinished) and return its
    output with its prompt's KV, copied in the step that finished its prefill (so
    ``max_tokens`` must be 2 or more: it must still run after that step)."""
    assert max_tokens >= 2
    assert not driver.engine.has_unfinished_requests()
    full = len(ids) // BLOCK
    null = driver.scheduler.kv_cache_manager.block_pool.null_block.block_id
    driver.add(rid, ids, max_tokens, **kw)
    captured: PromptKv | None = None
    output = None
    while driver.engine.has_unfinished_requests():
        driver.steps += 1
        assert driver.steps < 10_000, "engine did not finish its requests"
        outs = driver.engine.step()
        if captured is None:
            request = _find_request(driver, rid)
            if request.num_computed_tokens >= len(ids):
                groups = driver.scheduler.kv_cache_manager.get_block_ids(request.request_id)
                block_ids = tuple(
                    [b if b != null else None for b in list(g[:full])] for g in groups
                )
                kv, layer_groups = {}, {}
                for name, (group, tensor) in layer_caches(driver).items():
                    rows = [b if b is not None else null for b in block_ids[group]]
                    kv[name], layer_groups[name] = tensor[rows].clone(), group
                captured = PromptKv(block_ids, kv, layer_groups)
        for out in outs:
            if out.finished and out.request_id == rid:
                output = out
                driver.finished_order.append(rid)
    assert captured is not None
    assert output is not None
    return output, captured


def _halves(blocks: Any) -> Any:
    """``[n, heads, BLOCK, 2*head]`` → ``[n, heads, 2 (key, value), BLOCK*head]``, float32."""
    return blocks.float().reshape(blocks.shape[0], blocks.shape[1], 2, -1)


def relative_errors(got: Any, ref: Any) -> Any:
    """Per block and half (key, value): the largest over heads of ‖got − ref‖ / ‖ref‖
    (``[n, 2]``)."""
    import torch

    a, b = _halves(got), _halves(ref)
    diff = torch.linalg.vector_norm(a - b, dim=-1)
    scale = torch.linalg.vector_norm(b, dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return (diff / scale).amax(dim=1)


def kv_mismatches(
    got: PromptKv, ref: PromptKv, tolerance: float = KV_TOLERANCE
) -> tuple[list[Mismatch], dict[int, set[int]]]:
    """The blocks of ``got`` whose keys or values are off ``ref`` beyond ``tolerance``
    (relative L2 error, per head), and per KV cache group the prompt block indices
    compared (those both requests hold)."""
    compared: dict[int, set[int]] = {}
    for group, (ids_got, ids_ref) in enumerate(zip(got.block_ids, ref.block_ids, strict=True)):
        compared[group] = {
            i
            for i, (a, b) in enumerate(zip(ids_got, ids_ref, strict=True))
            if a is not None and b is not None
        }
    mismatches: list[Mismatch] = []
    for name, group in got.groups.items():
        rows = sorted(compared[group])
        if not rows:
            continue
        errors = relative_errors(got.kv[name][rows], ref.kv[name][rows])
        for row, pair in zip(rows, errors.tolist(), strict=True):
            for half, error in zip(("key", "value"), pair, strict=True):
                if not error <= tolerance:  # NaN counts as a mismatch
                    mismatches.append(Mismatch(name, row, half, float(error)))
    return mismatches, compared
