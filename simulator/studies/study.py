"""``cachettl bench ablation``: each improvement of ``cachettl`` alone on top of the paper,
all together, and the chosen defaults, against ``vllm``, ``continuum`` and ``oracle`` at
several loads (multiples of the load where vLLM's mean slowdown reaches 3), averaged over
seeds; plus robustness workloads (durations that shift mid-run, tools that take minutes,
many short tools, many tenants).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from estimator import DEFAULT_PROFILE
from simulator.engine import EngineConfig
from simulator.families import generate_family, is_family, parse_family, study_workloads
from simulator.metrics import PolicyMetrics, isolated_jct
from simulator.policies import BASE, IMPROVEMENTS
from simulator.studies.bench import rate_for_slowdown
from simulator.studies.report import run_policies
from simulator.trace import Program, redraw_arrivals
from simulator.workloads import generate

__all__ = [
    "PEERS",
    "UNLIMITED_KV",
    "WORKLOADS",
    "Study",
    "cachettl_spec",
    "output_path",
    "register",
    "seed_list",
    "variants",
    "workload_source",
]

HARDWARE = DEFAULT_PROFILE

#: The reference row: ``vllm`` on a KV pool nothing is ever evicted from, so every turn
#: hits its prefix and no request waits for memory. Only compute is shared; no retention
#: policy can beat it by more than what a different waiting-queue order buys.
UNLIMITED_KV = "vllm, unlimited KV"
_UNLIMITED_KV_TOKENS = 1 << 34
#: The peers (simulator/policies/peers.py, agentinfer.py and stock.py: vLLM 0.34's own
#: cache-aware admission window), in every table.
PEERS = ("thunderagent", "llmd-fairness", "sglang-session", "agentinfer", "vllm-cache-aware")


def cachettl_spec(settings: dict[str, Any]) -> str:
    """``cachettl(key=value,...)`` for a settings dict (enums by value, booleans 0/1).

    >>> cachettl_spec({"keys": "tool", "drift": False, "ttl_cap_s": float("inf")})
    'cachettl(keys=tool,drift=0,ttl_cap_s=inf)'
    """
    parts = []
    for key, value in settings.items():
        text = str(int(value)) if isinstance(value, bool) else str(getattr(value, "value", value))
        parts.append(f"{key}={text}")
    return f"cachettl({','.join(parts)})"


def variants(share: bool = False) -> list[tuple[str, str]]:
    """``(label, policy spec)``: baselines, the paper as ``cachettl``, each improvement
    alone, all together, and the defaults. Shared priors only where ``share`` (a
    multi-tenant workload)."""
    rows = [("vllm", "vllm"), ("continuum", "continuum"), *((p, p) for p in PEERS)]
    rows.append(("paper as cachettl (all off)", cachettl_spec(BASE)))
    together = dict(BASE)
    for label, on in IMPROVEMENTS.items():
        if on.get("share") and not share:
            continue
        rows.append((f"+ {label}", cachettl_spec({**BASE, **on})))
        together.update(on)
    rows.append(("all together", cachettl_spec(together)))
    rows += [("cachettl (defaults)", "cachettl"), ("oracle", "oracle")]
    rows.append((f"{UNLIMITED_KV} (no eviction)", UNLIMITED_KV))
    return rows


def _with_durations(
    programs: Sequence[Program], change: Callable[[int, int, float], float]
) -> list[Program]:
    """Programs whose tool durations are ``change(program index, turn index, duration)``."""
    out = []
    for i, program in enumerate(programs):
        turns = tuple(
            dataclasses.replace(t, tool_duration_s=change(i, k, t.tool_duration_s))
            if t.tool is not None
            else t
            for k, t in enumerate(program.turns)
        )
        out.append(dataclasses.replace(program, turns=turns))
    return out


def shifted(programs: Sequence[Program], factor: float = 8.0) -> list[Program]:
    """The second half of the programs (in arrival order) run every tool ``factor``×
    slower: a regime change mid-run (e.g. a bigger repository)."""
    half = len(programs) // 2
    return _with_durations(programs, lambda i, _k, d: d * factor if i >= half else d)


def minutes(programs: Sequence[Program], seed: int, share: float = 0.2) -> list[Program]:
    """A ``share`` of tool calls take minutes (log-uniform 60–600 s)."""
    rng = random.Random(f"minutes:{seed}")

    def change(_i: int, _k: int, d: float) -> float:
        return math.exp(rng.uniform(math.log(60.0), math.log(600.0))) if rng.random() < share else d

    return _with_durations(programs, change)


def short_tools(programs: Sequence[Program]) -> list[Program]:
    """Every tool 10× shorter (run on 3× as many turns: many short tools)."""
    return _with_durations(programs, lambda _i, _k, d: max(d / 10.0, 0.001))


def tenants(programs: Sequence[Program], count: int = 20) -> list[Program]:
    """Programs spread round-robin over ``count`` tenants (each learns on its own)."""
    return [dataclasses.replace(p, tenant=f"tenant-{i % count}") for i, p in enumerate(programs)]


#: name -> (programs, seed) -> trace (before arrivals are drawn).
WORKLOADS: dict[str, Callable[[int, int], list[Program]]] = {
    "swe": lambda n, s: generate("swe", n, seed=s),
    "bfcl": lambda n, s: generate("bfcl", n, seed=s),
    "swe-shift": lambda n, s: shifted(generate("swe", n, seed=s)),
    "swe-minutes": lambda n, s: minutes(generate("swe", n, seed=s), s),
    "swe-short": lambda n, s: short_tools(generate("swe", n, seed=s, turn_scale=3)),
    "swe-tenants": lambda n, s: tenants(generate("swe", n, seed=s)),
    **study_workloads(),  # the generalisation families (simulator/families.py)
}


def workload_source(name: str) -> Callable[[int, int], list[Program]]:
    """The ``(programs, seed) -> trace`` of a study workload: a name of
    :data:`WORKLOADS`, or a family with parameters (``step(factor=0.125)``)."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    if is_family(name):
        parse_family(name)  # a bad parameter is named here, before any run
        return lambda n, s: generate_family(name, n, s)
    raise ValueError(
        f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}, "
        "or a family with parameters such as step(factor=0.125)"
    )


