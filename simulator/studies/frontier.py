"""``cachettl bench frontier``: mean JCT against new programs' first-turn wait P90.

Per workload and load (multiples of the load where vLLM's mean slowdown reaches 3, as in
``bench ablation``), every policy is one point and ``cachettl`` is a curve: its fairness
knob (a :class:`enginehook.core.rules.SchedulingRules` field, by default
``first_turn_head_start_s``) swept over a list of values, then one fairer point
(``--fair-end``, by default new programs ahead of pinned returning turns too). A peer's
point is *covered* when some point of the curve is at or below it on both axes (no longer
a wait, no longer a mean JCT) on the means over the seeds, and *covered within noise* when
some point's paired verdicts over the seeds (``cachettl bench seeds``'s) are not *worse*
on either axis. Writes ``OUT.md`` (a table per workload and load, with
the covered column), ``OUT.json`` and ``OUT.png`` (one panel per workload and load).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enginehook.core.rules import SchedulingRules
from simulator.studies.seeds import paired
from simulator.studies.study import PEERS, WORKLOADS, Study, output_path, study_arguments

__all__ = ["FAIR_END", "POINTS", "covered", "covered_within_noise", "register"]

#: The curve's fairest point: new programs' first turns ahead of pinned returning turns too.
FAIR_END = "first_turn_over_pins=1"

#: Seeds below which no paired verdict is called (a sign test over 5 seeds never reaches
#: p < 0.05), so the within-noise column says so instead.
MIN_VERDICT_SEEDS = 6

#: Every policy drawn as a point.
POINTS = ("vllm", "autellix", "continuum-preview", "continuum", *PEERS)


def covered(point: tuple[float, float], curve: Sequence[tuple[float, float]]) -> bool:
    """Whether some ``(wait, mean JCT)`` of ``curve`` is at or below ``point`` on both axes.

    >>> covered((2.0, 100.0), [(1.0, 120.0), (2.0, 99.0)]), covered((0.5, 100.0), [(1.0, 90.0)])
    (True, False)
    """
    wait, jct = point
    return any(w <= wait and j <= jct for w, j in curve)


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench frontier``."""
    parser = bench.add_parser(
        "frontier", help="mean JCT vs new programs' first-turn wait, cachettl's knob swept"
    )
    parser.add_argument("--workloads", default="swe,bfcl", help=f"of: {', '.join(WORKLOADS)}")
    parser.add_argument("--loads", default="1,1.2", help="multiples of vLLM's slowdown-3 load")
    parser.add_argument("--programs", type=int, default=200, help="programs per run")
    parser.add_argument("--seeds", default="10,11,12", help="seeds each point is averaged over")
    parser.add_argument(
        "--knob", default="first_turn_head_start_s", help="the SchedulingRules field swept"
    )
    parser.add_argument("--values", default="0,15,60,inf", help="the knob's values")
    parser.add_argument(
        "--fair-end",
        default=FAIR_END,
        help="cachettl settings (key=value,...) of one more curve point past the knob's values "
        "(empty: none)",
    )
    parser.add_argument(
        "--extra",
        default="",
        help="more curve points: cachettl settings (key=value,...) separated by ';', each "
        "drawn after the knob's values and the fair end",
    )
    parser.add_argument("--policy", default=",".join(POINTS), help="the policies drawn as points")
    parser.add_argument("--cpu-tier-tokens", type=int, default=0, help="host KV tier (0: none)")
    parser.add_argument("--out", default="results/frontier", help="OUT.md/.json/.png")
    parser.set_defaults(handler=_frontier)


def _frontier(args: argparse.Namespace) -> int:
    from simulator.policies import get_scheduling_policy
    from simulator.studies.report import parse_policies

    seeds, loads, names = study_arguments(args)
    if args.knob not in SchedulingRules.names():
        raise ValueError(f"--knob must be a rule: {', '.join(SchedulingRules.names())}")
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    SchedulingRules.parse({args.knob: values[0]})  # a bad value fails before any run
    points = parse_policies(args.policy)
    curve = [f"cachettl({args.knob}={v})" for v in values]
    fair_end = args.fair_end.strip()
    if fair_end:
        curve.append(f"cachettl({fair_end})")
        get_scheduling_policy(curve[-1])  # a bad setting fails before any run
    extra = [e.strip() for e in args.extra.split(";") if e.strip()]
    for settings in extra:
        curve.append(f"cachettl({settings})")
        get_scheduling_policy(curve[-1])
    study = Study(args.programs, seeds, cpu_tier_tokens=args.cpu_tier_tokens)
    command = (
        f"cachettl bench frontier --workloads {args.workloads} --loads {args.loads} "
        f"--programs {args.programs} --seeds {args.seeds} --knob {args.knob} "
        f"--values {args.values}"
        + (f" --fair-end {shlex.quote(fair_end)}" if fair_end != FAIR_END else "")
        + (f" --cpu-tier-tokens {args.cpu_tier_tokens}" if args.cpu_tier_tokens else "")
        + (f" --extra {shlex.quote(';'.join(extra))}" if extra else "")
        + (f" --policy {args.policy}" if args.policy != ",".join(POINTS) else "")
    )
    lines = ["# Frontier (generated by `cachettl bench frontier`)", "", f"Command: `{command}`", ""]
    summary: dict[str, Any] = {"command": command, "panels": {}}
    for name in names:
        rate = study.rate(name)
        for factor in loads:
            runs = study.per_seed(name, rate * factor, [*points, *curve])
            res = {spec: _means(rows) for spec, rows in runs.items()}
            panel = f"{name} {factor:g}×"
            summary["panels"][panel] = {"rate": rate * factor, "results": res, "per_seed": runs}
            lines += _panel(panel, rate * factor, res, points, curve, runs)
    md, png = output_path(args.out, ".md"), output_path(args.out, ".png")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines) + "\n")
    output_path(args.out, ".json").write_text(json.dumps(summary, indent=1) + "\n")
    _plot(png, summary["panels"], points, curve, args.knob)
    print(f"wrote {md} and {png}")
    return 0


