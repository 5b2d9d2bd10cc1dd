"""The simulated engine's flags, shared by ``cachettl simulate`` and ``cachettl forecast``."""

from __future__ import annotations

import argparse

from estimator import DEFAULT_PROFILE
from simulator.engine import EngineConfig

__all__ = ["DEFAULT_HARDWARE", "engine_arguments", "engine_config"]

DEFAULT_HARDWARE = DEFAULT_PROFILE


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine's flags (profile, batch limits, KV pool, CPU tier) to ``parser``."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--hardware", default=DEFAULT_HARDWARE, help=f"hardware/model profile ({DEFAULT_HARDWARE})"
    )
    group.add_argument("--max-num-seqs", type=int, default=256, help="running requests at most")
    group.add_argument(
        "--chunk-tokens", type=int, default=2048, help="token budget per step (chunked prefill)"
    )
    group.add_argument("--kv-tokens", type=int, help="KV pool in tokens (default: the profile's)")
    group.add_argument(
        "--cpu-tier-tokens", type=int, default=0, help="CPU KV tier in tokens (0: none)"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of :func:`engine_arguments`' flags."""
    return EngineConfig(
        max_num_batched_tokens=args.chunk_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_tokens=args.kv_tokens,
        cpu_tier_tokens=args.cpu_tier_tokens,
    )
