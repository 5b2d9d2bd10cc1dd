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

from simulator.engine import EngineConfig
from simulator.metrics import isolated_jct
from simulator.report import parse_policies, run_policies
from simulator.sim import simulate
from simulator.trace import Program, redraw_arrivals
from simulator.workloads import generate

__all__ = ["doubling_rate", "register"]

SWEEP_POLICIES = "vllm,autellix,infercept,continuum-preview,continuum,cachettl,oracle"
ABLATION = ("vllm", "program-fcfs", "static-ttl", "continuum")
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--studies", default="load,turns,ablation", help="which studies to run")
    parser.add_argument("--out-dir", default="simulator/results", help="where figures go")
    parser.set_defaults(handler=_policies)
    speed = bench.add_parser("simulator", help="wall time to simulate N programs (one policy)")
    speed.add_argument("--policy", default="continuum")
    speed.add_argument("--programs", default="125,250,500,1000")
    speed.add_argument("--rate", type=float, default=0.065, help="programs/s (paper-like load)")
    speed.add_argument("--json", action="store_true")
    speed.set_defaults(handler=_speed)


def _slowdown(programs: Sequence[Program], rate: float, hw: str, iso: dict[str, float]) -> float:
    result = simulate(redraw_arrivals(programs, rate), "vllm", hw)
    values = [p.jct_s / iso[p.program_id] for p in result.programs]
    return math.fsum(values) / len(values)


def doubling_rate(programs: Sequence[Program], hardware: str, iso: dict[str, float]) -> float:
    """The load (programs/s) at which vLLM's mean slowdown over the isolated run reaches 2,
    by bracketing and bisection (7 halvings: about 1 % of the rate)."""
    low, high = 0.0, 0.01
    while _slowdown(programs, high, hardware, iso) < 2.0:
        low, high = high, high * 2.0
        if high > 100:
            raise ValueError("vLLM never doubles its JCT below 100 programs/s")
    for _ in range(7):
        middle = (low + high) / 2.0
        if _slowdown(programs, middle, hardware, iso) < 2.0:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0


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


def _load_study(args: argparse.Namespace, out: Path, lines: list[str]) -> dict[str, object]:
    policies = parse_policies(args.policy)
    summary: dict[str, object] = {}
    config = EngineConfig()
    for workload in args.workloads.split(","):
        programs = generate(workload, args.programs, seed=args.seed)
        for hw in args.hardware.split(","):
            iso = isolated_jct(programs, hw, config)
            r2 = doubling_rate(programs, hw, iso)
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
                trace = redraw_arrivals(programs, rate, args.seed)
                results = run_policies(trace, policies, hw, config, isolated=iso)
                for p in policies:
                    curves[p].append(results[p].mean_jct_s)
                cells = [f"{results[p].mean_jct_s:.0f}" for p in policies]
                table.append(f"| {rate:.4f} | " + " | ".join(cells) + " |")
                print(f"{workload} {hw} {rate:.4f} " + " ".join(cells), file=sys.stderr)
            png = out / f"jct_{workload}_{hw}.png"
            _plot(png, f"{workload} · {hw}", rates, curves)
            lines += ["Mean JCT (s) per policy:", "", *table, "", f"![{png.name}]({png.name})", ""]
            summary[f"{workload}/{hw}"] = {"doubling_rate": r2, "rates": rates, "mean_jct": curves}
    return summary


def _turns_study(args: argparse.Namespace, lines: list[str]) -> dict[str, object]:
    hw = "llama3.1-8b-h100"
    base = generate("swe", args.programs, seed=args.seed)
    rate = doubling_rate(base, hw, isolated_jct(base, hw, EngineConfig()))
    lines += ["### Turn scaling (SWE-shaped, 8B/H100, load = vLLM's doubling load at 1×)", ""]
    lines += [
        "| turn scale | mean turns | CPU tier | vllm | continuum | ratio | cachettl |",
        "|---|---|---|---|---|---|---|",
    ]
    out: dict[str, object] = {}
    for cpu in (0, 1_500_000):
        config = EngineConfig(cpu_tier_tokens=cpu)
        for scale in (1, 2, 3, 4, 5):
            programs = generate("swe", args.programs, rate=rate, seed=args.seed, turn_scale=scale)
            res = run_policies(programs, ("vllm", "continuum", "cachettl"), hw, config)
            turns = sum(len(p.turns) for p in programs) / len(programs)
            ratio = res["vllm"].mean_jct_s / res["continuum"].mean_jct_s
            tier = "200 GB" if cpu else "none"
            lines.append(
                f"| {scale}× | {turns:.1f} | {tier} | {res['vllm'].mean_jct_s:.0f} | "
                f"{res['continuum'].mean_jct_s:.0f} | {ratio:.2f}× | "
                f"{res['cachettl'].mean_jct_s:.0f} |"
            )
            out[f"{scale}x/cpu={cpu}"] = ratio
            print(f"turns {scale}x cpu={cpu}: vllm/continuum {ratio:.2f}", file=sys.stderr)
    lines.append("")
    return out


def _ablation_study(args: argparse.Namespace, lines: list[str]) -> dict[str, object]:
    hw = "llama3.1-8b-h100"
    out: dict[str, object] = {}
    for workload in ("swe", "bfcl"):
        base = generate(workload, args.programs, seed=args.seed)
        iso = isolated_jct(base, hw, EngineConfig())
        r2 = doubling_rate(base, hw, iso)
        lines += [
            f"### Ablation ({workload}, 8B/H100; mean JCT s)",
            "",
            "| load | " + " | ".join(ABLATION) + " |",
            "|---|" + "---|" * len(ABLATION),
        ]
        for factor in (1.0, 1.1, 1.2):
            trace = redraw_arrivals(base, r2 * factor, args.seed)
            res = run_policies(trace, ABLATION, hw, EngineConfig(), isolated=iso)
            cells = [f"{res[p].mean_jct_s:.0f}" for p in ABLATION]
            lines.append(f"| {r2 * factor:.4f} | " + " | ".join(cells) + " |")
            out[f"{workload}/{factor}"] = {p: res[p].mean_jct_s for p in ABLATION}
        lines.append("")
    return out


def _policies(args: argparse.Namespace) -> int:
    parse_policies(args.policy)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    studies = set(args.studies.split(","))
    unknown = studies - {"load", "turns", "ablation"}
    if unknown:
        raise ValueError(f"unknown studies {sorted(unknown)}; valid: ablation, load, turns")
    lines = [
        "# Policy comparison (generated by `cachettl bench policies`)",
        "",
        f"{args.programs} programs per run, seed {args.seed}.",
        "",
    ]
    summary: dict[str, object] = {}
    if "load" in studies:
        summary["load"] = _load_study(args, out, lines)
    if "turns" in studies:
        summary["turns"] = _turns_study(args, lines)
    if "ablation" in studies:
        summary["ablation"] = _ablation_study(args, lines)
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
