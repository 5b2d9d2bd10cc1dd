"""``python -m controlplane COMMAND ...``: the control plane's own commands only (``serve``,
``db``, ``tenants``, ``tools``, ``bench controlplane``), without the other packages'."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from controlplane.cli import commands, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = sub.add_parser("bench").add_subparsers(dest="bench", metavar="BENCH", required=True)
    commands.register(sub, bench)
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
