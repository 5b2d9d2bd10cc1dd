"""``cachettl demo``: the control plane learns from a simulated SWE-agent workload."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cachettl demo``."""
