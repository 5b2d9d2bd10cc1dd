"""`cachettl` subcommands of this package (registered by `controlplane.cli`)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from enginehook.core.rules import SchedulingRules
from enginehook.tools import faultbench


def register(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    bench: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add this package's subcommands to `cachettl` and `cachettl bench`."""
    p = bench.add_parser(
        "vllm",
        help="stock vLLM scheduler vs the CacheTTL hook on the CPU engine (mean/P90 JCT)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--programs", type=int, default=24, help="agent programs per regime")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="cachettl", help="TTL policy of the hook")
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy parameter (number), e.g. ttl_s=0.5; repeatable",
    )
    p.add_argument("--min-samples", type=int, default=20, help="cold-start threshold K")
    p.add_argument(
        "--regimes",
        default="saturated=0.1,unsaturated=1.0",
        help="NAME=COMPRESSION of arrivals and tool gaps, comma-separated (first is headline)",
    )
    p.add_argument("--overhead-pins", type=int, default=1000, help="0 skips the overhead run")
    p.add_argument("--repeats", type=int, default=2, help="alternating replays per regime")
    p.add_argument(
        "--order-window",
        type=float,
        default=SchedulingRules().order_window_s,
        help="hook's order_window_s (0: the paper's unbounded program order)",
    )
    p.add_argument(
        "--no-unbounded",
        dest="unbounded",
        action="store_false",
        help="skip the third engine (stock vLLM with a KV pool that never evicts: the bound "
        "any retention can reach)",
    )
    p.add_argument(
        "--out",
        default="",
        metavar="OUT",
        help="also write OUT.json and OUT.md (with the provenance stamp of scripts/results)",
    )
    p.set_defaults(handler=_bench_vllm)
    _register_bench_agent(bench)
    _register_bench_router(bench)
    faultbench.register(bench)  # cachettl bench fault-engine-death


