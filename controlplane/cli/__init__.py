"""The ``cachettl`` command line.

Each package contributes its subcommands through a ``commands`` module with a
``register(commands, bench)`` function; handlers import their heavy dependencies lazily so
that ``cachettl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

#: Modules whose ``register(commands, bench)`` adds subcommands.
COMMAND_MODULES = (
    "estimator.commands",
    "controlplane.cli.commands",
    "simulator.studies.commands",
    "enginehook.tools.commands",
)


def build_parser() -> argparse.ArgumentParser:
    """The full ``cachettl`` parser."""
    parser = argparse.ArgumentParser(
        prog="cachettl",
        description="KV-cache time-to-live pinning and program-level scheduling for LLM agents.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench_parser = commands.add_parser("bench", help="benchmarks that print figures")
    bench = bench_parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands, bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cachettl``; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        result = args.handler(args)
    except ValueError as error:  # bad input: one clear line, no traceback
        print(f"cachettl: error: {error}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
