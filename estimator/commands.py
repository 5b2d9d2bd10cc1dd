"""``cachettl bench estimator``: the estimator's speed and memory figures."""

from __future__ import annotations

import argparse


def register(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    bench: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add ``cachettl bench estimator``."""
    parser = bench.add_parser(
        "estimator", help="optimal_ttl, model update, decide and memory per tool model"
    )
    parser.add_argument("--window", type=int, default=2000, help="samples per duration window")
    parser.add_argument("--repeat", type=int, default=25, help="timing batches per figure")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic durations")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from estimator.bench import run

    return run(window=args.window, repeat=args.repeat, seed=args.seed, as_json=args.json)
