"""``cachettl bench cluster --real``: stock engines against hook engines behind the same
vllm-router, in one run, on this machine's CPU.

The engine bench's agent trace (:func:`enginehook.tools.bench.make_trace`, the saturated
regime: arrivals and tool gaps × 0.1) is replayed through vllm-router by real clients (the
``openai`` package, one thread per program, ``X-Session-ID`` on every turn, streamed so the
first token's wait is seen) against two stock engines and against two engines with the hook
and one control plane, all up at once, each pair behind its own router of the policy under
test; the two arms' replays alternate (``runs`` each, the arm's prefix caches reset first) so
that background load on a shared machine hits both alike. Reports per policy and run: mean
and P90 JCT, new programs' first-turn wait P90, the prefix-hit share, and the hook/stock
ratios with their median over runs.

With ``unbounded`` a third arm runs beside them: two stock engines whose KV pools never evict
(each :func:`enginehook.tools.bench.unbounded_blocks` of the whole trace, since a router may
send every program to one engine) behind a router of the same policy, the bound any retention
can reach; the report adds its figures, the share of their reachable prefix returning turns
found cached on each arm (on the unbounded arm, what the router's placement alone leaves
out), and the hook's distance to it (:func:`enginehook.tools.bench.distance`). Off by
default: two more engines on a two-CPU machine, and a third replay per run.

The policy :data:`PROGRAM_SCHEDULING` is vllm-router's program scheduling
(``--enable-program-scheduling``, its ``docs/program_scheduling.md``): both arms' routers run
it with :func:`program_scheduling_config` (the documented deployment settings, the engine's KV
pool as each target's token capacity), and every turn names its program the canonical way,
``vllm_xargs.agentic_context`` (``program_id``, ``step_id``; ``expected_resume`` false on the
last turn). :data:`PROGRAM_SCHEDULING_BY_COUNT` is the same with no token capacity (the
router's program-count guard alone). vLLM itself refuses that object (``vllm_xargs`` values
are strings or numbers); both arms' engines run the session middleware, which takes it out
before vLLM reads the body.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from enginehook.tools.bench import (
    BenchConfig,
    BenchProgram,
    BenchResult,
    distance,
    make_trace,
    replay_order,
    unbounded_blocks,
)
from enginehook.tools.cluster import ClusterEngine, Router
from enginehook.tools.servers import ControlPlaneProcess, free_port, wait_for

__all__ = [
    "CLUSTER_SETTINGS",
    "PROGRAM_SCHEDULING",
    "PROGRAM_SCHEDULING_BY_COUNT",
    "RealClusterConfig",
    "program_scheduling_config",
    "router_for",
    "run_real_cluster",
]

_VOCAB = (9, 2000)  # the tiny tokenizer's plain-word ids, as the engine bench draws them

#: Hook settings engines behind a router need on top of the engine bench's: none, the engine's
#: defaults already put new programs' first turns ahead of pinned returning turns.
CLUSTER_SETTINGS: dict[str, Any] = {}

#: The policy name of vllm-router's program scheduling, its request-level fallback the
#: router's default policy (no request of the bench goes without a program).
PROGRAM_SCHEDULING = "program_scheduling"
#: Program scheduling with ``token_capacity_per_target`` null: admission by program count.
PROGRAM_SCHEDULING_BY_COUNT = "program_scheduling_by_count"
_PROGRAMS = (PROGRAM_SCHEDULING, PROGRAM_SCHEDULING_BY_COUNT)
_FALLBACK = "cache_aware"
_ARMS = ("stock", "hook", "unbounded")


@dataclass
class RealClusterConfig:
    """What to run (defaults: the figures in enginehook/README.md, "Cluster")."""

    policies: tuple[str, ...] = ("sticky_least_loaded", "cache_aware")
    engines: int = 2
    runs: int = 3
    compress: float = 0.1
    #: Two copies of the engine bench's load, one per engine: its trace doubled (48 programs
    #: over the same 20 s) on two engines of its pool size (240 blocks).
    trace: BenchConfig = field(default_factory=lambda: BenchConfig(programs=48, blocks=240))
    work: str = ""
    model_dir: str = ""
    #: Hook settings on top of the engine bench's (``additional_config.cachettl`` keys): by
    #: default none beyond the engine's defaults (:data:`CLUSTER_SETTINGS`).
    hook_settings: dict[str, Any] = field(default_factory=lambda: dict(CLUSTER_SETTINGS))
    #: A third arm: stock engines whose pools never evict (:func:`unbounded_pool`).
    unbounded: bool = False


def unbounded_pool(trace: BenchConfig) -> int:
    """Blocks of each engine of the unbounded arm: the whole trace's
    :func:`~enginehook.tools.bench.unbounded_blocks`, as a router may place every program on
    one engine.

    >>> unbounded_pool(BenchConfig(programs=48)) > 10 * 240
    True
    """
    return unbounded_blocks(make_trace(trace, 1.0), trace.block_size)


def program_scheduling_config(
    trace: BenchConfig, policy: str = PROGRAM_SCHEDULING, blocks: int | None = None
) -> dict[str, Any]:
    """``--program-scheduling-config-json``: the router doc's recommended deployment
    (``global_queue``, MRU resume, 1 s observations), each target's token capacity the
    engine's KV pool, and a new program bound to the target with the fewest programs (the
    simulator's reading, ``simulator/cluster/progsched.py``). The cost models are the router's
    reference calibration (it warns so at start). :data:`PROGRAM_SCHEDULING_BY_COUNT`: no
    token capacity. ``blocks``: each engine's pool when it is not ``trace.blocks`` (the
    unbounded arm's)."""
    pool = (blocks or trace.blocks) * trace.block_size if policy == PROGRAM_SCHEDULING else None
    return {
        "global_queue": True,
        "resume_order": "mru",
        "metrics_interval_seconds": 1.0,
        "token_capacity_per_target": pool,
        "binding_strategy": "least_program_count",
    }


