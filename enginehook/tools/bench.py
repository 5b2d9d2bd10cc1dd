"""``cachettl bench vllm``: stock vLLM scheduler versus the hook on the CPU engine.

Replays a memory-contended multi-turn agent trace (tool gaps as real sleeps) against a
tiny random-weight Llama model on vLLM's CPU build, once with the stock scheduler and once
with the hook, in one run and on the same trace. Two regimes:

- ``saturated``: arrivals and tool gaps compressed (×0.1) so the engine, not the tools,
  dominates job time: the regime where a scheduler can matter;
- ``unsaturated``: tool gaps as drawn; the engine is a small share of job time.

A third engine, ``unbounded``, is stock vLLM with a KV pool large enough that nothing is
evicted during a replay (:func:`unbounded_blocks`, computed from the trace): the bound any
retention can reach. Its replays alternate with the two others'; the report checks it is the
bound (its returning turns' prefix hits, :attr:`BenchResult.returning_hit_share`, are all the
prefix the previous turn left in full blocks) and gives the hook's distance to it
(:func:`distance`).

Reports mean and P90 job completion time (JCT), their ratios, the P90 wait of new
programs' first turns, the prefix-hit share, and the hook's own cost per ``schedule()``
call with 1,000 pins held (a separate engine with a large pool).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginehook.core.rules import SchedulingRules
from enginehook.vllm.guards import hook_scheduler_cls

__all__ = [
    "BenchConfig",
    "BenchProgram",
    "distance",
    "make_trace",
    "markdown",
    "run_bench",
    "unbounded_blocks",
]

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
    #: A third engine: stock vLLM whose pool never evicts (:func:`unbounded_blocks`).
    unbounded: bool = True


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


def context_blocks(program: BenchProgram, block_size: int) -> int:
    """KV blocks a replay of ``program`` allocates at most when every returning turn finds
    its whole prefix: its full context (every turn's input and output) in blocks, and one
    more per turn for the partial last block, which vLLM does not cache and recomputes.

    >>> turns = [BenchTurn(40, 8, "ls", 0.1), BenchTurn(10, 8, None, 0.0)]
    >>> context_blocks(BenchProgram("p", 0.0, turns), 32)  # 66 tokens: 3 blocks, + 2 turns
    5
    """
    tokens = sum(t.input_tokens + t.output_tokens for t in program.turns)
    return math.ceil(tokens / block_size) + len(program.turns)


def unbounded_blocks(
    programs: list[BenchProgram], block_size: int, headroom: float = 0.1, spare: int = 64
) -> int:
    """A KV pool (blocks) in which a replay of ``programs`` evicts nothing: every program's
    :func:`context_blocks` summed (as if all ran at once), ``headroom`` more, and ``spare``
    blocks on top. vLLM allocates from the head of its free queue and returns freed blocks
    to its tail; after ``reset_prefix_cache`` no free block holds a prefix, so a replay that
    allocates fewer blocks than the pool holds never reaches a freed block that does.

    >>> turns = [BenchTurn(40, 8, "ls", 0.1), BenchTurn(10, 8, None, 0.0)]
    >>> unbounded_blocks([BenchProgram("p", 0.0, turns)] * 10, 32)  # 50 + 5 + 64
    119
    """
    needed = sum(context_blocks(p, block_size) for p in programs)
    return needed + math.ceil(headroom * needed) + spare


@dataclass
class BenchResult:
    """Per-program figures of one replay. ``returning_reachable``: the prefix tokens the
    returning turns (every turn after a program's first) could find cached, i.e. the previous
    turn's context in full blocks; ``returning_cached``: the tokens they found."""

    jct_s: list[float] = field(default_factory=list)
    first_wait_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    returning_reachable: int = 0
    returning_cached: int = 0
    #: Replays before which vLLM refused ``reset_prefix_cache`` (blocks still held).
    resets_refused: int = 0

    @property
    def returning_hit_share(self) -> float:
        """The share of their reachable prefix that returning turns found cached (1.0: none
        of a program's prefix was evicted between its turns)."""
        return self.returning_cached / max(1, self.returning_reachable)

    def add(self, run: BenchResult, runs: int = 1) -> None:
        """Merge ``run`` (one of ``runs`` replays) into these figures."""
        self.jct_s += run.jct_s
        self.first_wait_s += run.first_wait_s
        self.prompt_tokens += run.prompt_tokens
        self.cached_tokens += run.cached_tokens
        self.returning_reachable += run.returning_reachable
        self.returning_cached += run.returning_cached
        self.wall_s += run.wall_s / runs

    def summary(self) -> dict[str, float]:
        return {
            "mean_jct_s": statistics.fmean(self.jct_s),
            "p90_jct_s": p90(self.jct_s),
            "first_turn_wait_p90_s": p90(self.first_wait_s),
            "prefix_hit_share": self.cached_tokens / max(1, self.prompt_tokens),
            "returning_hit_share": self.returning_hit_share,
            "resets_refused": self.resets_refused,
            "wall_s": self.wall_s,
        }


def reachable_prefix(previous_tokens: int, block_size: int) -> int:
    """Prefix tokens a returning turn can find cached when the previous turn left
    ``previous_tokens`` in its context (prompt and output): its full blocks, of the tokens
    whose KV was computed (all but the last generated token).

    >>> reachable_prefix(66, 32), reachable_prefix(65, 32), reachable_prefix(64, 32)
    (64, 64, 32)
    """
    return block_size * ((previous_tokens - 1) // block_size)


def distance(
    stock: dict[str, float], hook: dict[str, float], bound: dict[str, float]
) -> dict[str, Any]:
    """The hook's distance to the never-evicting bound, per figure (mean JCT, first-turn wait
    P90): ``hook / bound`` and the share of the stock-to-bound gap the hook closes,
    ``(stock - hook) / (stock - bound)`` (``None`` when stock is already at the bound).

    >>> d = distance({"mean_jct_s": 10.0, "first_turn_wait_p90_s": 2.0},
    ...              {"mean_jct_s": 7.0, "first_turn_wait_p90_s": 1.0},
    ...              {"mean_jct_s": 6.0, "first_turn_wait_p90_s": 2.0})
    >>> round(d["mean_jct_over_bound"], 3), d["mean_jct_gap_closed"]
    (1.167, 0.75)
    >>> d["first_turn_wait_p90_gap_closed"] is None
    True
    """
    out: dict[str, Any] = {}
    for name, key in (("mean_jct", "mean_jct_s"), ("first_turn_wait_p90", "first_turn_wait_p90_s")):
        s, h, b = stock[key], hook[key], bound[key]
        out[f"{name}_over_bound"] = h / b if b > 0 else None
        gap = s - b
        out[f"{name}_gap_closed"] = (s - h) / gap if abs(gap) > 1e-9 * max(1.0, abs(s)) else None
    return out


def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile of ``values`` (one of them)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


async def _run_program(
    engine: Any,
    program: BenchProgram,
    rng: random.Random,
    result: BenchResult,
    block_size: int = 32,
) -> None:
    from vllm import SamplingParams

    await asyncio.sleep(program.arrival_s)
    loop = asyncio.get_running_loop()
    start = loop.time()
    context: list[int] = []
    previous = 0  # the previous turn's context length, its output included
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
        cached = max(0, final.num_cached_tokens or 0)
        result.prompt_tokens += len(context)
        result.cached_tokens += cached
        if k > 0:
            result.returning_reachable += reachable_prefix(previous, block_size)
            result.returning_cached += cached
        context += list(final.outputs[0].token_ids)
        previous = len(context)
        if not last:
            await asyncio.sleep(turn.tool_s)
    result.jct_s.append(loop.time() - start)


async def _replay(
    engine: Any, programs: list[BenchProgram], seed: int, block_size: int = 32
) -> BenchResult:
    result = BenchResult()
    started = time.perf_counter()
    await asyncio.gather(
        *(
            _run_program(engine, p, random.Random(f"{seed}-{p.pid}"), result, block_size)
            for p in programs
        )
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


async def _start(
    config: BenchConfig, model: Path, hook: dict[str, Any] | None, blocks: int | None = None
) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = {"num_gpu_blocks_override": blocks} if blocks is not None else {}
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_args(config, model, hook, **kw)))
    # Warm-up: compile and touch every code path once, outside the measurement.
    await _replay(engine, make_trace(BenchConfig(programs=2, seed=99), 0.01), 99)
    return engine


def replay_order(names: list[str], rep: int) -> list[str]:
    """The engines' order in replay ``rep``: as given on even replays, reversed on odd ones,
    so that background load on a shared machine hits each alike.

    >>> replay_order(["stock", "cachettl", "unbounded"], 1)
    ['unbounded', 'cachettl', 'stock']
    """
    return list(names) if rep % 2 == 0 else list(reversed(names))


async def _run_engines(
    config: BenchConfig, model: Path, hook: dict[str, Any]
) -> dict[str, dict[str, BenchResult]]:
    """All engines up at once (stock, hook and, with ``config.unbounded``, stock with a
    never-evicting pool); replays alternate between them."""
    engines = {"stock": await _start(config, model, None)}
    try:
        engines["cachettl"] = await _start(config, model, hook)
        if config.unbounded:
            blocks = unbounded_blocks(make_trace(config, 1.0), config.block_size)
            engines["unbounded"] = await _start(config, model, None, blocks)
        results: dict[str, dict[str, BenchResult]] = {name: {} for name in engines}
        for regime, compress in config.regimes.items():
            trace = make_trace(config, compress)
            for rep in range(config.repeats):
                for name in replay_order(list(engines), rep):
                    reset = await engines[name].reset_prefix_cache()
                    run = await _replay(engines[name], trace, config.seed, config.block_size)
                    merged = results[name].setdefault(regime, BenchResult())
                    merged.add(run, config.repeats)
                    merged.resets_refused += 0 if reset else 1
                    figures = {k: round(v, 3) for k, v in run.summary().items()}
                    print(f"{regime} {name} replay {rep}: {figures}", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
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
    """Run everything; returns the report (``stock``/``cachettl``/``unbounded`` use the
    saturated regime)."""
    from enginehook.tools.tinymodel import build_tiny_llama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # keep stdout for the report
    model_dir = config.model_dir or str(Path.home() / ".cache" / "cachettl" / "tiny-llama")
    model = build_tiny_llama(model_dir)
    results = asyncio.run(_run_engines(config, model, hook_settings(config)))
    report = compare(config, {name: dict(by_regime) for name, by_regime in results.items()})
    if config.overhead_pins:
        report["overhead"] = hook_overhead(config, model)
    return report


def compare(config: BenchConfig, results: dict[str, dict[str, BenchResult]]) -> dict[str, Any]:
    """The report of the engines' figures by regime: ``stock`` and ``cachettl`` (and
    ``unbounded`` when it ran), the hook/stock ratios and the hook's :func:`distance` to the
    unbounded pool."""
    stock, ours = results["stock"], results["cachettl"]
    bound = results.get("unbounded")
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
        if bound is not None:
            u = bound[regime].summary()
            regimes[regime]["unbounded"] = u
            regimes[regime]["distance"] = distance(s, c, u)
    head = regimes[next(iter(config.regimes))]
    headline = ("mean_jct_s", "p90_jct_s", "first_turn_wait_p90_s")
    report: dict[str, Any] = {
        "stock": {k: head["stock"][k] for k in headline},
        "cachettl": {k: head["cachettl"][k] for k in headline},
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
    if bound is not None:
        report["unbounded"] = {k: head["unbounded"][k] for k in headline}
        report["distance"] = head["distance"]
        report["config"]["unbounded_blocks"] = unbounded_blocks(
            make_trace(config, 1.0), config.block_size
        )
    return report


def markdown(report: dict[str, Any], command: str = "cachettl bench vllm") -> str:
    """The report as Markdown: one row per regime and engine, the hook/stock ratios and the
    hook's distance to the never-evicting pool."""
    cfg = report["config"]
    lines = [
        f"Command: `{command}`; vLLM CPU engine, tiny Llama; {cfg['programs']} programs, "
        f"{cfg['blocks']} blocks of {cfg['block_size']} (unbounded: "
        f"{cfg.get('unbounded_blocks', '-')}), max {cfg['max_num_seqs']} seqs; hook policy "
        f"`{cfg['policy']}` `{json.dumps(cfg['policy_params'])}`, order window "
        f"{cfg['order_window_s']} s; {cfg['repeats']} alternating replays per regime and "
        f"engine; {cfg['cpu_count']} CPUs.",
        "",
        "| regime | engine | mean JCT (s) | P90 JCT (s) | first-turn wait P90 (s) | prefix hits "
        "| returning turns' prefix found |",
        "|---|---|---|---|---|---|---|",
    ]
    for regime, r in report["regimes"].items():
        for name in ("stock", "cachettl", "unbounded"):
            if name in r:
                s = r[name]
                lines.append(
                    f"| {regime} | {name} | {s['mean_jct_s']:.2f} | {s['p90_jct_s']:.2f} | "
                    f"{s['first_turn_wait_p90_s']:.3f} | {s['prefix_hit_share']:.1%} | "
                    f"{s.get('returning_hit_share', float('nan')):.1%} |"
                )
    lines += [
        "",
        "| regime | mean JCT hook/stock | P90 JCT hook/stock | first-turn wait P90 hook/stock "
        "| mean JCT hook/unbounded | gap closed (mean JCT) | first-turn wait P90 "
        "hook/unbounded | gap closed (wait P90) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for regime, r in report["regimes"].items():
        d = r.get("distance", {})
        lines.append(
            f"| {regime} | {r['mean_jct_ratio']:.2f} | {r['p90_jct_ratio']:.2f} | "
            f"{r['first_turn_wait_p90_ratio']:.2f} | {_fmt(d.get('mean_jct_over_bound'))} | "
            f"{_fmt(d.get('mean_jct_gap_closed'), '.0%')} | "
            f"{_fmt(d.get('first_turn_wait_p90_over_bound'))} | "
            f"{_fmt(d.get('first_turn_wait_p90_gap_closed'), '.0%')} |"
        )
    if "distance" in report:
        lines += [
            "",
            "`unbounded`: stock vLLM with a KV pool no replay fills (every program's full context "
            "in blocks, summed, +10 % and 64 blocks), the bound any retention can reach; "
            '"returning turns\' prefix found" is the share of the prefix the previous turn left '
            "in full blocks that returning turns found cached (100 %: nothing was evicted). Gap "
            "closed: (stock - hook) / (stock - unbounded).",
        ]
    if "overhead" in report:
        o = report["overhead"]
        lines += [
            "",
            f"Hook cost per `schedule()`: {o['hook_us_per_schedule']:.1f} µs with "
            f"{o['pins_held']:.0f} pins held ({o['schedule_calls']:.0f} calls; vLLM's own "
            f"`schedule()`: {o['vllm_us_per_schedule']:.1f} µs).",
        ]
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def write(report: dict[str, Any], out: str, command: str) -> list[Path]:
    """``OUT.json`` and ``OUT.md``; the paths written."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = [path.with_name(path.name + ".json"), path.with_name(path.name + ".md")]
    written[0].write_text(json.dumps({"command": command, **report}, indent=2) + "\n")
    written[1].write_text(markdown(report, command))
    return written
