"""A defect of the hook's own code costs at most one request's hints, never the engine: each
of the controller's entry points made to raise in a real CPU engine (in-process, the hook
configured as users run it), the request still completes, the fault is counted by hook point,
and the engine serves and pins normally once the defect is gone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver(tiny_model: Any, inproc: None) -> Iterator[Any]:
    from transformers import AutoTokenizer

    from tests.enginehook.driver import Driver, make_llm, shutdown

    hook = {"policy": "fixed", "policy_params": {"ttl_s": 60.0, "skip_slow_tools": False}}
    llm = make_llm(tiny_model, hook)
    yield Driver(llm, AutoTokenizer.from_pretrained(str(tiny_model)))
    shutdown(llm)


def _defect(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a defect in the hook's own code")


@pytest.mark.parametrize(
    ("method", "hook"),
    [
        ("arrived", "add_request"),
        ("expire", "schedule"),
        ("admitted", "schedule"),
        ("finished", "free_blocks"),
    ],
)
def test_a_raising_entry_point_costs_one_requests_hints_not_the_engine(
    driver: Any, monkeypatch: pytest.MonkeyPatch, method: str, hook: str
) -> None:
    scheduler = driver.scheduler
    before = scheduler.metrics.snapshot()["faults"].get(hook, 0)
    session = f"faulty-{method}"
    with monkeypatch.context() as patch:
        patch.setattr(scheduler.controller, method, _defect)
        out = driver.run(
            f"{session}-0", driver.words(200), 8, session=session, xargs={"tool": "ls"}
        )
    assert len(out.outputs[0].token_ids) == 8  # the request completed
    assert scheduler.metrics.snapshot()["faults"].get(hook, 0) > before
    # The defect gone, the engine serves and pins as usual.
    healthy = f"healthy-{method}"
    driver.run(f"{healthy}-0", driver.words(200), 8, session=healthy, xargs={"tool": "ls"})
    assert healthy in scheduler.pins
    scheduler.controller.end_program(healthy, scheduler.clock())