def router_for(
    config: RealClusterConfig,
    policy: str,
    urls: list[str],
    work: Path,
    blocks: int | None = None,
) -> Router:
    """The router of ``policy`` in front of ``urls`` (not started); :data:`PROGRAM_SCHEDULING`
    is the router's default policy with program scheduling on (``blocks``: the engines' pool
    when it is not the trace's)."""
    if policy not in _PROGRAMS:
        return Router(policy, urls, work)
    ps = program_scheduling_config(config.trace, policy, blocks)
    settings = json.dumps(ps, separators=(",", ":"))
    flags = ("--enable-program-scheduling", "--program-scheduling-config-json", settings)
    return Router(_FALLBACK, urls, work, extra=flags)


def _program(
    base_url: str,
    program: BenchProgram,
    seed: int,
    out: BenchResult,
    agentic: bool = False,
    block: int = 32,
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(f"{seed}-{program.pid}")
    started = time.monotonic()
    context: list[int] = []
    previous = 0  # the previous turn's prompt length
    for k, turn in enumerate(program.turns):
        context += [rng.randrange(*_VOCAB) for _ in range(turn.input_tokens)]
        last = k == len(program.turns) - 1
        hints: dict[str, Any] = (
            {"last_turn": 1} if last else {"tool": "bash", "tool_args": turn.tool_args}
        )
        if agentic:  # vllm-router's program identity
            step = {"program_id": program.pid, "step_id": k, "expected_resume": not last}
            hints["agentic_context"] = step
        submitted = time.monotonic()
        first: float | None = None
        usage: Any = None
        stream = client.completions.create(
            model="tiny",
            prompt=context,
            max_tokens=turn.output_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "vllm_xargs": hints},
            extra_headers={"X-Session-ID": program.pid},
        )
        for chunk in stream:
            if first is None and chunk.choices:
                first = time.monotonic()
            if chunk.usage is not None:
                usage = chunk.usage
        if k == 0 and first is not None:
            out.first_wait_s.append(first - submitted)
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        cached = int(getattr(details, "cached_tokens", 0) or 0)
        out.prompt_tokens += len(context)
        out.cached_tokens += cached
        if k > 0:  # the previous prompt's full blocks (its output is not sent back: below)
            out.returning_reachable += block * (previous // block)
            out.returning_cached += cached
        previous = len(context)
        # The engine's own output tokens are not returned on this path: the context grows by
        # as many tokens of the same vocabulary, so the next prompt re-reads a prefix of the
        # same length (the last partial block misses alike on both arms).
        context += [rng.randrange(*_VOCAB) for _ in range(turn.output_tokens)]
        if not last:
            time.sleep(turn.tool_s)
    out.jct_s.append(time.monotonic() - started)


def _replay(
    base_url: str, trace: list[BenchProgram], seed: int, agentic: bool = False, block: int = 32
) -> BenchResult:
    result = BenchResult()
    lock = threading.Lock()

    def run(program: BenchProgram) -> None:
        time.sleep(program.arrival_s)
        mine = BenchResult()
        _program(base_url, program, seed, mine, agentic, block)
        with lock:
            result.jct_s += mine.jct_s
            result.first_wait_s += mine.first_wait_s
            result.prompt_tokens += mine.prompt_tokens
            result.cached_tokens += mine.cached_tokens
            result.returning_reachable += mine.returning_reachable
            result.returning_cached += mine.returning_cached

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in trace]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_s = time.monotonic() - started
    if len(result.jct_s) != len(trace):
        raise RuntimeError(f"{len(trace) - len(result.jct_s)} programs failed; see the logs")
    return result


