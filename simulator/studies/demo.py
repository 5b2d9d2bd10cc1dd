"""``cachettl demo``: a live control plane learns from two simulated agent workloads, side by
side, and the demo says where the learned TTL pays and where a fixed pin is as good.

1. Start the control plane (gRPC, port chosen by the OS) on an embedded SQLite database
   in a temporary directory (``--db`` keeps one), with one tenant per workload.
2. Replay each workload's trace through the simulator. Its engine asks the live control
   plane for every TTL (``TtlService.DecideTtl``) and reports every finished tool call with
   the chosen TTL, the pin's outcome and the next turn's admission delay
   (``ToolEventService.RecordToolCalls``) and every program end (``RecordProgramEnd``).
3. Show what the control plane learned (``InspectService``: per-tool distributions, the
   TTL it now gives each, η, T), the run against a fixed 2 s pin (the authors' preview,
   ``continuum-preview``) and stock vLLM on the same trace, and a verdict per workload over
   several seeds with ``cachettl bench seeds``' statistics (the in-process ``cachettl``: the
   same policy code the control plane runs). The verdict's command is printed, so the
   figures can be reproduced and extended to more seeds.

The two workloads:

* **SWE-shaped agents** (:data:`WORKLOADS` ``swe``): most tool calls return within a
  second, so any pin of a second or two catches them and a fixed 2 s pin is near the best
  there.
* **TraceLab-shaped coding sessions** (``tracelab``, simulator/families.py): reads and
  greps in milliseconds, test runs of ~14 s, builds of ~45 s, sub-agents of ~90 s and, after
  8 % of the calls, a person thinking for minutes. A fixed 2 s pin lets every slow call's
  cache go; the learned TTL holds it where a return is likely and lets it go where not.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from estimator import DEFAULT_PROFILE
from simulator.studies.live import RemotePolicy, learned_lines, running_control_plane

__all__ = ["WORKLOADS", "DemoWorkload", "register"]

#: The rivals: the authors' preview (a fixed 2 s pin) and stock vLLM.
BASELINES = "continuum-preview,vllm"

#: What each rival is, in the demo's words.
LABELS = {"continuum-preview": "fixed 2 s pin", "vllm": "stock vLLM", "cachettl": "cachettl"}

#: The sign test needs this many seeds, all won, to reach p < 0.05.
MIN_VERDICT_SEEDS = 6


@dataclass(frozen=True, slots=True)
class DemoWorkload:
    """One workload of the demo: a study workload (``cachettl bench seeds --workload``)."""

    name: str
    title: str
    about: str
    programs: int
    rate: float
    #: The context (tokens) at which the learned TTLs are shown.
    context_tokens: int


WORKLOADS = (
    DemoWorkload(
        "swe",
        "SWE-shaped agents",
        "Most tool calls return within a second (ls, cat, grep, sed), so any pin of a second "
        "or two catches them: a fixed 2 s pin is near the best here.",
        60,
        0.068,
        30_000,
    ),
    DemoWorkload(
        "tracelab",
        "TraceLab-shaped coding sessions",
        "Reads, edits and greps return in milliseconds; test runs take ~14 s, builds ~45 s, "
        "sub-agents ~90 s, and after 8 % of the calls a person thinks for minutes. A fixed "
        "2 s pin holds every call's cache for 2 s whether it comes back or not; the learned "
        "TTL is chosen per tool and invocation from the durations seen (below).",
        40,
        0.03,
        60_000,
    ),
)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cachettl demo``."""
    swe, long = WORKLOADS
    parser = commands.add_parser(
        "demo",
        help="live control plane + two simulated agent workloads: what it learns, and the "
        "learned TTL against a fixed 2 s pin and stock vLLM, with a verdict for each",
    )
    parser.add_argument(
        "--programs", type=int, default=swe.programs, help="SWE-shaped programs per seed"
    )
    parser.add_argument(
        "--rate", type=float, default=swe.rate, help="SWE-shaped program arrivals per second"
    )
    parser.add_argument(
        "--long-programs",
        type=int,
        default=long.programs,
        help="TraceLab-shaped programs per seed (tools of seconds to minutes)",
    )
    parser.add_argument(
        "--long-rate",
        type=float,
        default=long.rate,
        help="TraceLab-shaped program arrivals per second",
    )
    parser.add_argument("--seed", type=int, default=0, help="the live run's seed (the first)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=MIN_VERDICT_SEEDS,
        help=f"seeds of the verdict, from --seed on (< {MIN_VERDICT_SEEDS}: no verdict)",
    )
    parser.add_argument("--hardware", default=DEFAULT_PROFILE)
    parser.add_argument("--baselines", default=BASELINES, help="policies to compare against")
    parser.add_argument("--db", default=None, help="database URL (default: a temporary SQLite)")
    parser.set_defaults(handler=_run)


