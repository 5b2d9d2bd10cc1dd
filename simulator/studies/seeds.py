"""``cachettl bench seeds``: one policy against others, seed by seed, with the statistics
that tell a difference from the luck of a trace.

A table averaged over three seeds cannot do that. Where nothing is contended two
policies differ only in the order of a few requests, so P99 (the second-slowest of 200
programs) lands either side of a rival's by a fraction of a second; under overload one
tie-break can move a seed by a tenth. Every policy here runs on the same trace of each
seed (arrivals re-drawn at the rate, as in ``bench ablation``). Per rival and metric the
command reports:

* how many seeds the policy wins, ties and loses (lower is better for every metric);
* the two-sided sign-test p-value of those counts (ties left out);
* the mean paired difference (policy − rival) with its 95 % percentile-bootstrap interval;
* the median per-seed ratio;
* the verdict: *better* or *worse* where both agree at 5 %, the interval excluding 0 and
  the sign test's p below 0.05 (so neither one outlying seed nor a run of tiny wins makes
  a difference alone), else *no difference*.

It writes ``OUT.md`` (the summary and every seed's figures) and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from simulator.studies import provenance
from simulator.studies.study import (
    PEERS,
    WORKLOADS,
    Study,
    output_path,
    seed_list,
    workload_source,
)

__all__ = ["METRICS", "Paired", "paired", "parse_seeds", "register"]

#: ``(name, index)`` of the figures :meth:`Study.per_seed` returns, all lower-is-better.
METRICS = (("mean JCT", 0), ("P99 JCT", 1), ("first-turn wait P90", 2))

#: The sign test's level below which (with the interval excluding 0) a verdict is called.
SIGNIFICANCE = 0.05

#: Bootstrap resamples of the mean difference (percentile interval).
RESAMPLES = 9999


@dataclass(frozen=True, slots=True)
class Paired:
    """The comparison of one policy's per-seed figures with a rival's on the same seeds."""

    wins: int
    ties: int
    losses: int
    sign_p: float
    mean_diff: float
    low: float
    high: float
    median_ratio: float

    @property
    def verdict(self) -> str:
        """*better* / *worse* where the interval excludes 0 and the sign test's p is below
        :data:`SIGNIFICANCE`, else *no difference*."""
        if self.sign_p < SIGNIFICANCE and self.high < 0.0:
            return "better"
        if self.sign_p < SIGNIFICANCE and self.low > 0.0:
            return "worse"
        return "no difference"


def paired(
    ours: Sequence[float], theirs: Sequence[float], confidence: float = 0.95, seed: int = 0
) -> Paired:
    """Wins, ties and losses of ``ours`` against ``theirs`` (lower wins), the sign test's
    two-sided p-value, the mean of ``ours − theirs`` with its percentile-bootstrap
    interval at ``confidence`` (resampling seeds; ``seed`` fixes the draws) and the median
    ratio ``ours / theirs`` (over the seeds where ``theirs`` > 0; NaN if none).

    >>> r = paired([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 4.0, 6.0])
    >>> (r.wins, r.ties, r.losses), round(r.sign_p, 3), r.mean_diff, r.median_ratio
    ((3, 1, 0), 0.25, -1.0, 0.708...)
    >>> paired([5.0, 5.0], [5.0, 5.0]).verdict
    'no difference'
    """
    from scipy.stats import binomtest, bootstrap

    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"need the same seeds on both sides, got {len(ours)} and {len(theirs)}")
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    diff = a - b
    tied = np.abs(diff) <= 1e-9 * np.maximum(1.0, np.abs(b))
    wins, losses = int(np.sum(~tied & (diff < 0))), int(np.sum(~tied & (diff > 0)))
    sign_p = binomtest(wins, wins + losses).pvalue if wins + losses else 1.0
    mean = float(diff.mean())
    low = high = mean
    if diff.shape[0] > 1 and np.ptp(diff) > 0.0:
        ci = bootstrap(
            (diff,),
            np.mean,
            confidence_level=confidence,
            n_resamples=RESAMPLES,
            method="percentile",
            rng=np.random.default_rng(seed),
        ).confidence_interval
        low, high = float(ci.low), float(ci.high)
    positive = b > 0.0
    ratio = float(np.median(a[positive] / b[positive])) if positive.any() else math.nan
    return Paired(wins, int(tied.sum()), losses, float(sign_p), mean, low, high, ratio)


def parse_seeds(text: str) -> list[int]:
    """Seeds as a comma list of integers and ranges (``a-b`` includes both ends).

    >>> parse_seeds("0-3,7")
    [0, 1, 2, 3, 7]
    """
    seeds = seed_list(text)
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must name at least two distinct seeds, got {text!r}")
    return seeds


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench seeds``."""
    parser = bench.add_parser(
        "seeds", help="a policy against others seed by seed: wins, sign test, bootstrap interval"
    )
    parser.add_argument("--workload", default="swe", help=f"one of: {', '.join(WORKLOADS)}")
    parser.add_argument("--programs", type=int, default=200, help="programs per run")
    parser.add_argument("--seeds", default="20-35", help="integers and ranges a-b")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--load", type=float, help="multiple of vLLM's slowdown-3 load (default 1)")
    load.add_argument("--rate", type=float, help="program arrivals per second instead")
    parser.add_argument("--policy", default="cachettl", help="the policy compared")
    parser.add_argument("--against", default=",".join(("vllm", *PEERS)), help="its rivals")
    parser.add_argument("--cpu-tier-tokens", type=int, default=0, help="host KV tier (0: none)")
    parser.add_argument("--out", default="results/seeds", help="writes OUT.md/.json")
    parser.set_defaults(handler=_seeds)


