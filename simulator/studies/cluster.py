"""``cachettl bench cluster``: routers × retention policies on a simulated cluster, with an
engine added mid-run, compared seed by seed; and ``--scale``: the wall time of a large run.

The load: the arrival rate at which stock vLLM behind ``round_robin`` reaches mean slowdown
3 (JCT over each program's isolated JCT, averaged over the calibration seeds; bisection),
then ``--loads`` multiples of it. Each seed re-draws the trace; every pair runs on the same
trace of each seed, with one engine added when half the programs have arrived. The
compared pair (default ``ttl-aware`` + ``cachettl``) gets a verdict against every other
pair on mean JCT, P99 JCT and first-turn wait P90 with ``bench seeds``' statistics
(wins/ties/losses, sign test, bootstrap interval); orphaned pin token-seconds and remapped
pins are reported beside them. ``--ours`` may name several pairs (each gets its verdicts;
the first is the one the summary and the plot follow), and ``--pairs`` names the pairs run
instead of every router × retention. Lists are split on commas outside parentheses, so a
spec may carry several parameters (``cachettl(pins_in_kv_usage=true,ttl_cap_s=60)``).
``--kv-tokens`` sets each engine's KV pool. Writes ``OUT.md``, ``OUT.json`` and ``OUT.png``
(mean JCT against load, one line per pair).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulator.cluster import ROUTERS, TopologyChange, simulate_cluster
from simulator.engine import EngineConfig
from simulator.metrics import isolated_jct
from simulator.studies import provenance
from simulator.studies.seeds import paired, parse_seeds
from simulator.studies.study import output_path
from simulator.trace import Program
from simulator.workloads import generate

__all__ = ["register"]

HARDWARE = "llama3.1-8b-h100"
RETENTIONS = "vllm,continuum,cachettl"
OURS = "ttl-aware+cachettl"
VERDICT_METRICS = ("mean_jct_s", "p99_jct_s", "first_turn_wait_p90_s")
REPORTED = (*VERDICT_METRICS, "returning_hit_share", "orphaned_pin_token_s", "remapped_pins")


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench cluster``."""
    p = bench.add_parser("cluster", help="routers x retention on a simulated cluster")
    p.add_argument("--workload", default="swe", help="swe or bfcl")
    p.add_argument("--engines", type=int, default=4, help="engines at the start")
    p.add_argument("--programs", type=int, default=48, help="programs per seed")
    p.add_argument("--seeds", default="0-15", help="integers and ranges a-b (>= 16 for verdicts)")
    p.add_argument("--loads", default="1", help="multiples of the slowdown-3 load")
    p.add_argument("--rate", type=float, help="base rate (programs/s) instead of calibrating")
    p.add_argument("--routers", default=",".join(sorted(ROUTERS)), help="routers compared")
    p.add_argument("--retentions", default=RETENTIONS, help="retention policies compared")
    p.add_argument(
        "--ours",
        default=OURS,
        help="the pair compared, ROUTER+RETENTION (several, comma-separated: each gets verdicts)",
    )
    p.add_argument(
        "--pairs",
        help="ROUTER+RETENTION pairs run, comma-separated (instead of --routers x --retentions)",
    )
    p.add_argument(
        "--kv-tokens", type=int, help="each engine's KV pool in tokens (default: the profile's)"
    )
    p.add_argument("--out", default="results/cluster", help="writes OUT.md/.json/.png")
    p.add_argument(
        "--report", metavar="JSON", help="re-render OUT.md/.png from a JSON written before"
    )
    p.add_argument(
        "--scale", action="store_true", help="time one large run instead (see --scale-*)"
    )
    p.add_argument("--scale-engines", type=int, default=64)
    p.add_argument("--scale-programs", type=int, default=20_000)
    p.add_argument("--scale-pair", default=OURS, help="ROUTER+RETENTION of the timed run")
    _real_arguments(p)
    p.set_defaults(handler=_cluster)


def _real_arguments(p: argparse.ArgumentParser) -> None:
    """``bench cluster --real``'s options (enginehook/tools/clusterbench.py)."""
    p.add_argument(
        "--real",
        action="store_true",
        help="instead: stock engines against hook engines behind vllm-router on this "
        "machine's CPU (enginehook/tools/clusterbench.py); --out defaults to "
        "results/cluster_real",
    )
    p.add_argument(
        "--real-policies",
        default="sticky_least_loaded,cache_aware",
        help=(
            "--real: vllm-router policies, comma-separated: any --policy the router takes "
            "(sticky_least_loaded, cache_aware, consistent_hash, ...), or program_scheduling "
            "(the router's program scheduling, each engine's KV pool as its token capacity) "
            "and program_scheduling_by_count (no token capacity)"
        ),
    )
    p.add_argument("--real-runs", type=int, default=3, help="--real: runs per policy and arm")
    p.add_argument(
        "--real-unbounded",
        action="store_true",
        help="--real: a third arm, two stock engines whose KV pools never evict (the bound "
        "any retention can reach) behind a router of the same policy, and the hook's distance "
        "to it (off by default: two more engines on the machine, a third replay per run)",
    )
    p.add_argument(
        "--real-hook",
        default="{}",
        metavar="JSON",
        help="--real: hook settings on top of the bench's and the engine's defaults "
        '(a JSON object of additional_config.cachettl keys, e.g. {"first_turn_over_pins": false})',
    )