def _label(spec: str) -> str:
    return f"{LABELS[spec]} ({spec})" if spec in LABELS and spec != "cachettl" else spec


def _table(rows: dict[str, Any]) -> list[str]:
    lines = [
        f"    {'policy':34s} {'mean JCT s':>11s} {'P99 JCT s':>10s} "
        f"{'first-turn wait P90 s':>22s} {'prefix hits':>12s}"
    ]
    for name, m in rows.items():
        lines.append(
            f"    {name:34s} {m.mean_jct_s:11.1f} {m.p99_jct_s:10.1f} "
            f"{m.first_turn_wait_p90_s:22.2f} {m.prefix_hit_rate:11.0%}"
        )
    return lines


def _seeds_command(workload: DemoWorkload, seeds: list[int], rivals: list[str]) -> str:
    last = f"-{seeds[0] + max(len(seeds), MIN_VERDICT_SEEDS) - 1}"
    return (
        f"cachettl bench seeds --workload {workload.name} --programs {workload.programs} "
        f"--rate {workload.rate:g} --seeds {seeds[0]}{last} --policy cachettl "
        f"--against {','.join(rivals)}"
    )


def _verdicts(
    workload: DemoWorkload,
    seeds: list[int],
    rivals: list[str],
    hardware: str,
    first: dict[str, Any],
) -> tuple[list[str], dict[str, str]]:
    """Lines of the verdict over ``seeds`` and the mean-JCT verdict per rival (with the
    mean JCTs); ``first`` holds the rivals' figures on the first seed, already run."""
    from simulator.engine import EngineConfig
    from simulator.studies.report import run_policies
    from simulator.studies.seeds import paired
    from simulator.studies.study import workload_source
    from simulator.trace import redraw_arrivals

    command = _seeds_command(workload, seeds, rivals)
    if len(seeds) < MIN_VERDICT_SEEDS:
        return [
            f"  Verdict: none from {len(seeds)} seed(s) (the sign test needs "
            f"{MIN_VERDICT_SEEDS} or more); for one, run:",
            f"    {command}",
        ], {}
    source = workload_source(workload.name)
    specs = ["cachettl", *rivals]
    runs: dict[str, list[tuple[float, float]]] = {spec: [] for spec in specs}
    for seed in seeds:  # as `cachettl bench seeds` draws them (Study.per_seed)
        trace = redraw_arrivals(source(workload.programs, seed), workload.rate, seed)
        todo = ["cachettl", *(r for r in rivals if seed != seeds[0])]
        res = {**first, **run_policies(trace, todo, hardware, EngineConfig(), isolated={})}
        for spec in specs:
            runs[spec].append((res[spec].mean_jct_s, res[spec].first_turn_wait_p90_s))
    lines = [
        f"  Verdict over seeds {seeds[0]}-{seeds[-1]} (in-process cachettl, the policy code the "
        "control plane runs; reproduce with",
        f"    {command}):",
    ]
    mean = {spec: statistics.fmean(r[0] for r in runs[spec]) for spec in specs}
    said = "; ".join(f"{LABELS.get(spec, spec)} {mean[spec]:.1f} s" for spec in specs)
    lines.append(f"    mean JCT over the seeds: {said}")
    verdicts: dict[str, str] = {}
    for rival in rivals:
        parts = []
        for metric, i in (("mean JCT", 0), ("first-turn wait P90", 1)):
            r = paired([x[i] for x in runs["cachettl"]], [x[i] for x in runs[rival]])
            parts.append(
                f"{metric} {r.verdict.upper() if r.verdict != 'no difference' else r.verdict} "
                f"({r.wins} won / {r.ties} tied / {r.losses} lost, p = {r.sign_p:.3f}, "
                f"median ratio {r.median_ratio:.2f})"
            )
            if i == 0:
                ratio = mean["cachettl"] / mean[rival]
                verdicts[rival] = f"{_verdict_words(r.verdict)} the {LABELS.get(rival, rival)}"
                verdicts[rival] += f" ({ratio:.2f}x its mean JCT)"
        lines.append(f"    cachettl vs {LABELS.get(rival, rival)}: " + "; ".join(parts))
    return lines, verdicts


