"""``cachettl bench policies`` (load sweeps, turn scaling, ablation: PNG curves and a
markdown report) and ``cachettl bench simulator`` (wall time of the simulator itself)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from estimator import DEFAULT_PROFILE
from simulator.engine import EngineConfig
from simulator.metrics import isolated_jct
from simulator.sim import simulate
from simulator.studies.report import parse_policies, run_policies
from simulator.trace import Program, redraw_arrivals
from simulator.workloads import generate

__all__ = ["doubling_rate", "rate_for_slowdown", "register"]

SWEEP_POLICIES = "vllm,autellix,infercept,continuum-preview,continuum,cachettl,oracle"
ABLATION = (
    "vllm",
    "program-fcfs",
    "static-ttl",
    "continuum",
    "continuum(pressure=running)",
)
LOAD_FACTORS = (0.75, 0.9, 1.0, 1.05, 1.1, 1.2)


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench policies`` and ``bench simulator``."""
    parser = bench.add_parser("policies", help="JCT-vs-load curves, turn scaling, ablation")
    parser.add_argument("--workloads", default="swe,bfcl")
    parser.add_argument(
        "--hardware", default="llama3.1-8b-h100,llama3.1-8b-a100,llama3.1-70b-h100-tp4"
    )
    parser.add_argument("--policy", default=SWEEP_POLICIES, help="policies of the load sweep")
    parser.add_argument("--programs", type=int, default=200, help="programs per run")
    parser.add_argument("--seeds", default="0,1,2", help="seeds each figure is averaged over")
    parser.add_argument("--studies", default="load,turns,ablation", help="which studies to run")
    parser.add_argument("--out-dir", default="simulator/results", help="where figures go")
    parser.set_defaults(handler=_policies)
    speed = bench.add_parser("simulator", help="wall time to simulate N programs (one policy)")
    speed.add_argument("--policy", default="continuum")
    speed.add_argument("--programs", default="125,250,500,1000")
    speed.add_argument(
        "--rate", type=float, default=0.05, help="programs/s (about vLLM's doubling load)"
    )
    speed.add_argument("--json", action="store_true")
    speed.set_defaults(handler=_speed)


def _slowdown(
    traces: Sequence[tuple[Sequence[Program], dict[str, float], int]],
    rate: float,
    hw: str,
    policy: str = "vllm",
    config: EngineConfig | None = None,
) -> float:
    """``policy``'s mean slowdown at ``rate``, averaged over ``(programs, isolated, seed)``."""
    total = 0.0
    for programs, iso, seed in traces:
        result = simulate(redraw_arrivals(programs, rate, seed), policy, hw, config)
        values = [p.jct_s / iso[p.program_id] for p in result.programs]
        total += math.fsum(values) / len(values)
    return total / len(traces)


def rate_for_slowdown(
    traces: Sequence[tuple[Sequence[Program], dict[str, float], int]],
    hardware: str,
    target: float = 2.0,
    policy: str = "vllm",
    config: EngineConfig | None = None,
) -> float:
    """The load (programs/s) at which ``policy``'s mean slowdown over the isolated run
    (averaged over the traces) reaches ``target``, by bracketing and bisection (7 halvings:
    about 1 % of the rate), on an engine set up as ``config``."""
    if not target > 1.0:
        raise ValueError(f"target slowdown must be > 1, got {target}")
    low, high = 0.0, 0.01
    while _slowdown(traces, high, hardware, policy, config) < target:
        low, high = high, high * 2.0
        if high > 100:
            raise ValueError(f"{policy} never reaches slowdown {target} below 100 programs/s")
    for _ in range(7):
        middle = (low + high) / 2.0
        if _slowdown(traces, middle, hardware, policy, config) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0


def doubling_rate(
    traces: Sequence[tuple[Sequence[Program], dict[str, float], int]], hardware: str
) -> float:
    """The load at which vLLM's mean JCT doubles (slowdown 2)."""
    return rate_for_slowdown(traces, hardware, 2.0, "vllm")


