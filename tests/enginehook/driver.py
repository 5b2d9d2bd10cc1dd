"""Drive a vLLM engine from tests: an injected clock, step-by-step request runs, start-up
and shutdown of the engine."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginehook.vllm.guards import hook_scheduler_cls

BLOCK = 32

#: The dtype the engine tests run their engines in (:func:`make_llm` and the OpenAI servers
#: of ``processes.py``): the tiny models' own, bfloat16, unless ``CACHETTL_TEST_DTYPE`` names
#: another (``float32``: to show that no test depends on bfloat16's rounding).
DTYPE = os.environ.get("CACHETTL_TEST_DTYPE", "bfloat16")


class FakeClock:
    """An injected clock for the scheduler (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Driver:
    """Runs requests through an in-process engine one ``step()`` at a time."""

    llm: Any
    tokenizer: Any
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    finished_order: list[str] = field(default_factory=list)
    steps: int = 0

    @property
    def engine(self) -> Any:
        return self.llm.llm_engine

    @property
    def scheduler(self) -> Any:
        return self.engine.engine_core.engine_core.scheduler

    def words(self, n: int) -> list[int]:
        from enginehook.tools.tinymodel import random_words

        ids: list[int] = self.tokenizer(random_words(self.rng, n))["input_ids"]
        return ids

    def add(
        self,
        rid: str,
        ids: list[int],
        max_tokens: int,
        session: str | None = None,
        xargs: dict[str, Any] | None = None,
        salt: str | None = None,
    ) -> None:
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=xargs
        )
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if salt:
            prompt["cache_salt"] = salt
        self.engine.add_request(rid, prompt, params, session_id=session)

    def drain(self, max_steps: int = 2000) -> dict[str, Any]:
        results: dict[str, Any] = {}
        while self.engine.has_unfinished_requests():
            self.steps += 1
            assert self.steps < max_steps, "engine did not finish its requests"
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    self.finished_order.append(out.request_id)
        return results

    def run(self, rid: str, ids: list[int], max_tokens: int, **kw: Any) -> Any:
        self.add(rid, ids, max_tokens, **kw)
        return self.drain()[rid]


def make_llm(model: Path, hook_config: dict[str, Any] | None, **kw: Any) -> Any:
    from vllm import LLM

    args: dict[str, Any] = {
        "model": str(model),
        "dtype": DTYPE,
        "max_model_len": 2048,
        "block_size": BLOCK,
        "num_gpu_blocks_override": 96,
        "enable_prefix_caching": True,
        "max_num_seqs": 4,
        "seed": 0,
    }
    if hook_config is not None:
        args["scheduler_cls"] = hook_scheduler_cls()
        args["additional_config"] = {"cachettl": hook_config}
    args.update(kw)
    return LLM(**args)


#: The hook of the in-process engine tests: a fixed 30 s TTL on every tool, half the pool
#: as the pin budget, pins released only for running requests.
HOOK: dict[str, Any] = {
    "policy": "fixed",
    "policy_params": {"ttl_s": 30.0, "skip_slow_tools": False},
    "budget_share": 0.5,
    "pressure": "running",
    "ttl_cap_s": 600.0,
}


def logged_driver(model: Path, log: Path) -> Iterator[Driver]:
    """A module's engine with :data:`HOOK` and an event log at ``log``
    (``driver.log_path``); shut down after the module."""
    from transformers import AutoTokenizer

    llm = make_llm(model, {**HOOK, "event_log": str(log)})
    drv = Driver(llm, AutoTokenizer.from_pretrained(str(model)))
    drv.log_path = log  # type: ignore[attr-defined]
    yield drv
    shutdown(llm)


def logged_events(driver: Driver) -> list[dict[str, Any]]:
    """The events in :func:`logged_driver`'s log, once its writer has written every event
    submitted so far."""
    import json

    from enginehook.link.sinks import JsonlSink

    sink = driver.scheduler.services.sink
    assert isinstance(sink, JsonlSink)
    assert sink.flush(10.0), "the event log's writer is stalled"
    path: Path = driver.log_path  # type: ignore[attr-defined]
    return [json.loads(line) for line in path.read_text().splitlines()]


def fresh_clock(driver: Driver) -> Iterator[FakeClock]:
    """A fresh injected clock and an empty prefix cache for each test."""
    fake = FakeClock()
    driver.scheduler.clock = fake
    yield fake
    assert driver.scheduler.reset_prefix_cache()
    assert len(driver.scheduler.pins) == 0


def shutdown(llm: Any) -> None:
    """Stop an engine and free what it holds."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()
