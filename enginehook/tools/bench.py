"""``cachettl bench vllm``: stock vLLM scheduler versus the hook on the CPU engine.

Replays a memory-contended multi-turn agent trace (tool gaps as real sleeps) against a
tiny random-weight Llama model on vLLM's CPU build, once with the stock scheduler and once
with the hook, in one run and on the same trace. Two regimes:

- ``saturated``: arrivals and tool gaps compressed (×0.1) so the engine, not the tools,
  dominates job time: the regime where a scheduler can matter;
- ``unsaturated``: tool gaps as drawn; the engine is a small share of job time.

Reports mean and P90 job completion time (JCT), their ratios, the P90 wait of new
programs' first turns, the prefix-hit share, and the hook's own cost per ``schedule()``
call with 1,000 pins held (a separate engine with a large pool).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginehook.core.rules import SchedulingRules
from enginehook.vllm.guards import hook_scheduler_cls

__all__ = ["BenchConfig", "BenchProgram", "make_trace", "run_bench"]

_VOCAB = (9, 2000)  # the tiny tokenizer's plain-word ids
_SHORT = ("ls -la", "cat setup.py", "git diff", "head -n 50 README.md")
_MID = ("grep -rn TODO src", "find . -name '*.py'")
_LONG = ("pytest -x", "pip install -e .")


@dataclass(frozen=True)
class BenchTurn:
    """One LLM call: tokens appended before it, tokens it generates, and the tool after it."""

    input_tokens: int
    output_tokens: int
    tool_args: str | None
    tool_s: float


@dataclass(frozen=True)
class BenchProgram:
    """An agent program: arrival offset (s) and its turns."""

    pid: str
    arrival_s: float
    turns: list[BenchTurn]


@dataclass
class BenchConfig:
    """Workload and engine settings (defaults: the figures in enginehook/README.md)."""

    programs: int = 24
    seed: int = 0
    arrival_window_s: float = 20.0
    blocks: int = 240
    block_size: int = 32
    max_num_seqs: int = 8
    policy: str = "cachettl"
    policy_params: dict[str, Any] = field(default_factory=lambda: {"ttl_cap_s": 30.0})
    min_samples: int = 20
    regimes: dict[str, float] = field(
        default_factory=lambda: {"saturated": 0.1, "unsaturated": 1.0}
    )
    overhead_pins: int = 1000
    repeats: int = 2
    order_window_s: float = SchedulingRules().order_window_s
    model_dir: str = ""


def _tool(rng: random.Random) -> tuple[str, float]:
    u = rng.random()
    if u < 0.70:
        return rng.choice(_SHORT), rng.uniform(0.05, 0.5)
    if u < 0.95:
        return rng.choice(_MID), rng.uniform(0.5, 3.0)
    return rng.choice(_LONG), rng.uniform(8.0, 15.0)


def make_trace(config: BenchConfig, compress: float) -> list[BenchProgram]:
    """The agent trace (same seed → same trace); arrivals and tool gaps × ``compress``."""
    rng = random.Random(config.seed)
    programs: list[BenchProgram] = []
    t = 0.0
    rate = config.programs / config.arrival_window_s
    for i in range(config.programs):
        t += rng.expovariate(rate)
        n = rng.randint(6, 10)
        turns: list[BenchTurn] = []
        for k in range(n):
            size = rng.randint(600, 900) if k == 0 else rng.randint(60, 200)
            out = rng.randint(24, 48)
            if k == n - 1:
                turns.append(BenchTurn(size, out, None, 0.0))
            else:
                args, seconds = _tool(rng)
                turns.append(BenchTurn(size, out, args, seconds * compress))
        programs.append(BenchProgram(f"prog-{i:03d}", t * compress, turns))
    return programs


@dataclass
class BenchResult:
    """Per-program figures of one replay."""

    jct_s: list[float] = field(default_factory=list)
    first_wait_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, float]:
        return {
            "mean_jct_s": statistics.fmean(self.jct_s),
            "p90_jct_s": p90(self.jct_s),
            "first_turn_wait_p90_s": p90(self.first_wait_s),
            "prefix_hit_share": self.cached_tokens / max(1, self.prompt_tokens),
            "wall_s": self.wall_s,
        }


def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile of ``values`` (one of them)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


async def _run_program(
    engine: Any, program: BenchProgram, rng: random.Random, result: BenchResult
) -> None:
    from vllm import SamplingParams

    await asyncio.sleep(program.arrival_s)
    loop = asyncio.get_running_loop()
    start = loop.time()
    context: list[int] = []
    for k, turn in enumerate(program.turns):
        context += [rng.randrange(*_VOCAB) for _ in range(turn.input_tokens)]
        last = k == len(program.turns) - 1
        hints: dict[str, Any] = (
            {"last_turn": 1} if last else {"tool": "bash", "tool_args": turn.tool_args}
        )
        params = SamplingParams(
            max_tokens=turn.output_tokens, temperature=0.0, ignore_eos=True, extra_args=hints
        )
        submitted = loop.time()
        first: float | None = None
        final: Any = None
        async for out in engine.generate(
            {"prompt_token_ids": list(context)},
            params,
            f"{program.pid}-{k}",
            session_id=program.pid,
        ):
            if first is None:
                first = loop.time()
            final = out
        if k == 0 and first is not None:
            result.first_wait_s.append(first - submitted)
        result.prompt_tokens += len(context)
        result.cached_tokens += max(0, final.num_cached_tokens or 0)
        context += list(final.outputs[0].token_ids)
        if not last:
            await asyncio.sleep(turn.tool_s)
    result.jct_s.append(loop.time() - start)


async def _replay(engine: Any, programs: list[BenchProgram], seed: int) -> BenchResult:
    result = BenchResult()
    started = time.perf_counter()
    await asyncio.gather(
        *(_run_program(engine, p, random.Random(f"{seed}-{p.pid}"), result) for p in programs)
    )
    result.wall_s = time.perf_counter() - started
    return result


def _engine_args(
    config: BenchConfig, model: Path, hook: dict[str, Any] | None, **kw: Any
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "block_size": config.block_size,
        "num_gpu_blocks_override": config.blocks,
        "enable_prefix_caching": True,
        "max_num_seqs": config.max_num_seqs,
        "seed": 0,
    }
    if hook is not None:
        args["scheduler_cls"] = hook_scheduler_cls()
        args["additional_config"] = {"cachettl": hook}
    args.update(kw)
    return args


async def _start(config: BenchConfig, model: Path, hook: dict[str, Any] | None) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_args(config, model, hook)))
    # Warm-up: compile and touch every code path once, outside the measurement.
    await _replay(engine, make_trace(BenchConfig(programs=2, seed=99), 0.01), 99)
    return engine


async def _run_pair(
    config: BenchConfig, model: Path, hook: dict[str, Any]
) -> dict[str, dict[str, BenchResult]]:
    """Both engines up at once; replays alternate stock/hook so that background load on a
    shared machine hits both alike."""
    stock = await _start(config, model, None)
    ours = await _start(config, model, hook)
    engines = {"stock": stock, "cachettl": ours}
    results: dict[str, dict[str, BenchResult]] = {name: {} for name in engines}
    try:
        for regime, compress in config.regimes.items():
            trace = make_trace(config, compress)
            for rep in range(config.repeats):
                order = ["stock", "cachettl"] if rep % 2 == 0 else ["cachettl", "stock"]
                for name in order:
                    await engines[name].reset_prefix_cache()
                    run = await _replay(engines[name], trace, config.seed)
                    merged = results[name].setdefault(regime, BenchResult())
                    merged.jct_s += run.jct_s
                    merged.first_wait_s += run.first_wait_s
                    merged.prompt_tokens += run.prompt_tokens
                    merged.cached_tokens += run.cached_tokens
                    merged.wall_s += run.wall_s / config.repeats
    finally:
        stock.shutdown()
        ours.shutdown()
    return results


def hook_overhead(config: BenchConfig, model: Path) -> dict[str, float]:
    """The hook's own µs per ``schedule()`` call while ``overhead_pins`` pins are held."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    pins = config.overhead_pins
    hook: dict[str, Any] = {
        "policy": "fixed",
        "policy_params": {"ttl_s": 600.0, "skip_slow_tools": False},
    }
    llm = LLM(**_engine_args(config, model, hook, num_gpu_blocks_override=pins * 3, max_num_seqs=8))
    engine = llm.llm_engine
    core: Any = engine.engine_core  # in-process client: the EngineCore is right here
    scheduler = core.engine_core.scheduler
    rng = random.Random(config.seed)
    try:
        prompts = {f"pin-{i}": [rng.randrange(*_VOCAB) for _ in range(40)] for i in range(pins)}
        params = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, extra_args={"tool": "bash"}
        )
        for pid, ids in prompts.items():
            engine.add_request(pid, {"prompt_token_ids": ids}, params, session_id=pid)
        while engine.has_unfinished_requests():
            engine.step()
        held = len(scheduler.pins)
        before = scheduler.metrics.snapshot()
        traffic = SamplingParams(
            max_tokens=32, temperature=0.0, ignore_eos=True, extra_args={"tool": "bash"}
        )
        for i in range(64):  # traffic while the pins are held: hundreds of schedule() calls
            ids = [rng.randrange(*_VOCAB) for _ in range(200)]
            engine.add_request(
                f"new-{i}", {"prompt_token_ids": ids}, traffic, session_id=f"new-{i}"
            )
        while engine.has_unfinished_requests():
            engine.step()
        after = scheduler.metrics.snapshot()
        calls = after["schedule_calls"] - before["schedule_calls"]
        seconds = after["hook_us_per_schedule"] * after["schedule_calls"] - (
            before["hook_us_per_schedule"] * before["schedule_calls"]
        )
        vllm_seconds = after["vllm_schedule_s"] - before["vllm_schedule_s"]
        return {
            "pins_held": float(held),
            "vllm_us_per_schedule": 1e6 * vllm_seconds / max(1, calls),
            "schedule_calls": float(calls),
            "hook_us_per_schedule": seconds / max(1, calls),
        }
    finally:
        engine.engine_core.shutdown()
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