def _seeds(args: argparse.Namespace) -> int:
    from simulator.studies.report import parse_policies

    seeds = parse_seeds(args.seeds)
    workload_source(args.workload)
    for flag, value in (("--load", args.load), ("--rate", args.rate)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.programs < 1 or args.cpu_tier_tokens < 0:
        raise ValueError("--programs must be >= 1 and --cpu-tier-tokens >= 0")
    policy = parse_policies(args.policy)
    if len(policy) != 1:
        raise ValueError(f"--policy names one policy, got {args.policy!r}")
    rivals = parse_policies(args.against)
    if policy[0] in rivals:
        raise ValueError(f"--against names the compared policy {policy[0]!r}")
    started = provenance.load_now()
    study = Study(args.programs, seeds, cpu_tier_tokens=args.cpu_tier_tokens)
    factor = None if args.rate is not None else (args.load or 1.0)
    rate = args.rate if factor is None else study.rate(args.workload) * factor
    runs = study.per_seed(args.workload, rate, [*policy, *rivals])
    summary = _summary(args, seeds, rate, factor, policy[0], runs)
    md = output_path(args.out, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(_markdown(summary)) + "\n")
    output_path(args.out, ".json").write_text(json.dumps(summary, indent=1) + "\n")
    made = provenance.current(f"{summary['command']} --out {shlex.quote(args.out)}", started)
    for path in (md, output_path(args.out, ".json")):
        provenance.stamp(path, made)
    for row in summary["comparisons"]:
        print(f"{row['rival']} {row['metric']}: {_counts(row)}, {row['verdict']}")
    print(f"wrote {md}")
    return 0


def _summary(
    args: argparse.Namespace,
    seeds: list[int],
    rate: float,
    factor: float | None,
    policy: str,
    runs: dict[str, list[tuple[float, float, float]]],
) -> dict[str, Any]:
    load = f"--rate {args.rate:g}" if factor is None else f"--load {factor:g}"
    command = (
        f"cachettl bench seeds --workload {args.workload} --programs {args.programs} "
        f"--seeds {args.seeds} {load} --policy {shlex.quote(policy)} "
        f"--against {shlex.quote(args.against)}"
        + (f" --cpu-tier-tokens {args.cpu_tier_tokens}" if args.cpu_tier_tokens else "")
    )
    comparisons = []
    for rival in runs:
        if rival == policy:
            continue
        for metric, i in METRICS:
            ours = [run[i] for run in runs[policy]]
            result = paired(ours, [run[i] for run in runs[rival]])
            comparisons.append(
                {"rival": rival, "metric": metric, **asdict(result), "verdict": result.verdict}
            )
    return {
        "command": command,
        "workload": args.workload,
        "programs": args.programs,
        "cpu_tier_tokens": args.cpu_tier_tokens,
        "rate": rate,
        "load": factor,
        "policy": policy,
        "seeds": seeds,
        "runs": runs,
        "comparisons": comparisons,
    }


def _counts(row: dict[str, Any]) -> str:
    return f"{row['wins']} / {row['ties']} / {row['losses']}"


def _markdown(summary: dict[str, Any]) -> list[str]:
    tier = summary["cpu_tier_tokens"]
    load = "" if summary["load"] is None else f", {summary['load']:g}× vLLM's slowdown-3 load"
    policy, seeds = summary["policy"], summary["seeds"]
    lines = [
        f"# `{policy}` seed by seed (generated by `cachettl bench seeds`)",
        "",
        f"Command: `{summary['command']}`",
        "",
        f"{summary['workload']}, {summary['programs']} programs at {summary['rate']:.4f} "
        f"programs/s{load}, {len(seeds)} seeds, 8B/H100"
        + (f", CPU tier of {tier:,} tokens" if tier else "")
        + ". Lower is better for every metric; Δ is "
        f"`{policy}` − rival, with its 95 % bootstrap interval over the seeds; the verdict "
        "is *better* or *worse* where that interval excludes 0 and the sign test's p is "
        "below 0.05.",
        "",
        "| rival | metric | wins / ties / losses | sign test p | mean Δ (s) [95 % interval] "
        "| median ratio | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["comparisons"]:
        lines.append(
            f"| {row['rival']} | {row['metric']} | {_counts(row)} | {row['sign_p']:.3f} | "
            f"{row['mean_diff']:+.2f} [{row['low']:+.2f}, {row['high']:+.2f}] | "
            f"{row['median_ratio']:.3f} | {row['verdict']} |"
        )
    specs = list(summary["runs"])
    lines += [
        "",
        "## Every seed",
        "",
        "Each cell: mean JCT / P99 JCT / first-turn wait P90 (s).",
        "",
    ]
    lines += ["| seed | " + " | ".join(specs) + " |", "|---|" + "---|" * len(specs)]
    for k, seed in enumerate(seeds):
        cells = [" / ".join(f"{v:.1f}" for v in summary["runs"][s][k]) for s in specs]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    means = [
        " / ".join(f"{statistics.fmean(r[i] for r in summary['runs'][s]):.1f}" for i in range(3))
        for s in specs
    ]
    return [*lines, "| mean | " + " | ".join(means) + " |"]