class Study:
    """Traces, isolated runs and vLLM's slowdown-3 load per workload, made once."""

    def __init__(
        self, programs: int, seeds: Sequence[int], target: float = 3.0, cpu_tier_tokens: int = 0
    ) -> None:
        self.programs, self.seeds, self.target = programs, list(seeds), target
        #: The engine every run uses (``cpu_tier_tokens`` > 0: with a host-memory tier).
        self.config = EngineConfig(cpu_tier_tokens=cpu_tier_tokens)
        self._base: dict[tuple[str, int], list[Program]] = {}
        self._iso: dict[tuple[str, int], dict[str, float]] = {}
        self._rate: dict[str, float] = {}

    def base(self, workload: str, seed: int) -> list[Program]:
        source = workload_source(workload)
        key = (workload, seed)
        if key not in self._base:
            self._base[key] = source(self.programs, seed)
            self._iso[key] = isolated_jct(self._base[key], HARDWARE, EngineConfig())
        return self._base[key]

    def rate(self, workload: str) -> float:
        """The load where vLLM's mean slowdown, averaged over the seeds, reaches 3."""
        if workload not in self._rate:
            traces = [(self.base(workload, s), self._iso[(workload, s)], s) for s in self.seeds]
            self._rate[workload] = rate_for_slowdown(
                traces, HARDWARE, self.target, "vllm", self.config
            )
        return self._rate[workload]

    def measure(self, workload: str, rate: float, specs: Sequence[str]) -> dict[str, list[float]]:
        """Per spec: [mean JCT, P99 JCT, first-turn wait P90], averaged over the seeds.
        The spec :data:`UNLIMITED_KV` is ``vllm`` on a pool that never evicts."""
        runs = self.per_seed(workload, rate, specs)
        n = len(self.seeds)
        return {
            spec: [math.fsum(run[i] for run in runs[spec]) / n for i in range(3)] for spec in specs
        }

    def per_seed(
        self, workload: str, rate: float, specs: Sequence[str]
    ) -> dict[str, list[tuple[float, float, float]]]:
        """Per spec, per seed (in :attr:`seeds` order): (mean JCT, P99 JCT, first-turn wait
        P90), every spec on the same trace of each seed."""
        out: dict[str, list[tuple[float, float, float]]] = {spec: [] for spec in specs}
        policies = [spec for spec in specs if spec != UNLIMITED_KV]
        for seed in self.seeds:
            trace = redraw_arrivals(self.base(workload, seed), rate, seed)
            iso = self._iso[(workload, seed)]
            res: dict[str, PolicyMetrics] = run_policies(
                trace, policies, HARDWARE, self.config, isolated=iso
            )
            if UNLIMITED_KV in specs:
                unlimited = dataclasses.replace(self.config, kv_tokens=_UNLIMITED_KV_TOKENS)
                res[UNLIMITED_KV] = run_policies(
                    trace, ["vllm"], HARDWARE, unlimited, isolated=iso
                )["vllm"]
            for spec in specs:
                m = res[spec]
                out[spec].append((m.mean_jct_s, m.p99_jct_s, m.first_turn_wait_p90_s))
        return out


