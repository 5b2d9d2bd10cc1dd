"""``cachettl bench learning``: how the estimator learns on workloads it was not tuned on.

Two measurements in one run:

* **Families** (simulator/families.py): per family, mean JCT / P99 / first-turn wait P90
  of ``cachettl``, ``oracle`` (true durations), ``vllm`` and the peers at the load where
  vLLM's mean slowdown reaches 3 (and at the other ``--loads``), averaged over the seeds,
  with each policy's mean JCT over the oracle's.
* **Adaptation after a step change** (:mod:`simulator.studies.adaptation`), replayed on
  the estimator alone.

Writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from simulator.families import FAMILIES
from simulator.studies.adaptation import FLOOR, LEARNERS, adaptation, markdown_curves
from simulator.studies.seeds import parse_seeds
from simulator.studies.study import PEERS, Study, output_path

__all__ = ["families_table", "register"]

#: Policies of the families' table besides the peers (``oracle`` is the reference).
TABLE = ("cachettl", "oracle", "vllm", "continuum", "continuum-preview", *PEERS)


def families_table(
    families: Sequence[str], loads: Sequence[float], programs: int, seeds: Sequence[int]
) -> dict[str, Any]:
    """family -> {rate, target, loads, rows: spec -> per load [mean JCT, P99, wait P90]}.
    Where think time dominates a program's time vLLM's slowdown may never reach 3: the
    reference load is then where it reaches the first of :data:`TARGETS` it does."""
    out: dict[str, Any] = {}
    for family in families:
        study, rate = _reference(family, programs, seeds)
        rows: dict[str, list[list[float]]] = {spec: [] for spec in TABLE}
        for factor in loads:
            measured = study.measure(family, rate * factor, TABLE)
            for spec in TABLE:
                rows[spec].append(measured[spec])
        out[family] = {
            "rate_slowdown_3": rate,
            "target": study.target,
            "loads": list(loads),
            "rows": rows,
        }
        ratio = rows["cachettl"][0][0] / rows["oracle"][0][0]
        print(f"{family}: cachettl / oracle {ratio:.3f} at load {loads[0]:g}", file=sys.stderr)
    return out


#: vLLM mean slowdowns a family's reference load is sought at, in turn.
TARGETS = (3.0, 2.0, 1.5)


def _reference(family: str, programs: int, seeds: Sequence[int]) -> tuple[Study, float]:
    for target in TARGETS:
        study = Study(programs, seeds, target=target)
        try:
            return study, study.rate(family)
        except ValueError:
            print(f"{family}: vLLM never reaches slowdown {target:g}", file=sys.stderr)
    raise ValueError(f"{family}: vLLM reaches none of the slowdowns {TARGETS}")


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench learning``."""
    parser = bench.add_parser(
        "learning", help="families: cachettl against the oracle; adaptation after a step change"
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--loads", default="1,1.2", help="multiples of vLLM's slowdown-3 load")
    parser.add_argument("--programs", type=int, default=100, help="programs per run")
    parser.add_argument("--seeds", default="1000-1003", help="integers and ranges a-b")
    parser.add_argument("--factor", type=float, default=6.0, help="the step change's factor")
    parser.add_argument("--pre", type=int, default=2000, help="calls learned before the change")
    parser.add_argument("--horizon", type=int, default=60, help="samples per key after it")
    parser.add_argument("--replicates", type=int, default=16, help="runs of the adaptation")
    every = (*LEARNERS, FLOOR)
    parser.add_argument("--learners", default=",".join(every), help=f"of: {', '.join(every)}")
    parser.add_argument("--skip-families", action="store_true", help="only the adaptation")
    parser.add_argument("--out", default="results/learning", help="writes OUT.md/.json")
    parser.set_defaults(handler=_learning)


def _check(args: argparse.Namespace) -> tuple[list[str], list[float], list[str]]:
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"--families: unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        raise ValueError(f"--loads must list numbers, got {args.loads!r}") from None
    if not loads or not all(f > 0 for f in loads):
        raise ValueError(f"--loads must be positive, got {args.loads!r}")
    learners = [x.strip() for x in args.learners.split(",")]
    for learner in learners:
        if learner not in LEARNERS and learner != FLOOR:
            raise ValueError(f"--learners: unknown learner {learner!r}")
    for flag, value in (
        ("--programs", args.programs),
        ("--pre", args.pre),
        ("--horizon", args.horizon),
        ("--replicates", args.replicates),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(args.factor) and args.factor > 0):
        raise ValueError(f"--factor must be a positive number, got {args.factor}")
    return families, loads, learners


def _learning(args: argparse.Namespace) -> int:
    families, loads, learners = _check(args)
    seeds = parse_seeds(args.seeds)
    curves = adaptation(args.factor, args.pre, args.horizon, args.replicates, learners)
    table = {} if args.skip_families else families_table(families, loads, args.programs, seeds)
    command = (
        f"cachettl bench learning --families {','.join(families)} --loads {args.loads} "
        f"--programs {args.programs} --seeds {args.seeds} --factor {args.factor:g} "
        f"--pre {args.pre} --horizon {args.horizon} --replicates {args.replicates}"
        + (" --skip-families" if args.skip_families else "")
    )
    summary = {
        "command": command,
        "seeds": seeds,
        "factor": args.factor,
        "families": table,
        "adaptation": {
            label: {
                key: {
                    "samples_to_adapt": c.samples_to_adapt,
                    "median_error": c.errors,
                    "share_within": c.within,
                }
                for key, c in by_key.items()
            }
            for label, by_key in curves.items()
        },
    }
    md = output_path(args.out, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join([*_markdown_families(command, table), *markdown_curves(args, curves)]))
    output_path(args.out, ".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {md}")
    return 0


def _markdown_families(command: str, table: dict[str, Any]) -> list[str]:
    lines = [
        "# Learning on workloads nothing was tuned on (generated by `cachettl bench learning`)",
        "",
        f"Command: `{command}`",
        "",
    ]
    if not table:
        return lines
    lines += [
        "## Families: mean JCT over the oracle's",
        "",
        "Each cell: mean JCT / oracle's mean JCT, then mean JCT / P99 / first-turn wait P90 "
        "(s), averaged over the seeds; 8B/H100.",
        "",
    ]
    for family, res in table.items():
        cells = [f"{f:g}× ({res['rate_slowdown_3'] * f:.4f}/s)" for f in res["loads"]]
        note = f" (load: multiples of where vLLM's mean slowdown reaches {res['target']:g})"
        lines += [f"### {family}{note}", "", "| policy | " + " | ".join(cells) + " |"]
        lines.append("|---|" + "---|" * len(cells))
        oracle = res["rows"]["oracle"]
        for spec, per_load in res["rows"].items():
            text = [
                f"{m[0] / o[0]:.3f} · " + " / ".join(f"{v:.1f}" for v in m)
                for m, o in zip(per_load, oracle, strict=True)
            ]
            lines.append(f"| {spec} | " + " | ".join(text) + " |")
        lines.append("")
    return lines
