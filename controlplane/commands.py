"""`cachettl` subcommands of this package (registered by `controlplane.cli`)."""

from __future__ import annotations

import argparse


def register(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    bench: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add this package's subcommands to `cachettl` and `cachettl bench`."""
