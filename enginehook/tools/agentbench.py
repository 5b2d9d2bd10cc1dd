"""``cachettl bench agent``: real agent programs on a memory-contended engine, stock vLLM
against the hook in one run.

N mini-swe-agent programs (the example's configuration, SmolLM2-135M-Instruct, greedy)
arrive as a Poisson stream over ``arrival_window_s`` and work in their own git sandboxes
(:mod:`enginehook.tools.agentrun`); their commands run for real. Two OpenAI servers are up at
once on the same small KV pool (``--num-gpu-blocks-override``, so that programs compete
for memory): stock vLLM and the CacheTTL hook. Replays alternate between them so that
background load on a shared machine hits both alike.

Reported per scheduler: mean and P90 job completion time (a program's first request to
its last reply), P90 of new programs' first-turn latency (request → reply of the first
turn: its wait for admission plus its decode), the prefix-hit share (cached / prompt
tokens, as the server reports them), turns and format errors; and the hook's ratios.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginehook.tools.agentrun import (
    DEFAULT_CONFIG,
    TASKS,
    AgentRun,
    load_agent_config,
    make_sandbox,
    run_agent,
)
from enginehook.tools.bench import p90
from enginehook.tools.servers import free_port, start_vllm, stop_process, vllm_ready, wait_for

__all__ = ["AgentBenchConfig", "arrivals", "run_agent_bench", "summarize"]


@dataclass
class AgentBenchConfig:
    """Workload, engine and hook settings (defaults: the figures in README.md)."""

    programs: int = 6
    steps: int = 5
    arrival_window_s: float = 10.0
    blocks: int = 48
    max_num_seqs: int = 4
    policy: str = "cachettl"
    policy_params: dict[str, Any] = field(default_factory=lambda: {"ttl_cap_s": 30.0})
    min_samples: int = 3
    repeats: int = 1
    seed: int = 0
    agent_config: Path = DEFAULT_CONFIG
    model_dir: str = ""
    metrics_port: int = field(default_factory=free_port)


def arrivals(config: AgentBenchConfig) -> list[float]:
    """Program start offsets (s): a seeded Poisson stream, the first at 0.

    >>> arrivals(AgentBenchConfig(programs=3, seed=1))
    [0.0, 0.48..., 6.74...]
    """
    rng = random.Random(config.seed)
    rate = config.programs / config.arrival_window_s
    t, out = 0.0, [0.0]
    for _ in range(config.programs - 1):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def summarize(runs: list[AgentRun]) -> dict[str, float]:
    """Mean/P90 JCT, first-turn latency P90, hit share, turns and format errors of ``runs``."""
    jct = [r.jct_s for r in runs]
    first = [r.latencies_s[0] for r in runs if r.latencies_s]
    prompt = sum(r.prompt_tokens for r in runs)
    return {
        "mean_jct_s": statistics.fmean(jct),
        "p90_jct_s": p90(jct),
        "first_turn_p90_s": p90(first) if first else 0.0,
        "prefix_hit_share": sum(r.cached_tokens for r in runs) / max(1, prompt),
        "turns": float(sum(r.turns for r in runs)),
        "format_errors": float(sum(r.format_errors for r in runs)),
        "tool_calls": float(sum(len(r.commands) for r in runs)),
    }


def _replay(
    base_url: str, config: AgentBenchConfig, agent_config: dict[str, Any], tag: str
) -> list[AgentRun]:
    offsets = arrivals(config)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cachettl-agents-") as tmp:

        def one(i: int) -> AgentRun:
            sandbox = make_sandbox(Path(tmp) / f"repo-{i}")
            threading.Event().wait(max(0.0, started + offsets[i] - time.monotonic()))
            return run_agent(
                agent_config,
                base_url=base_url,
                session_id=f"{tag}-agent-{i}",
                workdir=sandbox,
                task=TASKS[i % len(TASKS)],
                step_limit=config.steps,
            )

        with ThreadPoolExecutor(config.programs) as pool:
            return list(pool.map(one, range(config.programs)))


def _post(port: int, path: str) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60):
        pass


def _hook(config: AgentBenchConfig, metrics_port: int) -> dict[str, Any]:
    return {
        "policy": config.policy,
        "policy_params": dict(config.policy_params),
        "min_samples": config.min_samples,
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    }


def hook_counters(port: int) -> dict[str, float]:
    """The hook's pin counters from its ``/metrics`` endpoint on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("cachettl_pins_taken", "cachettl_pinned_prefix_hits")) or (
            name.startswith("cachettl_pin_releases_total")
        ):
            counters[name] = float(value)
    return counters