def _means(rows: Sequence[tuple[float, float, float]]) -> list[float]:
    return [math.fsum(column) / len(column) for column in zip(*rows, strict=True)]


def covered_within_noise(
    peer: Sequence[tuple[float, float, float]], ours: Sequence[tuple[float, float, float]]
) -> bool:
    """Whether ``ours`` (per seed: mean JCT, P99 JCT, first-turn wait P90) is not worse
    than ``peer`` on mean JCT nor on first-turn wait P90, each by the paired verdict of
    ``cachettl bench seeds`` over the same seeds.

    >>> peer = [(100.0 + k, 0.0, 5.0) for k in range(8)]
    >>> covered_within_noise(peer, [(99.0 + k, 0.0, 5.0) for k in range(8)])
    True
    >>> covered_within_noise(peer, [(90.0 + k, 0.0, 6.0 + k) for k in range(8)])
    False
    """
    return all(
        paired([o[i] for o in ours], [p[i] for p in peer]).verdict != "worse" for i in (0, 2)
    )


def _panel(
    title: str,
    rate: float,
    res: dict[str, list[float]],
    points: Sequence[str],
    curve: Sequence[str],
    runs: dict[str, list[tuple[float, float, float]]],
) -> list[str]:
    tier = [(res[s][2], res[s][0]) for s in curve]
    verdicts = len(next(iter(runs.values()))) >= MIN_VERDICT_SEEDS
    lines = [
        f"### {title} ({rate:.4f} programs/s)",
        "",
        "| policy | mean JCT s | P99 JCT s | first-turn wait P90 s | covered by cachettl "
        "(means) | covered within noise (verdicts) |",
        "|---|---|---|---|---|---|",
    ]
    for spec in [*points, *curve]:
        mean, p99, wait = res[spec]
        mark = noise = ""
        if spec not in curve:
            by = [c for c, t in zip(curve, tier, strict=True) if covered((wait, mean), [t])]
            mark = f"yes: {', '.join(f'`{c}`' for c in by)}" if by else "**no**"
            if verdicts:
                near = [c for c in curve if covered_within_noise(runs[spec], runs[c])]
                noise = f"yes: {', '.join(f'`{c}`' for c in near)}" if near else "**no**"
            else:
                noise = f"fewer than {MIN_VERDICT_SEEDS} seeds: no verdict"
        lines.append(f"| {spec} | {mean:.1f} | {p99:.1f} | {wait:.1f} | {mark} | {noise} |")
    return [*lines, ""]


def _plot(
    path: Path,
    panels: dict[str, Any],
    points: Sequence[str],
    curve: Sequence[str],
    knob: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(panels)
    cols = min(count, 2)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, (title, panel) in zip(axes.flat, panels.items(), strict=False):
        res = panel["results"]
        for spec in points:
            mean, _, wait = res[spec]
            ax.scatter([max(wait, 0.05)], [mean], label=spec, marker="s" if spec in PEERS else "o")
        xs = [max(res[s][2], 0.05) for s in curve]
        ax.scatter(xs, [res[s][0] for s in curve], c="k", marker="^", s=18)
        front = sorted(
            (x, res[s][0])
            for s, x in zip(curve, xs, strict=True)
            if not any(
                res[o][2] <= res[s][2] and res[o][0] <= res[s][0] and res[o] != res[s]
                for o in curve
            )
        )
        ax.plot(
            [f[0] for f in front],
            [f[1] for f in front],
            "k-",
            label=f"cachettl: every setting (^), its non-dominated ones joined ({knob} swept)",
        )
        for spec, x in zip(curve, xs, strict=True):
            swept = spec.startswith(f"cachettl({knob}=")
            label = spec.split("=", 1)[1].rstrip(")") if swept else spec[9:-1]
            offset = (0, 6) if swept else (0, -11)
            ax.annotate(
                label, (x, res[spec][0]), xytext=offset, textcoords="offset points", fontsize=6
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("new programs' first-turn wait P90 (s)")
        ax.set_ylabel("mean JCT (s)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
