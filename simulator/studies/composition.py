"""A program-aware admission scheduler alone against the same scheduler with ``cachettl``'s
retention, seed by seed (``cachettl bench composition``).

Each pair is what ``cachettl bench seeds --policy COMPOSED --against SCHEDULER`` compares;
here every policy of every pair runs once per seed on the same trace (the seeds command
would run each pair's trace again), and each pair's verdicts are written in that
command's format to ``OUT_<scheduler>_<workload>_<load>.md/.json``, with the ``bench
seeds`` command that gives the same figures.

The compositions (:data:`PAIRS`): the user's admission scheduler stays as it is, the
retention (pins, their expiry and pressure rule, and the queue order of the engine behind
the scheduler where the scheduler leaves that order to vLLM) is ``cachettl``'s:

* llm-d's program-aware fairness *is* an order (least attained service per session): it
  stays, ``cachettl(ordering=las)``; under that order a pinned program's returning turn
  waits behind programs with less service while its pin, kept past expiry because its
  request waits, holds KV that waiting turns may not release (the ``running`` pressure
  rule), so ``llmd-fairness-pinned`` puts live pins first and keeps llm-d's order after
  them, ``cachettl(ordering=pinned-las)`` (admitting a pinned turn takes no new KV);
* ThunderAgent and AgentInfer admit whole programs in front of an unmodified vLLM, whose
  FCFS queue is vLLM's, not theirs: behind them the engine runs ``cachettl`` whole,
  ``cachettl(admission=thunderagent)`` and ``cachettl-agentinfer``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from typing import Any

from simulator.studies import provenance
from simulator.studies.report import parse_policies
from simulator.studies.seeds import _markdown, _summary, parse_seeds
from simulator.studies.study import Study, output_path

__all__ = ["PAIRS", "register"]

#: scheduler name -> (the scheduler alone, the scheduler with cachettl's retention)
PAIRS: dict[str, tuple[str, str]] = {
    "llmd-fairness": ("llmd-fairness", "cachettl(ordering=las)"),
    "llmd-fairness-pinned": ("llmd-fairness", "cachettl(ordering=pinned-las)"),
    "thunderagent": ("thunderagent", "cachettl(admission=thunderagent)"),
    "agentinfer": ("agentinfer", "cachettl-agentinfer"),
}


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench composition``."""
    parser = bench.add_parser(
        "composition",
        help="program-aware admission schedulers alone against each with cachettl's retention",
    )
    parser.add_argument("--workload", required=True)
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--seeds", default="20-35")
    parser.add_argument("--load", type=float, required=True, help="written in the file")
    parser.add_argument(
        "--rate",
        type=float,
        help="programs/s (default: the load times vLLM's slowdown-3 rate, found over the seeds)",
    )
    parser.add_argument("--schedulers", default="llmd-fairness,thunderagent,agentinfer")
    parser.add_argument("--extra", default="", help="more policies run per seed (in the JSON)")
    parser.add_argument("--out", default="results/composition")
    parser.set_defaults(handler=_composition)


def _composition(args: argparse.Namespace) -> int:
    seeds = parse_seeds(args.seeds)
    names = [s for s in args.schedulers.split(",") if s]
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        raise ValueError(f"--schedulers: unknown {unknown}; known: {', '.join(PAIRS)}")
    specs = [spec for name in names for spec in PAIRS[name]]
    specs += [s for s in parse_policies(args.extra) if s not in specs] if args.extra else []
    parse_policies(",".join(specs))
    started = provenance.load_now()
    clock = time.monotonic()
    study = Study(args.programs, seeds)
    rate = args.rate if args.rate is not None else study.rate(args.workload) * args.load
    runs = study.per_seed(args.workload, rate, specs)
    elapsed = time.monotonic() - clock
    made = provenance.current("cachettl bench composition " + _arguments(args), started)
    for name in names:
        _write_pair(args, name, seeds, rate, runs, elapsed, made)
    print(f"{args.workload} {args.load:g}: {elapsed:.0f} s for {len(specs)} policies")
    return 0


def _arguments(args: argparse.Namespace) -> str:
    """The command's arguments as given (``--rate`` only when it was)."""
    words = ["--workload", args.workload, "--load", f"{args.load:g}"]
    if args.rate is not None:
        words += ["--rate", f"{args.rate:g}"]
    words += ["--programs", str(args.programs), "--seeds", args.seeds]
    words += ["--schedulers", args.schedulers] + (["--extra", args.extra] if args.extra else [])
    return shlex.join([*words, "--out", args.out])


def _write_pair(
    args: argparse.Namespace,
    name: str,
    seeds: list[int],
    rate: float,
    runs: dict[str, Any],
    elapsed: float,
    made: dict[str, Any],
) -> None:
    """One scheduler's verdicts in ``bench seeds``' format, stamped with the command."""
    alone, composed = PAIRS[name]
    ns = argparse.Namespace(
        workload=args.workload,
        programs=args.programs,
        seeds=args.seeds,
        rate=rate,
        load=None,
        cpu_tier_tokens=0,
        against=alone,
    )
    summary = _summary(
        ns, seeds, rate, None, composed, {composed: runs[composed], alone: runs[alone]}
    )
    summary["load"] = args.load
    summary["scheduler"] = name
    summary["wall_s_all_policies"] = round(elapsed, 1)
    summary["all_runs"] = runs
    out = f"{args.out}_{name}_{args.workload}_{args.load:g}"
    md = output_path(out, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(_markdown(summary)) + "\n")
    output_path(out, ".json").write_text(json.dumps(summary, indent=1) + "\n")
    for path in (md, output_path(out, ".json")):
        provenance.stamp(path, made)
    for row in summary["comparisons"]:
        print(
            f"{name} {args.workload} {args.load:g} {row['metric']}: "
            f"{row['wins']}/{row['ties']}/{row['losses']} {row['mean_diff']:+.2f} "
            f"{row['verdict']}"
        )