def _replay(
    workload: DemoWorkload,
    client: Any,
    seeds: list[int],
    rivals: list[str],
    hardware: str,
) -> tuple[list[str], dict[str, str]]:
    """Replay ``workload``'s first seed through the live control plane; the report's lines
    and the verdict against each rival."""
    from simulator.engine import EngineConfig
    from simulator.metrics import summarise
    from simulator.sim import Simulation
    from simulator.studies.report import run_policies
    from simulator.studies.study import workload_source
    from simulator.trace import redraw_arrivals

    seed = seeds[0]
    trace = redraw_arrivals(
        workload_source(workload.name)(workload.programs, seed), workload.rate, seed
    )
    config = EngineConfig()
    policy = RemotePolicy(client)
    remote = Simulation(trace, policy, hardware, config).run()
    lines = [
        f"== {workload.title}: {len(trace)} programs at {workload.rate:g}/s on {hardware} ==",
        f"  {workload.about}",
        f"  live run, seed {seed}: {policy.calls} gRPC calls to the control plane",
        "",
        *learned_lines(client, workload.context_tokens),
        "",
        f"  Seed {seed}, the same trace for every policy:",
    ]
    rows: dict[str, Any] = {"cachettl (live control plane)": summarise(remote, {})}
    first = run_policies(trace, rivals, hardware, config, isolated={})
    for name, m in first.items():
        rows[_label(name)] = m
    lines += [*_table(rows), ""]
    verdict_lines, verdicts = _verdicts(workload, seeds, rivals, hardware, first)
    return [*lines, *verdict_lines], verdicts


def _verdict_words(verdict: str) -> str:
    return {"better": "better than", "worse": "worse than"}.get(verdict, "no different from")


def _summary(
    workloads: Sequence[DemoWorkload], verdicts: list[dict[str, str]], seeds: int
) -> list[str]:
    lines = [f"== Where the learned TTL pays: cachettl's mean JCT over {seeds} seed(s) =="]
    for workload, verdict in zip(workloads, verdicts, strict=True):
        said = "; ".join(verdict.values()) or "no verdict (too few seeds)"
        lines.append(f"  {workload.title}: {said}")
    lines.append(
        "  (a verdict needs the seeds' sign test and bootstrap interval to agree at 5 %; "
        "more seeds: the commands above, e.g. --seeds 0-15)"
    )
    return lines


def _run(args: argparse.Namespace) -> int:
    from controlplane.rpc.client import ControlPlaneClient
    from simulator.studies.report import parse_policies

    for flag, value in (("--programs", args.programs), ("--long-programs", args.long_programs)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, rate in (("--rate", args.rate), ("--long-rate", args.long_rate)):
        if not rate > 0:
            raise ValueError(f"{flag} must be a positive number of programs per second, got {rate}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    rivals = parse_policies(args.baselines)
    if "cachettl" in rivals:
        raise ValueError("--baselines names cachettl, the policy compared")
    swe, long = WORKLOADS
    workloads = [
        DemoWorkload(**{**_fields(swe), "programs": args.programs, "rate": args.rate}),
        DemoWorkload(**{**_fields(long), "programs": args.long_programs, "rate": args.long_rate}),
    ]
    seeds = list(range(args.seed, args.seed + args.seeds))
    verdicts: list[dict[str, str]] = []
    with contextlib.ExitStack() as stack:
        db = args.db
        if db is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="cachettl-demo-"))
            db = f"sqlite:///{Path(folder) / 'cachettl.sqlite3'}"
        names = [w.name for w in workloads]
        target, tokens = stack.enter_context(running_control_plane(db, names))
        print(f"control plane on {target} ({db}), one tenant per workload: {', '.join(names)}")
        print()
        for workload in workloads:
            client = stack.enter_context(
                ControlPlaneClient(target, tokens[workload.name], timeout_s=30.0)
            )
            lines, verdict = _replay(workload, client, seeds, rivals, args.hardware)
            print("\n".join(lines), flush=True)
            print()
            verdicts.append(verdict)
    print("\n".join(_summary(workloads, verdicts, len(seeds))))
    return 0


def _fields(workload: DemoWorkload) -> dict[str, Any]:
    return {name: getattr(workload, name) for name in DemoWorkload.__dataclass_fields__}
