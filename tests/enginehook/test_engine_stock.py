"""The same traffic through vLLM's stock scheduler: no pinned prefix, plain FCFS order.

The counterpart of test_engine_hook.py (same tiny model, pool and requests), so the
difference is the hook's doing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.enginehook.driver import Driver, make_llm, shutdown

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver(tiny_model: Path) -> Iterator[Driver]:
    from transformers import AutoTokenizer

    llm = make_llm(tiny_model, None, max_num_seqs=1)
    yield Driver(llm, AutoTokenizer.from_pretrained(str(tiny_model)))
    shutdown(llm)


def test_stock_scheduler_loses_the_prefix_under_churn(driver):
    a1 = driver.words(600)
    out1 = driver.run("A-1", a1, 32, session="A", xargs={"tool": "bash"})
    for i in range(6):
        driver.add(f"filler-{i}", driver.words(700), 8)
    driver.drain()
    a2 = a1 + list(out1.outputs[0].token_ids) + driver.words(100)
    out2 = driver.run("A-2", a2, 16, session="A", xargs={"last_turn": 1})
    assert out2.num_cached_tokens == 0


def test_stock_waiting_order_is_request_fcfs(driver):
    driver.run("Old-1", driver.words(50), 2, session="Old")
    driver.run("Y-1", driver.words(50), 2, session="Y", xargs={"tool": "bash"})
    driver.finished_order.clear()
    driver.add("X", driver.words(50), 2, session="X")
    driver.add("W", driver.words(50), 2)
    driver.add("Y-2", driver.words(50), 2, session="Y")
    driver.add("Old-2", driver.words(50), 2, session="Old")
    driver.drain()
    assert driver.finished_order == ["X", "W", "Y-2", "Old-2"]
