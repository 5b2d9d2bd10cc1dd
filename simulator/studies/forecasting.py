"""``cachettl forecast`` (what turning the hook on would change, from a shadow record) and
``cachettl bench forecast`` (how often such a forecast holds what is then measured), and
:func:`programs_from_store`: a record rebuilt from a tenant's reports in the control
plane's store (tool durations and turn order as reported, context sizes from the tokens each
returning turn could have reused where the engine reported them).

``bench forecast``: on each seed of a workload at a load, the hook's measured mean JCT
ratio (``cachettl`` / ``vllm`` on that seed's programs); then, from each record seed's
programs alone, a forecast (:func:`simulator.forecast.forecast`), and how many of the
*other* seeds' measured ratios its interval holds. The record seed is left out of its own
count: a forecast is judged on traffic it did not see.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.studies.engineflags import engine_arguments, engine_config
from simulator.studies.study import HARDWARE, Study, seed_list
from simulator.trace import Program, Turn

if TYPE_CHECKING:
    from controlplane.storage import Store

__all__ = ["programs_from_store", "register", "register_bench"]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cachettl forecast``."""
    p = commands.add_parser(
        "forecast",
        help="what turning the hook on would change, from a shadow deployment's record",
        description="Replays a record (a trace, or a tenant's tool calls in the control "
        "plane's store) under stock vLLM and under the hook's policy, on resampled replicas "
        "of it, and prints the ratios hook / stock with an interval.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a JSON Lines trace (simulator/trace.py)")
    source.add_argument("--db", metavar="URL", help="the control plane's store (with --tenant)")
    p.add_argument("--tenant", help="whose tool calls (with --db)")
    p.add_argument("--since", help="first finish time, ISO 8601 (with --db; default: all)")
    p.add_argument("--until", help="last finish time, ISO 8601 (with --db; default: all)")
    p.add_argument("--turn-tokens", type=int, default=1000, help="size of a turn not measured")
    p.add_argument("--policy", default="cachettl", help="the hook's policy (cachettl)")
    p.add_argument("--replicas", type=int, default=16, help="resampled replicas (16)")
    p.add_argument("--confidence", type=float, default=0.9, help="interval share (0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the resampling")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    engine_arguments(p)
    p.set_defaults(handler=_forecast)