def _register_bench_router(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser(
        "router",
        help="the TTL-aware router's cost per decision, by replicas and published pins",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument(
        "--replicas", default="4,16,64", help="replica counts, comma-separated (default 4,16,64)"
    )
    p.add_argument("--pins", type=int, default=300, help="live pins each replica publishes")
    p.add_argument("--decisions", type=int, default=300, help="decisions of each kind per row")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_bench_router)


def _bench_router(args: argparse.Namespace) -> int:
    from enginehook.tools.routerbench import format_rows, run_router_bench

    try:
        counts = [int(x) for x in args.replicas.split(",")]
    except ValueError:
        raise ValueError(
            f"--replicas: expected counts like 4,16,64, got {args.replicas!r}"
        ) from None
    rows = run_router_bench(counts, args.pins, args.decisions, args.seed)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print(format_rows(rows))
    return 0


def _parse_params(items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--policy-param must be KEY=VALUE, got {item!r}")
        try:
            params[key] = float(value)
        except ValueError:
            raise ValueError(
                f"--policy-param {key}: value must be a number, got {value!r}"
            ) from None
    return params


def _parse_regimes(text: str) -> dict[str, float]:
    regimes: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            compress = float(value)
        except ValueError:
            compress = -1.0
        if not sep or not name or not 0 < compress <= 10:
            raise ValueError(f"--regimes: expected NAME=COMPRESSION in (0, 10], got {item!r}")
        regimes[name] = compress
    return regimes


def _bench_vllm(args: argparse.Namespace) -> int:
    from enginehook.tools.bench import BenchConfig, run_bench
    from estimator import get_policy

    if not 2 <= args.programs <= 500:
        raise ValueError("--programs must be in [2, 500]")
    if not 0 <= args.overhead_pins <= 5000:
        raise ValueError("--overhead-pins must be in [0, 5000]")
    if args.min_samples < 0:
        raise ValueError("--min-samples must be >= 0")
    if not 1 <= args.repeats <= 20:
        raise ValueError("--repeats must be in [1, 20]")
    if not 0 <= args.order_window <= 3600:
        raise ValueError("--order-window must be in [0, 3600] seconds")
    params = _parse_params(args.policy_param)
    if args.policy == "cachettl" and not args.policy_param:
        params = {"ttl_cap_s": 30.0}
    get_policy(args.policy, **params)  # a bad name or parameter fails before any engine starts
    config = BenchConfig(
        programs=args.programs,
        seed=args.seed,
        policy=args.policy,
        policy_params=params,
        min_samples=args.min_samples,
        regimes=_parse_regimes(args.regimes),
        overhead_pins=args.overhead_pins,
        repeats=args.repeats,
        order_window_s=args.order_window,
        unbounded=args.unbounded,
    )
    started = [round(x, 2) for x in os.getloadavg()]
    report = run_bench(config)
    if args.out:
        from enginehook.tools.bench import write
        from simulator.studies import provenance

        command = "cachettl bench vllm " + shlex.join(sys.argv[3:])
        made = provenance.current(command.strip(), started)
        for path in write(report, args.out, command.strip()):
            provenance.stamp(path, made)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print(report)
    return 0


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"vLLM CPU engine, tiny Llama; {cfg['programs']} programs, {cfg['blocks']} blocks of "
        f"{cfg['block_size']}, max {cfg['max_num_seqs']} seqs; hook policy {cfg['policy']} "
        f"{cfg['policy_params']}, order window {cfg['order_window_s']} s, "
        f"{cfg['repeats']} alternating replays per regime, {cfg['cpu_count']} CPUs"
    )
    if "unbounded_blocks" in cfg:
        print(
            f"unbounded: stock vLLM with {cfg['unbounded_blocks']} blocks (no replay evicts); "
            "'returning' is the share of their reachable prefix returning turns found cached"
        )
    print(
        f"{'regime':<12} {'':<9} {'mean JCT':>9} {'P90 JCT':>9} {'1st wait P90':>13} "
        f"{'hit share':>10} {'returning':>10}"
    )
    for regime, r in report["regimes"].items():
        for name in ("stock", "cachettl", "unbounded"):
            if name not in r:
                continue
            s = r[name]
            print(
                f"{regime:<12} {name:<9} {s['mean_jct_s']:>8.2f}s {s['p90_jct_s']:>8.2f}s "
                f"{s['first_turn_wait_p90_s']:>12.3f}s {s['prefix_hit_share']:>10.1%} "
                f"{s['returning_hit_share']:>10.1%}"
            )
        print(
            f"{regime:<12} {'ratio':<9} {r['mean_jct_ratio']:>8.2f}x {r['p90_jct_ratio']:>8.2f}x "
            f"{r['first_turn_wait_p90_ratio']:>12.2f}x"
        )
        if "distance" in r:
            d = r["distance"]
            print(
                f"{regime:<12} hook vs unbounded pool: mean JCT {_x(d['mean_jct_over_bound'])}, "
                f"closes {_pct(d['mean_jct_gap_closed'])} of stock's gap; first-turn wait P90 "
                f"{_x(d['first_turn_wait_p90_over_bound'])}, closes "
                f"{_pct(d['first_turn_wait_p90_gap_closed'])}"
            )
    if "overhead" in report:
        o = report["overhead"]
        print(
            f"hook cost per schedule(): {o['hook_us_per_schedule']:.1f} µs with "
            f"{o['pins_held']:.0f} pins held ({o['schedule_calls']:.0f} calls; vLLM's own "
            f"schedule(): {o['vllm_us_per_schedule']:.1f} µs)"
        )


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _register_bench_agent(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser(
        "agent",
        help="real mini-swe-agent programs on SmolLM2-135M: stock vLLM vs the hook (JCT)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--programs", type=int, default=6, help="concurrent agent programs")
    p.add_argument("--steps", type=int, default=5, help="step limit of each program")
    p.add_argument("--arrival-window", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--blocks", type=int, default=48, help="KV blocks of 32 tokens per engine")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1, help="alternating replays per scheduler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="cachettl", help="TTL policy of the hook")
    p.add_argument(
        "--policy-param", action="append", default=[], metavar="KEY=VALUE", help="repeatable"
    )
    p.add_argument("--min-samples", type=int, default=3, help="cold-start threshold K")
    p.add_argument("--config", default="", help="mini-swe-agent YAML (default: the example)")
    p.set_defaults(handler=_bench_agent)


def _bench_agent(args: argparse.Namespace) -> int:
    from pathlib import Path

    from enginehook.tools.agentbench import AgentBenchConfig, run_agent_bench
    from enginehook.tools.agentrun import DEFAULT_CONFIG
    from estimator import get_policy

    checks = {
        "--programs": (args.programs, 1, 64),
        "--steps": (args.steps, 1, 50),
        "--arrival-window": (args.arrival_window, 0, 3600),
        "--blocks": (args.blocks, 40, 100_000),
        "--max-num-seqs": (args.max_num_seqs, 1, 256),
        "--repeats": (args.repeats, 1, 20),
        "--min-samples": (args.min_samples, 0, 100_000),
    }
    for flag, (value, low, high) in checks.items():
        if not low <= value <= high:
            raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")
    params = _parse_params(args.policy_param)
    if args.policy == "cachettl" and not args.policy_param:
        params = {"ttl_cap_s": 30.0}
    get_policy(args.policy, **params)  # a bad name or parameter fails before any engine starts
    config = AgentBenchConfig(
        programs=args.programs,
        steps=args.steps,
        arrival_window_s=args.arrival_window or 1e-6,
        blocks=args.blocks,
        max_num_seqs=args.max_num_seqs,
        policy=args.policy,
        policy_params=params,
        min_samples=args.min_samples,
        repeats=args.repeats,
        seed=args.seed,
        agent_config=Path(args.config) if args.config else DEFAULT_CONFIG,
    )
    report = run_agent_bench(config)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_agent(report)
    return 0


def _print_agent(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"mini-swe-agent x SmolLM2-135M-Instruct on vLLM CPU; {cfg['programs']} programs of "
        f"<= {cfg['steps']} steps over {cfg['arrival_window_s']} s, {cfg['blocks']} blocks of "
        f"32, max {cfg['max_num_seqs']} seqs; hook policy {cfg['policy']} {cfg['policy_params']}"
    )
    print(f"{'':<9} {'mean JCT':>9} {'P90 JCT':>9} {'1st turn P90':>13} {'hit share':>10}")
    for name in ("stock", "cachettl"):
        s = report[name]
        print(
            f"{name:<9} {s['mean_jct_s']:>8.2f}s {s['p90_jct_s']:>8.2f}s "
            f"{s['first_turn_p90_s']:>12.3f}s {s['prefix_hit_share']:>10.1%}"
        )
    print(
        f"{'ratio':<9} {report['mean_jct_ratio']:>8.2f}x {report['p90_jct_ratio']:>8.2f}x "
        f"{report['first_turn_p90_ratio']:>12.2f}x"
    )
    counters = report["hook_counters"]
    print(
        f"hook: {counters.get('cachettl_pins_taken_total', 0):.0f} pins taken, "
        f"{counters.get('cachettl_pinned_prefix_hits_total', 0):.0f} pinned-prefix hits "
        f"(warm-up included); commands run: {', '.join(report['commands'])}"
    )
