"""`cachettl` subcommands of this package (registered by `controlplane.cli`):
``simulate``, ``trace generate|stats``, ``demo``, ``forecast``, ``bench policies``,
``bench simulator`` and ``bench fidelity``."""

from __future__ import annotations

import argparse

from simulator.studies.engineflags import engine_arguments, engine_config


def _workload_arguments(parser: argparse.ArgumentParser, trace: bool) -> None:
    if trace:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument(
            "--trace", metavar="FILE", help="a JSON Lines trace (format: simulator/trace.py)"
        )
        source.add_argument("--workload", metavar="NAME", help="generate: swe or bfcl")
    else:
        parser.add_argument("--workload", metavar="NAME", default="swe", help="swe or bfcl")
    parser.add_argument("--programs", type=int, default=100, help="programs to generate")
    parser.add_argument("--rate", type=float, help="Poisson program arrivals per second")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator")
    parser.add_argument(
        "--turn-scale", type=int, default=1, help="repeat each program's turns N times"
    )


def register(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    bench: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add this package's subcommands to `cachettl` and `cachettl bench`."""
    from simulator.policies import POLICIES

    lines = [f"  {name:18s} {cls.help}" for name, cls in sorted(POLICIES.items())]
    lines.append(f"  {'isolated':18s} each program alone (the lower bound)")
    params = POLICIES["cachettl"].PARAMS
    lines += ["", "parameters of pinning policies, NAME(key=value,...):"]
    for key, param in params.items():
        default = getattr(param.default, "value", param.default)
        lines.append(f"  {key:18s} {param.help} (cachettl: {default})")
    sim = commands.add_parser(
        "simulate",
        help="replay agent programs on a simulated engine under several policies",
        description="policies:\n" + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _workload_arguments(sim, trace=True)
    sim.add_argument(
        "--policy",
        default="vllm,continuum,cachettl",
        help="comma-separated policies, each NAME or NAME(key=value,...), e.g. "
        "'isolated,vllm,cachettl(ttl_cap_s=60,pressure=always)'",
    )
    engine_arguments(sim)
    sim.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.add_argument(
        "--timeline",
        metavar="DIR",
        help="write each policy's memory timeline (pinned/used share, queue) as DIR/NAME.csv",
    )
    sim.set_defaults(handler=_simulate)

    _register_others(commands, bench)


def _register_others(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    bench: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``trace``, ``demo``, ``forecast`` and the studies' ``bench`` commands."""
    trace = commands.add_parser("trace", help="generate or inspect agent traces")
    actions = trace.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    gen = actions.add_parser("generate", help="write a synthetic trace (JSON Lines)")
    _workload_arguments(gen, trace=False)
    gen.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    gen.set_defaults(handler=_generate)
    show = actions.add_parser("stats", help="Table-2 statistics of a trace")
    show.add_argument("trace", metavar="FILE")
    show.set_defaults(handler=_stats)

    from simulator.studies import bench as bench_module
    from simulator.studies import cluster as cluster_bench
    from simulator.studies import (
        composition,
        demo,
        fidelity,
        forecasting,
        frontier,
        learning,
        seeds,
        study,
    )

    for module in (bench_module, study, frontier, seeds, composition, fidelity, cluster_bench):
        module.register(bench)
    learning.register(bench)
    forecasting.register_bench(bench)
    demo.register(commands)
    forecasting.register(commands)


def load_programs(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The trace of ``--trace`` or ``--workload`` (with ``--rate`` re-drawn arrivals)."""
    from simulator.trace import read_trace, redraw_arrivals, scale_turns
    from simulator.workloads import generate

    if args.rate is not None and not args.rate > 0:
        raise ValueError(
            f"--rate must be a positive number of programs per second, got {args.rate}"
        )
    if getattr(args, "trace", None):
        programs = read_trace(args.trace)
        if args.turn_scale != 1:
            programs = [scale_turns(p, args.turn_scale) for p in programs]
        if args.rate is not None:
            programs = redraw_arrivals(programs, args.rate, args.seed)
        return programs
    if args.programs < 1:
        raise ValueError(f"--programs must be >= 1, got {args.programs}")
    return generate(args.workload, args.programs, args.rate, args.seed, args.turn_scale)


def _simulate(args: argparse.Namespace) -> int:
    import json
    import sys

    from estimator import get_profile
    from simulator.studies.report import Progress, format_table, parse_policies, run_policies

    policies = parse_policies(args.policy)
    get_profile(args.hardware)
    config = engine_config(args)
    programs = load_programs(args)
    progress = Progress(len(programs) * (len(policies) + 1), not args.quiet and sys.stderr.isatty())
    timeline = None
    if args.timeline:
        from pathlib import Path

        timeline = Path(args.timeline)
        if timeline.exists() and not timeline.is_dir():
            raise ValueError(f"--timeline: {args.timeline!r} is not a directory")
        timeline.mkdir(parents=True, exist_ok=True)
    try:
        results = run_policies(
            programs, policies, args.hardware, config, progress, timeline_dir=timeline
        )
    finally:
        progress.close()
    if args.json:
        out = {
            "policies": {name: _finite(m.as_dict()) for name, m in results.items()},
            "hardware": args.hardware,
            "programs": len(programs),
        }
        print(json.dumps(out, allow_nan=False))
    else:
        print(f"{len(programs)} programs on {args.hardware}")
        print(format_table(results))
    return 0


def _finite(values: dict[str, float | int]) -> dict[str, float | int | None]:
    """JSON has no NaN: undefined figures become null."""
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in values.items()}


def _generate(args: argparse.Namespace) -> int:
    from simulator.trace import write_trace

    programs = load_programs(args)
    write_trace(programs, args.out)
    print(f"wrote {len(programs)} programs to {args.out}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from simulator.policies import paper_tool_key
    from simulator.trace import read_trace
    from simulator.workloads import stats

    programs = read_trace(args.trace)
    figures = stats(programs, lambda t: paper_tool_key(t.tool or "", t.tool_args))
    for key, value in figures.items():
        print(f"{key:32s} {value:12.3f}")
    return 0