def _serve(
    config: AgentBenchConfig, model: Path, work: Path, servers: dict[str, tuple[Any, int]]
) -> None:
    """Start both servers into ``servers`` (the caller stops them, also on failure)."""
    for name, hook in (("stock", None), ("cachettl", _hook(config, config.metrics_port))):
        port = free_port()
        proc = start_vllm(
            model,
            port,
            work / f"{name}.log",
            hook=hook,
            blocks=config.blocks,
            max_num_seqs=config.max_num_seqs,
            dev_mode=True,  # POST /reset_prefix_cache between replays
            max_model_len=min(4096, 32 * (config.blocks - 1)),  # one sequence must fit
        )
        servers[name] = (proc, port)
    for name, (proc, port) in servers.items():

        def ready(proc: Any = proc, port: int = port, log: Path = work / f"{name}.log") -> bool:
            return vllm_ready(proc, port, log)

        wait_for(ready, 900, f"the {name} server")


def run_agent_bench(config: AgentBenchConfig) -> dict[str, Any]:
    """Start both servers, warm them up, replay the programs on each; returns the report."""
    from enginehook.tools.realmodel import smollm2

    agent_config = load_agent_config(config.agent_config)
    model = Path(config.model_dir) if config.model_dir else smollm2()
    runs: dict[str, list[AgentRun]] = {"stock": [], "cachettl": []}
    with tempfile.TemporaryDirectory(prefix="cachettl-bench-agent-") as tmp:
        work = Path(tmp)
        servers: dict[str, tuple[Any, int]] = {}
        try:
            _serve(config, model, work, servers)
            for name, (_, port) in servers.items():  # warm-up, outside the measurement
                warm = AgentBenchConfig(programs=1, steps=1, agent_config=config.agent_config)
                _replay(f"http://127.0.0.1:{port}/v1", warm, agent_config, f"warm-{name}")
            for rep in range(config.repeats):
                order = ["stock", "cachettl"] if rep % 2 == 0 else ["cachettl", "stock"]
                for name in order:
                    port = servers[name][1]
                    _post(port, "/reset_prefix_cache")
                    url = f"http://127.0.0.1:{port}/v1"
                    runs[name] += _replay(url, config, agent_config, f"r{rep}-{name}")
            counters = hook_counters(config.metrics_port)
        finally:
            for proc, _ in servers.values():
                stop_process(proc)
    report = _report(config, runs)
    report["hook_counters"] = counters  # warm-up included
    return report


def _report(config: AgentBenchConfig, runs: dict[str, list[AgentRun]]) -> dict[str, Any]:
    stock, ours = summarize(runs["stock"]), summarize(runs["cachettl"])
    return {
        "stock": stock,
        "cachettl": ours,
        "mean_jct_ratio": ours["mean_jct_s"] / stock["mean_jct_s"],
        "p90_jct_ratio": ours["p90_jct_s"] / stock["p90_jct_s"],
        "first_turn_p90_ratio": ours["first_turn_p90_s"] / max(1e-9, stock["first_turn_p90_s"]),
        "commands": sorted({c for r in runs["cachettl"] for c in r.commands}),
        "config": {
            "programs": config.programs,
            "steps": config.steps,
            "arrival_window_s": config.arrival_window_s,
            "blocks": config.blocks,
            "block_size": 32,
            "max_num_seqs": config.max_num_seqs,
            "policy": config.policy,
            "policy_params": config.policy_params,
            "min_samples": config.min_samples,
            "repeats": config.repeats,
            "seed": config.seed,
        },
    }
