"""The ``cachettl`` command line.

Each package contributes its subcommands with a ``register(commands, bench)`` function,
declared as an entry point of the group :data:`GROUP` (``pyproject.toml``,
``[project.entry-points."cachettl.commands"]``); this module loads the group and names no
package, so the control plane depends on none of them. Handlers import their heavy
dependencies lazily so that ``cachettl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

__all__ = ["DISTRIBUTION", "GROUP", "build_parser", "main", "run", "version"]

#: The entry-point group whose ``register(commands, bench)`` functions add subcommands.
GROUP = "cachettl.commands"
#: The distribution whose metadata holds the version ``cachettl --version`` prints.
DISTRIBUTION = "cachettl-kvserve"


def build_parser() -> argparse.ArgumentParser:
    """The full ``cachettl`` parser."""
    parser = argparse.ArgumentParser(
        prog="cachettl",
        description="KV-cache time-to-live pinning and program-level scheduling for LLM agents.",
    )
    parser.add_argument("--version", action="version", version=f"cachettl {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench_parser = commands.add_parser("bench", help="benchmarks that print figures")
    bench = bench_parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    registered = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    if not registered:
        raise RuntimeError(
            f"no subcommands are registered in the entry-point group {GROUP!r}: install the "
            "package (pip install -e .) so that its metadata declares them"
        )
    for entry in registered:
        entry.load()(commands, bench)
    return parser


def version() -> str:
    """This installation's version, from the package's metadata (CHANGELOG.md names it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cachettl``; returns the process exit code."""
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse ``argv`` (under the file of ``serve --config FILE``, when given) and run the
    command's handler; a ``ValueError`` is one clear line and exit code 2, no traceback."""
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None) is not None:
            from controlplane.cli.configfile import parse_with_config

            args = parse_with_config(parser, argv, args)
        result = args.handler(args)
    except ValueError as error:
        print(f"cachettl: error: {error}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