def _reset(engines: list[ClusterEngine]) -> None:
    for engine in engines:
        request = urllib.request.Request(f"{engine.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=60):
            pass


def _engines(
    config: RealClusterConfig,
    model: Path,
    work: Path,
    name: str,
    hook: dict[str, Any] | None,
    blocks: int | None = None,
) -> list[ClusterEngine]:
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache between runs
    pool = blocks or config.trace.blocks
    return [
        ClusterEngine(f"{name}{i}", model, work, hook, pool, max_model_len=4096, env=env)
        for i in range(config.engines)
    ]


def _policy(
    config: RealClusterConfig, arms: dict[str, list[ClusterEngine]], policy: str, work: Path
) -> dict[str, list[dict[str, float]]]:
    """Every run of one router policy: a router per arm, the arms' replays alternating
    (stock first on even runs, last on odd ones) so that background load on a shared machine
    hits each alike."""
    trace = make_trace(config.trace, config.compress)
    routers = {
        name: router_for(
            config,
            policy,
            [e.url for e in engines],
            work,
            unbounded_pool(config.trace) if name == "unbounded" else None,
        )
        for name, engines in arms.items()
    }
    agentic = policy in _PROGRAMS
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    try:
        for router in routers.values():
            router.start()
            _replay(router.url, make_trace(BenchConfig(programs=2, seed=99), 0.01), 99, agentic)
        for run in range(config.runs):
            for name in replay_order(list(arms), run):
                _reset(arms[name])
                seed, load = config.trace.seed + run, os.getloadavg()[0]
                result = _replay(routers[name].url, trace, seed, agentic, config.trace.block_size)
                summary = result.summary()
                summary["load_1m"] = round(load, 2)  # at the replay's start
                runs[name].append(summary)
                print(f"{name} {policy} run {run}: {summary}", flush=True)
    finally:
        for router in routers.values():
            router.stop()
    return runs


def run_real_cluster(config: RealClusterConfig) -> dict[str, Any]:
    """Both arms up at once (stock engines, and hook engines with one control plane), every
    policy, ``runs`` runs each; the report as a JSON-ready dict."""
    from enginehook.tools.tinymodel import build_tiny_llama

    load_start = [round(x, 2) for x in os.getloadavg()]
    work = Path(config.work or "out/cluster-real")
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(Path(config.model_dir or work / "tiny-llama"))
    (work / "cp.sqlite3").unlink(missing_ok=True)  # each run learns from nothing, as the first
    plane = ControlPlaneProcess(f"sqlite:///{work / 'cp.sqlite3'}", free_port(), work / "cp.log")
    plane.start()
    (work / "token").write_text(plane.token)
    hook = {
        "policy": config.trace.policy,
        "policy_params": config.trace.policy_params,
        "min_samples": config.trace.min_samples,
        "control_plane": f"127.0.0.1:{plane.port}",
        "token_file": str(work / "token"),
        **config.hook_settings,
    }
    arms = {
        "stock": _engines(config, model, work, "stock", None),
        "hook": _engines(config, model, work, "hook", hook),
    }
    if config.unbounded:
        arms["unbounded"] = _engines(
            config, model, work, "unbounded", None, unbounded_pool(config.trace)
        )
    every = [engine for engines in arms.values() for engine in engines]
    stock: dict[str, list[dict[str, float]]] = {}
    ours: dict[str, list[dict[str, float]]] = {}
    bound: dict[str, list[dict[str, float]]] = {}
    try:
        for engine in every:
            engine.start()
        wait_for(lambda: all(e.ready() for e in every), 900, "the engines")
        for policy in config.policies:
            runs = _policy(config, arms, policy, work)
            stock[policy], ours[policy] = runs["stock"], runs["hook"]
            if "unbounded" in runs:
                bound[policy] = runs["unbounded"]
    finally:
        for engine in every:
            engine.stop()
        plane.stop()
    report: dict[str, Any] = {
        "config": asdict(config),
        "load_start": load_start,
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "policies": {},
    }
    if config.unbounded:
        report["unbounded_blocks"] = unbounded_pool(config.trace)
    if set(_PROGRAMS) & set(config.policies):
        report["program_scheduling_config"] = program_scheduling_config(config.trace)
    for policy in config.policies:
        report["policies"][policy] = compared(stock[policy], ours[policy], bound.get(policy))
    return report


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def compared(
    stock: list[dict[str, float]],
    hook: list[dict[str, float]],
    unbounded: list[dict[str, float]] | None = None,
) -> dict[str, Any]:
    """One policy's runs of both arms, their hook/stock ratios and the ratios' medians; with
    the ``unbounded`` arm's runs, the hook's distance to it per run and the medians."""
    ratios = [
        {
            "mean_jct": h["mean_jct_s"] / s["mean_jct_s"],
            "first_turn_wait_p90": h["first_turn_wait_p90_s"] / s["first_turn_wait_p90_s"],
        }
        for s, h in zip(stock, hook, strict=True)
    ]
    figures: dict[str, Any] = {
        "stock": stock,
        "hook": hook,
        "ratios": ratios,
        "median_mean_jct_ratio": statistics.median(r["mean_jct"] for r in ratios),
        "median_wait_p90_ratio": statistics.median(r["first_turn_wait_p90"] for r in ratios),
    }
    if unbounded is not None:
        distances = [distance(s, h, u) for s, h, u in zip(stock, hook, unbounded, strict=True)]
        figures["unbounded"] = unbounded
        figures["distances"] = distances
        figures["median_distance"] = {
            key: _median([d[key] for d in distances]) for key in distances[0]
        }
    return figures


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table, one row per policy and run."""
    config, trace = report["config"], report["config"]["trace"]
    lines = [
        f"Command: `{report.get('command', 'cachettl bench cluster --real')}`; "
        f"{trace['programs']} programs, {config['engines']} engines of {trace['blocks']} "
        f"blocks per arm, arrivals and tool gaps x {config['compress']}; hook settings on "
        f"top of the engine bench's: `{json.dumps(config['hook_settings'])}`.",
        "",
        "| router policy | run | mean JCT stock / hook (s) | ratio | first-turn wait P90 "
        "stock / hook (s) | ratio | prefix hits stock / hook |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, figures in report["policies"].items():
        for run, (s, h, r) in enumerate(
            zip(figures["stock"], figures["hook"], figures["ratios"], strict=True)
        ):
            lines.append(
                f"| {policy} | {run} | {s['mean_jct_s']:.2f} / {h['mean_jct_s']:.2f} | "
                f"{r['mean_jct']:.2f} | {s['first_turn_wait_p90_s']:.2f} / "
                f"{h['first_turn_wait_p90_s']:.2f} | {r['first_turn_wait_p90']:.2f} | "
                f"{s['prefix_hit_share']:.0%} / {h['prefix_hit_share']:.0%} |"
            )
        lines.append(
            f"| {policy} | median | | {figures['median_mean_jct_ratio']:.2f} | | "
            f"{figures['median_wait_p90_ratio']:.2f} | |"
        )
    if any("unbounded" in figures for figures in report["policies"].values()):
        lines += _unbounded_table(report)
    loads = [
        f"{policy} {', '.join(str(r.get('load_1m', '?')) for r in pair)}"
        for policy, figures in report["policies"].items()
        for pair in zip(*(figures[arm] for arm in _ARMS if arm in figures), strict=True)
    ]
    if "load_start" in report:
        lines += [
            "",
            "Load average (1 min) at each replay's start, stock / hook"
            + (" / unbounded" if "unbounded_blocks" in report else "")
            + " by run: "
            f"{'; '.join(loads)}.",
        ]
    if "program_scheduling_config" in report:
        settings = json.dumps(report["program_scheduling_config"])
        by_count = PROGRAM_SCHEDULING_BY_COUNT in report["policies"]
        lines += [
            "",
            f"`{PROGRAM_SCHEDULING}`: vllm-router `--policy {_FALLBACK} "
            f"--enable-program-scheduling --program-scheduling-config-json '{settings}'`"
            + (f"; `{PROGRAM_SCHEDULING_BY_COUNT}`: the same with" if by_count else "")
            + (" `token_capacity_per_target` null." if by_count else "."),
        ]
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _unbounded_table(report: dict[str, Any]) -> list[str]:
    """The hook's distance to the arm whose pools never evict, one row per policy and run."""
    lines = [
        "",
        f"The unbounded arm: {report['config']['engines']} stock "
        f"engine{'s' if report['config']['engines'] != 1 else ''} of "
        f"{report.get('unbounded_blocks', '?')} blocks (no replay evicts) behind a router of "
        "the same policy. Gap closed: (stock - hook) / (stock - unbounded); returning turns' "
        "prefix found: the share of the previous prompt's full blocks they found cached "
        "(below 100 % on the unbounded arm only where the router sent a turn elsewhere).",
        "",
        "| router policy | run | mean JCT unbounded (s) | hook / unbounded | gap closed "
        "| first-turn wait P90 unbounded (s) | hook / unbounded | gap closed "
        "| returning turns' prefix found stock / hook / unbounded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, figures in report["policies"].items():
        if "unbounded" not in figures:
            continue
        rows = zip(
            figures["stock"],
            figures["hook"],
            figures["unbounded"],
            figures["distances"],
            strict=True,
        )
        for run, (s, h, u, d) in enumerate(rows):
            found = " / ".join(
                f"{x.get('returning_hit_share', float('nan')):.0%}" for x in (s, h, u)
            )
            lines.append(
                f"| {policy} | {run} | {u['mean_jct_s']:.2f} | {_fmt(d['mean_jct_over_bound'])} | "
                f"{_fmt(d['mean_jct_gap_closed'], '.0%')} | {u['first_turn_wait_p90_s']:.2f} | "
                f"{_fmt(d['first_turn_wait_p90_over_bound'])} | "
                f"{_fmt(d['first_turn_wait_p90_gap_closed'], '.0%')} | {found} |"
            )
        m = figures["median_distance"]
        lines.append(
            f"| {policy} | median | | {_fmt(m['mean_jct_over_bound'])} | "
            f"{_fmt(m['mean_jct_gap_closed'], '.0%')} | | "
            f"{_fmt(m['first_turn_wait_p90_over_bound'])} | "
            f"{_fmt(m['first_turn_wait_p90_gap_closed'], '.0%')} | |"
        )
    return lines


def write(report: dict[str, Any], out: str) -> None:
    """``OUT.json`` and ``OUT.md``."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name + ".json").write_text(json.dumps(report, indent=2) + "\n")
    path.with_name(path.name + ".md").write_text(markdown(report))