def hook_settings(config: BenchConfig) -> dict[str, Any]:
    """The hook's ``additional_config.cachettl`` in the bench (everything else: defaults).

    >>> sorted(hook_settings(BenchConfig()))
    ['min_samples', 'order_window_s', 'policy', 'policy_params']
    """
    return {
        "policy": config.policy,
        "policy_params": dict(config.policy_params),
        "min_samples": config.min_samples,
        "order_window_s": config.order_window_s,
    }


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run everything; returns the report (``stock``/``cachettl`` use the saturated regime)."""
    from enginehook.tools.tinymodel import build_tiny_llama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # keep stdout for the report
    model_dir = config.model_dir or str(Path.home() / ".cache" / "cachettl" / "tiny-llama")
    model = build_tiny_llama(model_dir)
    both = asyncio.run(_run_pair(config, model, hook_settings(config)))
    stock, ours = both["stock"], both["cachettl"]
    regimes: dict[str, Any] = {}
    for regime in config.regimes:
        s, c = stock[regime].summary(), ours[regime].summary()
        regimes[regime] = {
            "stock": s,
            "cachettl": c,
            "mean_jct_ratio": c["mean_jct_s"] / s["mean_jct_s"],
            "p90_jct_ratio": c["p90_jct_s"] / s["p90_jct_s"],
            "first_turn_wait_p90_ratio": c["first_turn_wait_p90_s"]
            / max(1e-9, s["first_turn_wait_p90_s"]),
        }
    head = regimes[next(iter(config.regimes))]
    report: dict[str, Any] = {
        "stock": {k: head["stock"][k] for k in ("mean_jct_s", "p90_jct_s")},
        "cachettl": {k: head["cachettl"][k] for k in ("mean_jct_s", "p90_jct_s")},
        "mean_jct_ratio": head["mean_jct_ratio"],
        "regimes": regimes,
        "config": {
            "programs": config.programs,
            "blocks": config.blocks,
            "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs,
            "policy": config.policy,
            "policy_params": config.policy_params,
            "min_samples": config.min_samples,
            "order_window_s": config.order_window_s,
            "repeats": config.repeats,
            "cpu_count": os.cpu_count(),
        },
    }
    if config.overhead_pins:
        report["overhead"] = hook_overhead(config, model)
    return report