def split_specs(text: str) -> list[str]:
    """``text`` split on commas outside parentheses (empty items dropped).

    >>> split_specs("vllm,cachettl(a=1,b=2),x+y(c=3)")
    ['vllm', 'cachettl(a=1,b=2)', 'x+y(c=3)']
    """
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _pair(text: str) -> tuple[str, str]:
    router, plus, retention = text.partition("+")
    if not plus or not router or not retention:
        raise ValueError(f"expected ROUTER+RETENTION, got {text!r}")
    return router, retention


def _traces(workload: str, programs: int, seeds: Sequence[int]) -> list[list[Program]]:
    return [generate(workload, programs, None, seed) for seed in seeds]


def _redraw(programs: Sequence[Program], rate: float, seed: int) -> list[Program]:
    from simulator.trace import redraw_arrivals

    return redraw_arrivals(programs, rate, seed)


def _run(
    programs: Sequence[Program],
    pair: tuple[str, str],
    engines: int,
    seed: int,
    config: EngineConfig | None = None,
) -> dict[str, float]:
    half = sorted(p.arrival_s for p in programs)[len(programs) // 2]
    join = [TopologyChange(half, "add")]
    result = simulate_cluster(programs, pair[0], pair[1], engines, HARDWARE, config, join, seed)
    return result.figures()


def calibrate(
    traces: list[list[Program]],
    seeds: Sequence[int],
    engines: int,
    config: EngineConfig | None = None,
) -> float:
    """The rate at which vLLM behind round_robin reaches mean slowdown 3 (no topology
    change; 5 halvings after bracketing: about 3 % of the rate)."""
    isolated = [isolated_jct(t, HARDWARE) for t in traces]

    def slowdown(rate: float) -> float:
        total = 0.0
        for trace, iso, seed in zip(traces, isolated, seeds, strict=True):
            result = simulate_cluster(
                _redraw(trace, rate, seed), "round_robin", "vllm", engines, HARDWARE, config
            )
            total += result.figures(iso)["mean_slowdown"]
        return total / len(traces)

    low, high = 0.0, 0.05 * engines
    while slowdown(high) < 3.0:
        low, high = high, high * 2.0
        if high > 1000:
            raise ValueError(
                f"round_robin + vllm never reaches slowdown 3 with {len(traces[0])} programs "
                f"on {engines} engines: give more --programs or a --rate"
            )
    for _ in range(5):
        middle = (low + high) / 2.0
        low, high = (middle, high) if slowdown(middle) < 3.0 else (low, middle)
    return (low + high) / 2.0


def _measure(
    args: argparse.Namespace, seeds: Sequence[int], pairs: list[tuple[str, str]]
) -> tuple[float, dict[float, dict[str, list[dict[str, float]]]]]:
    traces = _traces(args.workload, args.programs, seeds)
    config = EngineConfig(kv_tokens=args.kv_tokens) if args.kv_tokens else None
    base = args.rate
    if base is None:
        calibration = list(seeds[:2])
        base = calibrate(traces[:2], calibration, args.engines, config)
        print(f"slowdown-3 load of round_robin + vllm: {base:.4f} programs/s", flush=True)
    runs: dict[float, dict[str, list[dict[str, float]]]] = {}
    for factor in (float(x) for x in args.loads.split(",")):
        rows: dict[str, list[dict[str, float]]] = {f"{r}+{k}": [] for r, k in pairs}
        for trace, seed in zip(traces, seeds, strict=True):
            programs = _redraw(trace, base * factor, seed)
            for router, retention in pairs:
                rows[f"{router}+{retention}"].append(
                    _run(programs, (router, retention), args.engines, seed, config)
                )
            print(f"load {factor} seed {seed} done", flush=True)
        runs[factor] = rows
    return base, runs


def _verdicts(ours: str, rows: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    out = []
    for rival, figures in rows.items():
        if rival == ours:
            continue
        for metric in VERDICT_METRICS:
            a = [f[metric] for f in rows[ours]]
            b = [f[metric] for f in figures]
            r = paired(a, b)
            out.append(
                {
                    "rival": rival,
                    "metric": metric,
                    "wins": r.wins,
                    "ties": r.ties,
                    "losses": r.losses,
                    "sign_p": r.sign_p,
                    "mean_diff": r.mean_diff,
                    "low": r.low,
                    "high": r.high,
                    "verdict": r.verdict,
                }
            )
    return out


def _mean(rows: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in rows if not math.isnan(r[key])]
    return math.fsum(values) / len(values) if values else math.nan


def _markdown(summary: dict[str, Any]) -> list[str]:
    lines = [
        f"# Cluster: {summary['workload']}, {summary['engines']} engines (+1 at half the "
        f"arrivals), {summary['programs']} programs x {len(summary['seeds'])} seeds",
        "",
        f"Command: `{summary['command']}`",
        "",
        "Base load (round_robin + vllm at mean slowdown 3): "
        f"{summary['base_rate']:.4f} programs/s."
        + (
            f" KV pool per engine: {summary['kv_tokens']} tokens."
            if summary.get("kv_tokens")
            else ""
        ),
    ]
    lines += ["", "## Summary", "", _done_header()]
    lines.append("|---|---|---|---|---|")
    for load, block in summary["loads"].items():
        lines.append(_done_row(summary, load, block))
    for load, block in summary["loads"].items():
        lines += ["", f"## {load}x load: means over seeds", ""]
        lines.append("| pair | " + " | ".join(REPORTED) + " |")
        lines.append("|---" * (len(REPORTED) + 1) + "|")
        for pair, means in sorted(block["means"].items(), key=lambda kv: kv[1]["mean_jct_s"]):
            lines.append(f"| {pair} | " + " | ".join(f"{means[k]:.4g}" for k in REPORTED) + " |")
        blocks = {summary["ours"]: block["verdicts"], **block.get("more_verdicts", {})}
        for ours, verdicts in blocks.items():
            lines += ["", f"### {ours} against each pair (lower is better)", ""]
            lines.append("| rival | metric | W/T/L | sign p | mean diff [95 % CI] | verdict |")
            lines.append("|---|---|---|---|---|---|")
            for v in verdicts:
                lines.append(
                    f"| {v['rival']} | {v['metric']} | {v['wins']}/{v['ties']}/{v['losses']} | "
                    f"{v['sign_p']:.3g} | {v['mean_diff']:.3g} [{v['low']:.3g}, "
                    f"{v['high']:.3g}] | {v['verdict']} |"
                )
    return lines


def _done_header() -> str:
    return (
        "| load | verdicts of the compared pair (better / no difference / worse) | "
        "its orphaned pin token-s / consistent_hash+cachettl's | its remapped pins | "
        "rivals it is worse than |"
    )


def _done_row(summary: dict[str, Any], load: str, block: dict[str, Any]) -> str:
    verdicts = block["verdicts"]
    counts = [
        sum(v["verdict"] == k for v in verdicts) for k in ("better", "no difference", "worse")
    ]
    worse = sorted({f"{v['rival']} ({v['metric']})" for v in verdicts if v["verdict"] == "worse"})
    means = block["means"]
    ours = means[summary["ours"]]
    hashed = means.get("consistent_hash+cachettl", {}).get("orphaned_pin_token_s", math.nan)
    ratio = ours["orphaned_pin_token_s"] / hashed if hashed else math.nan
    return (
        f"| {load}x | {counts[0]} / {counts[1]} / {counts[2]} | {ratio:.3f} | "
        f"{ours['remapped_pins']:.2f} | {', '.join(worse) or 'none'} |"
    )


def _plot(path: Any, summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted(summary["loads"], key=float)
    fig, ax = plt.subplots(figsize=(8, 5))
    retention = summary["ours"].rpartition("+")[2]
    pairs = summary["loads"][loads[0]]["means"]
    for pair in pairs:  # one line per router with our retention, or every pair if few
        if len(pairs) > 6 and not pair.endswith("+" + retention) and pair != "round_robin+vllm":
            continue
        ys = [summary["loads"][x]["means"][pair]["mean_jct_s"] for x in loads]
        style = "-" if pair == summary["ours"] else ":"
        ax.plot([float(x) for x in loads], ys, style, marker="o", label=pair)
    ax.set_xlabel("load (multiple of round_robin + vllm's slowdown-3 rate)")
    ax.set_ylabel("mean JCT (s)")
    ax.set_title(
        f"{summary['workload']}, {summary['engines']} engines + 1 joining"
        + (
            f"; each router with {retention} (and round_robin + vllm)"
            if len(pairs) > 6
            else ", every pair"
        )
        + (f"; KV pool {summary['kv_tokens']} tokens" if summary.get("kv_tokens") else "")
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _real(args: argparse.Namespace) -> int:
    from enginehook.tools.clusterbench import (
        CLUSTER_SETTINGS,
        RealClusterConfig,
        markdown,
        run_real_cluster,
        write,
    )

    policies = tuple(p for p in args.real_policies.split(",") if p)
    if not policies or args.real_runs < 1:
        raise ValueError("--real-policies must name a policy and --real-runs be >= 1")
    try:
        settings = json.loads(args.real_hook)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--real-hook: not JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError("--real-hook: must be a JSON object of hook settings")
    config = RealClusterConfig(
        policies=policies,
        runs=args.real_runs,
        hook_settings={**CLUSTER_SETTINGS, **settings},
        unbounded=args.real_unbounded,
    )
    report = run_real_cluster(config)
    report["command"] = "cachettl bench cluster " + shlex.join(sys.argv[3:])
    out = args.out if args.out != "results/cluster" else "results/cluster_real"
    write(report, out)
    print(markdown(report))
    return 0


def _cluster(args: argparse.Namespace) -> int:
    if args.real:
        return _real(args)
    if args.scale:
        return _scale(args)
    if args.report:
        written = json.loads(Path(args.report).read_text())
        _write(args.out, written)
        if isinstance(written.get("provenance"), dict):  # the figures' own record
            provenance.stamp(output_path(args.out, ".md"), written["provenance"])
        return 0
    seeds = parse_seeds(args.seeds)
    if args.engines < 1 or args.programs < 2:
        raise ValueError("--engines must be >= 1 and --programs >= 2")
    started = provenance.load_now()
    compared = [_pair(p) for p in split_specs(args.ours)]
    if not compared:
        raise ValueError("--ours must name a pair ROUTER+RETENTION")
    if args.pairs:
        pairs = [_pair(p) for p in split_specs(args.pairs)]
    else:
        routers, retentions = split_specs(args.routers), split_specs(args.retentions)
        pairs = [(r, k) for r in routers for k in retentions]
    pairs = list(dict.fromkeys([*compared, *pairs]))
    base, runs = _measure(args, seeds, pairs)
    label = f"{compared[0][0]}+{compared[0][1]}"
    summary: dict[str, Any] = {
        "command": "cachettl bench cluster " + shlex.join(sys.argv[3:]),
        "workload": args.workload,
        "engines": args.engines,
        "programs": args.programs,
        "seeds": seeds,
        "base_rate": base,
        "ours": label,
        **({"kv_tokens": args.kv_tokens} if args.kv_tokens else {}),
        "loads": {},
    }
    for factor, rows in runs.items():
        summary["loads"][str(factor)] = {
            "means": {p: {k: _mean(v, k) for k in REPORTED} for p, v in rows.items()},
            "verdicts": _verdicts(label, rows),
            "per_seed": rows,
        }
        more = {f"{r}+{k}": _verdicts(f"{r}+{k}", rows) for r, k in compared[1:]}
        if more:
            summary["loads"][str(factor)]["more_verdicts"] = more
    output_path(args.out, ".json").parent.mkdir(parents=True, exist_ok=True)
    output_path(args.out, ".json").write_text(json.dumps(summary, indent=1) + "\n")
    _write(args.out, summary)
    made = provenance.current(f"{summary['command']}", started)
    for suffix in (".md", ".json"):
        provenance.stamp(output_path(args.out, suffix), made)
    return 0


def _write(out: str, summary: dict[str, Any]) -> None:
    md = output_path(out, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(_markdown(summary)) + "\n")
    _plot(output_path(out, ".png"), summary)
    print(f"wrote {md}")


def _scale(args: argparse.Namespace) -> int:
    """Wall and CPU time of ``--scale-programs`` programs on ``--scale-engines`` engines at
    the load of one engine's 0.05 programs/s each, against one engine's 500 programs."""
    router, retention = _pair(args.scale_pair)
    n, engines = args.scale_programs, args.scale_engines
    programs = generate(args.workload, n, 0.05 * engines, 0)
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate_cluster(programs, router, retention, engines)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    one = generate(args.workload, 500, 0.05, 0)
    base_cpu = time.process_time()
    simulate_cluster(one, router, retention, 1)
    base_cpu = time.process_time() - base_cpu
    per, base_per = cpu / n, base_cpu / 500
    print(
        f"{engines} engines x {n} programs ({router} + {retention}): wall {wall:.1f} s, "
        f"CPU {cpu:.1f} s ({1000 * per:.2f} ms/program; one engine x 500: "
        f"{1000 * base_per:.2f} ms/program, ratio {per / base_per:.2f}); "
        f"{len(result.programs)} finished, mean JCT {result.figures()['mean_jct_s']:.1f} s"
    )
    return 0