def _table(
    study: Study, workload: str, loads: Sequence[float], rows: list[tuple[str, str]]
) -> tuple[list[str], dict[str, Any]]:
    rate = study.rate(workload)
    rates = [rate * f for f in loads]
    cells = [f"{f:g}× ({r:.4f}/s)" for f, r in zip(loads, rates, strict=True)]
    tokens = study.config.cpu_tier_tokens
    tier = f", CPU tier of {tokens:,} tokens" if tokens else ""
    header = "| policy | " + " | ".join(cells) + " |"
    lines = [
        f"### {workload} (8B/H100{tier}; vLLM's mean slowdown reaches 3 at {rate:.4f} programs/s)",
        "",
        "Each cell: mean JCT / P99 JCT / new programs' first-turn wait P90 (s).",
        "",
        header,
        "|---|" + "---|" * len(loads),
    ]
    specs = [spec for _, spec in rows]
    results = [study.measure(workload, r, specs) for r in rates]
    for label, spec in rows:
        cells = [" / ".join(f"{v:.1f}" for v in res[spec]) for res in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        print(f"{workload} {label}: " + " | ".join(cells), file=sys.stderr)
    summary = {
        "rate_slowdown_3": rate,
        "loads": list(loads),
        "rows": {label: [res[spec] for res in results] for label, spec in rows},
        "specs": dict(rows),
    }
    return [*lines, ""], summary


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench ablation``."""
    parser = bench.add_parser(
        "ablation", help="each cachettl improvement alone and together; robustness workloads"
    )
    parser.add_argument("--workloads", default="swe,bfcl", help=f"of: {', '.join(WORKLOADS)}")
    parser.add_argument("--loads", default="0.8,1,1.2", help="multiples of vLLM's slowdown-3 load")
    parser.add_argument("--programs", type=int, default=200, help="programs per run")
    parser.add_argument("--seeds", default="0,1,2", help="seeds each figure is averaged over")
    parser.add_argument(
        "--policy", default="", help="instead of the ablation rows: these specs (and baselines)"
    )
    parser.add_argument(
        "--cpu-tier-tokens",
        type=int,
        default=0,
        help="host-memory KV tier of every engine, in tokens (0: none)",
    )
    parser.add_argument("--out", default="results/ablation", help="writes OUT.md/.json")
    parser.set_defaults(handler=_ablation)


def output_path(out: str, suffix: str) -> Path:
    """The file ``OUT`` + ``suffix`` of ``--out OUT``. A dot in the name stays (a load
    ``seeds_0.8`` is not a suffix to replace); an ``OUT`` already ending in one of the
    files' suffixes (``.md``, ``.json``, ``.png``) loses it first.

    >>> output_path("results/seeds_0.8", ".md").name, output_path("r/a.json", ".md").name
    ('seeds_0.8.md', 'a.md')
    """
    path = Path(out)
    if path.suffix in (".md", ".json", ".png"):
        path = path.with_suffix("")
    return path.with_name(path.name + suffix)


def seed_list(text: str) -> list[int]:
    """Seeds as a comma list of integers and ranges (``a-b`` includes both ends).

    >>> seed_list("0-3,7")
    [0, 1, 2, 3, 7]
    """
    seeds: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            first, dash, last = part.partition("-")
            seeds += range(int(first), int(last) + 1) if dash else [int(part)]
    except ValueError:
        raise ValueError(f"--seeds must list integers or ranges a-b, got {text!r}") from None
    return seeds


def study_arguments(args: argparse.Namespace) -> tuple[list[int], list[float], list[str]]:
    """``(seeds, loads, workloads)`` of a study command (``bench ablation``, ``bench
    frontier``), with ``--programs`` and ``--cpu-tier-tokens`` checked; errors name the flag."""
    seeds = seed_list(args.seeds)
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        raise ValueError(f"--loads must list numbers, got {args.loads!r}") from None
    if args.programs < 1 or not all(f > 0 for f in loads):
        raise ValueError("--programs must be >= 1 and --loads positive")
    names = args.workloads.split(",")
    for name in names:
        workload_source(name)
    if args.cpu_tier_tokens < 0:
        raise ValueError(f"--cpu-tier-tokens must be >= 0, got {args.cpu_tier_tokens}")
    return seeds, loads, names


def _ablation(args: argparse.Namespace) -> int:
    from simulator.studies.report import parse_policies

    seeds, loads, names = study_arguments(args)
    extra = parse_policies(args.policy) if args.policy else []
    study = Study(args.programs, seeds, cpu_tier_tokens=args.cpu_tier_tokens)
    lines = [
        "# cachettl ablation (generated by `cachettl bench ablation`)",
        "",
        f"Command: `cachettl bench ablation --workloads {args.workloads} --loads {args.loads} "
        f"--programs {args.programs} --seeds {args.seeds}"
        + (f" --policy '{args.policy}'" if args.policy else "")
        + (f" --cpu-tier-tokens {args.cpu_tier_tokens}" if args.cpu_tier_tokens else "")
        + "`",
        "",
    ]
    summary: dict[str, Any] = {}
    for name in names:
        if extra:
            base = ["vllm", "continuum", "oracle", *PEERS]
            rows = [(s, s) for s in dict.fromkeys([*base, *extra])]
            rows.append((f"{UNLIMITED_KV} (no eviction)", UNLIMITED_KV))
        else:
            rows = variants(share=name == "swe-tenants")
        table, summary[name] = _table(study, name, loads, rows)
        lines += table
    md = output_path(args.out, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines) + "\n")
    output_path(args.out, ".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {md}")
    return 0
