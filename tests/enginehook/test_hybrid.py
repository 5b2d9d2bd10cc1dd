"""A hybrid-attention model pinned and hit on the real CPU engine: a tiny random-weight
Gemma-3-style model (five sliding-window layers per full-attention layer, window 128
tokens) built on the spot. A pin holds every KV cache group's hashed blocks (the full
prefix of the full-attention group, the in-window blocks of the sliding-window groups); the
next turn's prefix hit through vLLM's hybrid manager finds all of them after other traffic
churned the pool, the pinned blocks come through bit for bit, and the next turn's prompt KV
in every layer is a full recompute's (``kvcheck.py``: greedy outputs would compare bfloat16
rounding too).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.enginehook.driver import BLOCK, Driver, FakeClock, make_llm, shutdown
from tests.enginehook.kvcheck import block_contents, kv_mismatches, run_capturing_prompt_kv

pytestmark = pytest.mark.slow

HOOK = {
    "policy": "fixed",
    "policy_params": {"ttl_s": 30.0, "skip_slow_tools": False},
    "pressure": "running",
}
WINDOW = 128


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from enginehook.tools.tinymodel import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def driver(gemma3: Path, inproc: None) -> Iterator[Driver]:
    from transformers import AutoTokenizer

    llm = make_llm(gemma3, HOOK, max_model_len=1024, num_gpu_blocks_override=224)
    drv = Driver(llm, AutoTokenizer.from_pretrained(str(gemma3)))
    drv.scheduler.clock = FakeClock()
    yield drv
    shutdown(llm)


def test_the_layout_is_hybrid_and_the_hook_is_active(driver):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kinds = {type(g.kv_cache_spec) for g in driver.scheduler.kv_cache_config.kv_cache_groups}
    assert kinds == {FullAttentionSpec, SlidingWindowSpec}
    assert driver.scheduler.active


def _churn(driver: Driver, n: int = 8, words: int = 700) -> None:
    for i in range(n):
        driver.add(f"filler-{driver.rng.random()}-{i}", driver.words(words), 8)
    driver.drain()


def test_a_pinned_hybrid_prefix_is_hit_after_churn_and_its_kv_equals_recompute(driver):
    import torch

    sched = driver.scheduler
    a1, b1 = driver.words(600), driver.words(600)
    out_a = driver.run("A-1", a1, 32, session="A", xargs={"tool": "bash"})
    out_b = driver.run("B-1", b1, 32, session="B", xargs={"tool": "bash", "pin": 0})
    pin = sched.pins.get("A")
    assert pin is not None
    assert "B" not in sched.pins
    groups = sched.kv_cache_config.kv_cache_groups
    n_swa = sum(1 for g in groups if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec")
    # vLLM hashes a sliding-window group's blocks one block short of the full-attention
    # group's here, so the next turn can hit 18 of the 19 full blocks: the pin covers
    # those, and per sliding-window group the window's 4 blocks before them (one of them
    # freed by vLLM during decoding and taken back from the prefix cache).
    covered = pin.handle.tokens
    assert covered in ((600 + 32) // BLOCK * BLOCK, ((600 + 32) // BLOCK - 1) * BLOCK)
    window_blocks = covered // BLOCK - (covered - WINDOW + 1) // BLOCK
    assert pin.blocks == covered // BLOCK + n_swa * window_blocks
    pinned_ids = [block.block_id for block in pin.handle]
    held = block_contents(driver, pinned_ids)
    _churn(driver)
    assert "A" in sched.pins, sched.metrics.snapshot()["releases"]
    a2 = a1 + list(out_a.outputs[0].token_ids) + driver.words(100)
    b2 = b1 + list(out_b.outputs[0].token_ids) + driver.words(100)
    # The pinned blocks, bit for bit what turn 1 left in them (before the hit writes more).
    after = block_contents(driver, pinned_ids)
    assert [n for n in held if not torch.equal(held[n], after[n])] == []
    got_a, kv_a = run_capturing_prompt_kv(
        driver, "A-2", a2, 16, session="A", xargs={"last_turn": 1}
    )
    got_b = driver.run("B-2", b2, 16, session="B", xargs={"last_turn": 1})
    assert got_b.num_cached_tokens == 0  # the churn evicted the unpinned program
    assert got_a.num_cached_tokens == covered  # every group's pinned blocks were hit
    ref, kv_ref = run_capturing_prompt_kv(driver, "A-2-ref", a2, 16, salt="full-recompute")
    assert ref.num_cached_tokens == 0
    mismatches, compared = kv_mismatches(kv_a, kv_ref)
    full = [
        g
        for g, spec in enumerate(groups)
        if type(spec.kv_cache_spec).__name__ == "FullAttentionSpec"
    ]
    for g, ids in enumerate(kv_a.block_ids):
        # every block turn 2 holds is compared: the full-attention groups' whole prompt,
        # the window groups' blocks in the window (the pinned ones among them)
        assert compared[g] == {i for i, b in enumerate(ids) if b is not None}
        if g in full:
            assert compared[g] == set(range(len(a2) // BLOCK))
        else:
            assert set(ids[: covered // BLOCK]) - {None} <= set(pinned_ids)
    assert mismatches == []
    assert "A" not in sched.pins