def register_bench(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cachettl bench forecast``."""
    p = bench.add_parser(
        "forecast", help="how often a forecast from one seed's record holds the other seeds'"
    )
    p.add_argument("--workload", default="swe", help="a study workload (swe)")
    p.add_argument("--programs", type=int, default=100, help="programs per seed (100)")
    p.add_argument("--seeds", default="0-15", help="seeds measured, e.g. 0-15 (16 seeds)")
    p.add_argument("--record-seeds", default="0,1,2", help="seeds forecast from (0,1,2)")
    p.add_argument("--load", type=float, default=1.0, help="x vLLM's slowdown-3 rate (1)")
    p.add_argument("--replicas", type=int, default=16, help="replicas per forecast (16)")
    p.add_argument("--confidence", type=float, default=0.9, help="interval share (0.9)")
    p.add_argument("--out", metavar="FILE", help="also write the figures as JSON")
    p.set_defaults(handler=_bench)


def _when(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"{flag}: not an ISO 8601 time: {text!r}") from None


def _forecast(args: argparse.Namespace) -> int:
    from simulator.forecast import forecast
    from simulator.trace import read_trace

    if args.trace:
        programs = read_trace(args.trace)
        note = f"record: {args.trace}"
    else:
        if not args.tenant:
            raise ValueError("--db needs --tenant: whose tool calls to forecast from")
        from controlplane.storage import create_store

        store = create_store(args.db)
        try:
            programs, measured = programs_from_store(
                store,
                args.tenant,
                _when(args.since, "--since"),
                _when(args.until, "--until"),
                turn_tokens=args.turn_tokens,
            )
        finally:
            store.close()
        turns = sum(len(p.turns) - 1 for p in programs)
        note = f"record: tenant {args.tenant!r}, {turns} tool calls, {measured} with measured sizes"
    result = forecast(
        programs,
        policy=args.policy,
        hardware=args.hardware,
        config=engine_config(args),
        replicas=args.replicas,
        confidence=args.confidence,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps({"note": note, **result.as_dict()}))
    else:
        print(note)
        print("\n".join(result.lines()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from simulator.forecast import forecast
    from simulator.sim import simulate
    from simulator.trace import redraw_arrivals

    seeds, records = seed_list(args.seeds), seed_list(args.record_seeds)
    if len(seeds) < 3 or not set(records) <= set(seeds):
        raise ValueError("--seeds needs at least three seeds, --record-seeds some of them")
    if not args.load > 0:
        raise ValueError(f"--load must be positive, got {args.load}")
    study = Study(args.programs, seeds)
    rate = study.rate(args.workload) * args.load
    traces = {s: redraw_arrivals(study.base(args.workload, s), rate, s) for s in seeds}
    measured: dict[int, float] = {}
    for s in seeds:
        jct = []
        for policy in ("cachettl", "vllm"):
            run = simulate(traces[s], policy, HARDWARE, study.config)
            jct.append(math.fsum(p.jct_s for p in run.programs) / len(run.programs))
        measured[s] = jct[0] / jct[1]
    rows: list[dict[str, Any]] = []
    for r in records:
        f = forecast(
            traces[r],
            hardware=HARDWARE,
            config=study.config,
            replicas=args.replicas,
            confidence=args.confidence,
            seed=r,
        )
        others = [measured[s] for s in seeds if s != r]
        held = sum(f.mean_jct_ratio.holds(m) for m in others)
        rows.append(
            {
                "record_seed": r,
                "forecast": f.as_dict(),
                "held": held,
                "others": len(others),
            }
        )
    _print_bench(args, rate, measured, rows)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "workload": args.workload,
                    "programs": args.programs,
                    "load": args.load,
                    "rate": rate,
                    "measured": measured,
                    "forecasts": rows,
                },
                indent=1,
            )
        )
    return 0


def _print_bench(
    args: argparse.Namespace, rate: float, measured: dict[int, float], rows: list[dict[str, Any]]
) -> None:
    ratios = sorted(measured.values())
    print(
        f"{args.workload}, {args.programs} programs, load {args.load:g}x "
        f"({rate:.4f} programs/s), {len(measured)} seeds, {args.replicas} replicas, "
        f"{args.confidence:.0%} intervals"
    )
    print(
        "measured mean JCT ratio (cachettl / vllm): median "
        f"{ratios[len(ratios) // 2]:.3f}, range [{ratios[0]:.3f}, {ratios[-1]:.3f}]"
    )
    print("record seed  forecast: point [interval]   other seeds' measured ratios held")
    for row in rows:
        m = row["forecast"]["mean_jct_ratio"]
        print(
            f"{row['record_seed']:>11}  {m['point']:.3f} [{m['low']:.3f}, {m['high']:.3f}]"
            f"   {row['held']}/{row['others']}"
        )


def programs_from_store(
    store: Store,
    tenant: str,
    since: float | None = None,
    until: float | None = None,
    turn_tokens: int = 1_000,
    output_tokens: int = 200,
) -> tuple[list[Program], int]:
    """The tenant's programs as the store holds them (tool calls finished within
    [``since``, ``until``], Unix seconds), and how many of their turns had measured sizes.

    Per program, the tool calls in turn order make its turns, each followed by its tool
    and that tool's measured duration, and a last turn without a tool. A turn's size is the
    growth of the context its returning turn could reuse (``reusable_tokens``, reported by
    the engine hook) where known, else ``turn_tokens``; ``output_tokens`` of it (at most
    half) are generated, the rest is input. A program arrives when its first tool call
    finished (its first turn's own time is not recorded). Calls without ``finished_at``
    are left out."""
    calls: dict[str, list] = defaultdict(list)  # type: ignore[type-arg]
    after = 0
    while True:
        page = store.read_tool_calls(after, 10_000, tenant)
        if not page:
            break
        after = page[-1].seq
        for row in page:
            at = row.call.finished_at
            if at is None or (since is not None and at < since):
                continue
            if until is not None and at > until:
                continue
            calls[row.call.program_id].append(row.call)
    if not calls:
        raise ValueError(f"tenant {tenant!r} has no tool calls with a finish time in that window")
    measured = 0
    programs: list[Program] = []
    start = min(c.finished_at for cs in calls.values() for c in cs)
    for program_id, cs in sorted(calls.items()):
        cs.sort(key=lambda c: (c.turn_index, c.finished_at))
        turns: list[Turn] = []
        context = 0
        for c in cs:
            reusable = c.cache.reusable_tokens
            if reusable is not None and reusable > context:
                size, context = reusable - context, reusable
                measured += 1
            else:
                size = turn_tokens
                context += size
            out = min(output_tokens, size // 2)
            turns.append(Turn(max(1, size - out), max(1, out), c.tool, c.tool_args, c.duration_s))
        out = min(output_tokens, turn_tokens // 2)
        turns.append(Turn(max(1, turn_tokens - out), max(1, out)))
        programs.append(Program(program_id, cs[0].finished_at - start, tuple(turns), tenant))
    programs.sort(key=lambda p: p.arrival_s)
    return programs, measured