def _plot(path: Path, title: str, rates: list[float], curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in curves.items():
        ax.plot(rates, values, marker="o", label=name)
    ax.set_xlabel("load (programs/s)")
    ax.set_ylabel("mean JCT (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Runs:
    """Traces and isolated runs per (workload, seed, hardware, turn scale), made once."""

    def __init__(self, programs: int, seeds: Sequence[int]) -> None:
        self.programs = programs
        self.seeds = seeds
        self._base: dict[tuple[str, int, int], list[Program]] = {}
        self._iso: dict[tuple[str, int, str, int], dict[str, float]] = {}
        self._doubling: dict[tuple[str, str], float] = {}

    def base(self, workload: str, seed: int, scale: int = 1) -> list[Program]:
        key = (workload, seed, scale)
        if key not in self._base:
            self._base[key] = generate(workload, self.programs, seed=seed, turn_scale=scale)
        return self._base[key]

    def isolated(self, workload: str, seed: int, hw: str, scale: int = 1) -> dict[str, float]:
        key = (workload, seed, hw, scale)
        if key not in self._iso:
            self._iso[key] = isolated_jct(self.base(workload, seed, scale), hw, EngineConfig())
        return self._iso[key]

    def mean_jct(
        self,
        workload: str,
        hw: str,
        rate: float,
        policies: Sequence[str],
        config: EngineConfig | None = None,
        scale: int = 1,
    ) -> dict[str, float]:
        """Each policy's mean JCT, averaged over the seeds."""
        totals = dict.fromkeys(policies, 0.0)
        for seed in self.seeds:
            trace = redraw_arrivals(self.base(workload, seed, scale), rate, seed)
            iso = self.isolated(workload, seed, hw, scale)
            res = run_policies(trace, policies, hw, config or EngineConfig(), isolated=iso)
            for p in policies:
                totals[p] += res[p].mean_jct_s / len(self.seeds)
        return totals

    def doubling(self, workload: str, hw: str) -> float:
        key = (workload, hw)
        if key not in self._doubling:
            traces = [
                (self.base(workload, s), self.isolated(workload, s, hw), s) for s in self.seeds
            ]
            self._doubling[key] = doubling_rate(traces, hw)
        return self._doubling[key]


def _load_study(
    args: argparse.Namespace, runs: _Runs, out: Path, lines: list[str]
) -> dict[str, object]:
    policies = parse_policies(args.policy)
    summary: dict[str, object] = {}
    for workload in args.workloads.split(","):
        for hw in args.hardware.split(","):
            r2 = runs.doubling(workload, hw)
            rates = [round(r2 * f, 4) for f in LOAD_FACTORS]
            curves: dict[str, list[float]] = {p: [] for p in policies}
            lines += [
                f"### {workload} on {hw}",
                "",
                f"vLLM's mean JCT doubles (slowdown 2) at {r2:.4f} programs/s.",
                "",
            ]
            table = ["| load | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
            for rate in rates:
                jct = runs.mean_jct(workload, hw, rate, policies)
                for p in policies:
                    curves[p].append(jct[p])
                cells = [f"{jct[p]:.0f}" for p in policies]
                table.append(f"| {rate:.4f} | " + " | ".join(cells) + " |")
                print(f"{workload} {hw} {rate:.4f} " + " ".join(cells), file=sys.stderr)
            png = out / f"jct_{workload}_{hw}.png"
            _plot(png, f"{workload} · {hw}", rates, curves)
            lines += ["Mean JCT (s) per policy:", "", *table, "", f"![{png.name}]({png.name})", ""]
            summary[f"{workload}/{hw}"] = {"doubling_rate": r2, "rates": rates, "mean_jct": curves}
    return summary


def _turns_study(runs: _Runs, lines: list[str]) -> dict[str, object]:
    hw = DEFAULT_PROFILE
    rate = runs.doubling("swe", hw)
    policies = ("vllm", "continuum", "cachettl")
    lines += [
        f"### Turn scaling (SWE-shaped, 8B/H100, {rate:.4f} programs/s = vLLM's doubling "
        "load at 1×; mean JCT s)",
        "",
        "| turn scale | mean turns | CPU tier | vllm | continuum | vllm/continuum "
        "| cachettl | vllm/cachettl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out: dict[str, object] = {}
    for cpu in (0, 1_500_000):
        config = EngineConfig(cpu_tier_tokens=cpu)
        for scale in (1, 2, 3, 4, 5):
            jct = runs.mean_jct("swe", hw, rate, policies, config, scale)
            base = runs.base("swe", runs.seeds[0], scale)
            turns = sum(len(p.turns) for p in base) / len(base)
            ratio = jct["vllm"] / jct["continuum"]
            ours = jct["vllm"] / jct["cachettl"]
            tier = "200 GB" if cpu else "none"
            lines.append(
                f"| {scale}× | {turns:.1f} | {tier} | {jct['vllm']:.0f} | "
                f"{jct['continuum']:.0f} | {ratio:.2f}× | {jct['cachettl']:.0f} | {ours:.2f}× |"
            )
            out[f"{scale}x/cpu={cpu}"] = {"vllm/continuum": ratio, "vllm/cachettl": ours}
            print(f"turns {scale}x cpu={cpu}: vllm/continuum {ratio:.2f}", file=sys.stderr)
    lines.append("")
    return out


def _ablation_study(runs: _Runs, lines: list[str]) -> dict[str, object]:
    hw = DEFAULT_PROFILE
    out: dict[str, object] = {}
    for workload in ("swe", "bfcl"):
        r2 = runs.doubling(workload, hw)
        lines += [
            f"### Ablation ({workload}, 8B/H100; mean JCT s)",
            "",
            "| load | " + " | ".join(ABLATION) + " |",
            "|---|" + "---|" * len(ABLATION),
        ]
        for factor in (1.0, 1.1, 1.2):
            jct = runs.mean_jct(workload, hw, round(r2 * factor, 4), ABLATION)
            cells = [f"{jct[p]:.0f}" for p in ABLATION]
            lines.append(f"| {r2 * factor:.4f} | " + " | ".join(cells) + " |")
            out[f"{workload}/{factor}"] = jct
        lines.append("")
    return out


def _policies(args: argparse.Namespace) -> int:
    parse_policies(args.policy)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise ValueError(f"--seeds must list integers, got {args.seeds!r}") from None
    if args.programs < 1:
        raise ValueError(f"--programs must be >= 1, got {args.programs}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    studies = set(args.studies.split(","))
    unknown = studies - {"load", "turns", "ablation"}
    if unknown:
        raise ValueError(f"unknown studies {sorted(unknown)}; valid: ablation, load, turns")
    lines = [
        "# Policy comparison (generated by `cachettl bench policies`)",
        "",
        f"{args.programs} programs per run; each figure is the mean over seeds "
        f"{', '.join(map(str, seeds))}; the doubling load is where vLLM's slowdown, "
        "averaged over the same seeds, reaches 2.",
        "",
    ]
    summary: dict[str, object] = {}
    runs = _Runs(args.programs, seeds)
    if "load" in studies:
        summary["load"] = _load_study(args, runs, out, lines)
    if "turns" in studies:
        summary["turns"] = _turns_study(runs, lines)
    if "ablation" in studies:
        summary["ablation"] = _ablation_study(runs, lines)
    (out / "policies.md").write_text("\n".join(lines) + "\n")
    (out / "policies.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / 'policies.md'}")
    return 0


def _speed(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.programs.split(",")]
    if any(c < 1 for c in counts):
        raise ValueError("--programs must list positive integers")
    parse_policies(args.policy)
    rows = []
    for n in counts:
        programs = generate("swe", n, rate=args.rate, seed=0)
        start = time.process_time()
        result = simulate(programs, args.policy)
        wall = time.process_time() - start
        rows.append(
            {"programs": n, "cpu_s": wall, "per_program_ms": 1000 * wall / n, "steps": result.steps}
        )
    if args.json:
        print(json.dumps({"policy": args.policy, "rate": args.rate, "runs": rows}))
        return 0
    base = rows[0]["per_program_ms"]
    print(f"policy {args.policy}, SWE-shaped, {args.rate} programs/s, 8B/H100 (CPU seconds)")
    for row in rows:
        print(
            f"{row['programs']:6d} programs  {row['cpu_s']:7.2f} s  "
            f"{row['per_program_ms']:6.2f} ms/program  ({row['per_program_ms'] / base:.2f}× "
            f"the smallest run's per-program cost)  steps {row['steps']}"
        )
    return 0
