"""`cachettl bench controlplane --decide-rate R`: DecideTtl latency beside ingest, and the
control, in one run.

Two ``serve`` processes on fresh SQLite files. One tenant asks ``DecideTtl`` at a paced
``--decide-rate`` from this process while another tenant ingests ``--ingest-rate`` events/s
(batches of 100, from a process of its own) into **the same** server (arm ``same``), or
into the second server (arm ``other``: the same load on the machine, none on the server
timed), or with no ingest at all (arm ``none``). The arms run in turns, ``--rounds`` times
each for ``--seconds`` a turn, so that the machine's other work falls on every arm alike.
Printed per arm: p50, p99 and max in ms over all its turns, the ingest achieved (mean, and
each turn's) and the 1-minute load average at each turn; then the ratios of ``same`` to
``other``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARMS", "add_decide_flags", "run_decide"]

ARMS = ("none", "same", "other")
#: The stated target: DecideTtl p99 at 500 requests/s beside 1,000 events/s of ingest.
TARGET_P99_MS = 2.0


def add_decide_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the latency benchmark on ``bench controlplane``."""
    p.add_argument(
        "--decide-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="run only DecideTtl at R requests/s beside ingest, per arm (e.g. 500)",
    )
    p.add_argument("--ingest-rate", type=float, default=1000.0, help="events/s beside (1000)")
    p.add_argument(
        "--ingest-to",
        default="same,other",
        help=f"comma-separated arms of {', '.join(ARMS)} (same,other)",
    )
    p.add_argument("--rounds", type=int, default=3, help="turns of each arm (3)")


def _check(args: argparse.Namespace, seconds: float) -> list[str]:
    arms = [a.strip() for a in args.ingest_to.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise ValueError(f"--ingest-to: name distinct arms of {', '.join(ARMS)}")
    if not 1 <= args.decide_rate <= 20_000:
        raise ValueError(f"--decide-rate must be in 1..20000, got {args.decide_rate:g}")
    if not 100 <= args.ingest_rate <= 100_000:
        raise ValueError(f"--ingest-rate must be in 100..100000, got {args.ingest_rate:g}")
    if not 1 <= args.rounds <= 100:
        raise ValueError(f"--rounds must be in 1..100, got {args.rounds}")
    if not 0.5 <= seconds <= 120:
        raise ValueError(f"--seconds must be in 0.5..120, got {seconds:g}")
    return arms


class _Loader:
    """An ingest process (``benchload.ingest_process``) into one server, for one turn."""

    def __init__(self, target: str, token: str, rate: float, prefix: str) -> None:
        from controlplane.cli.benchload import ingest_process

        ctx = multiprocessing.get_context("spawn")
        self.stop, self.ready, self.out = ctx.Event(), ctx.Event(), ctx.Queue()
        args = (target, token, rate, self.stop, self.ready, self.out, prefix)
        self.process = ctx.Process(target=ingest_process, args=args, daemon=True)

    def __enter__(self) -> _Loader:
        self.process.start()
        deadline = time.monotonic() + 60
        while not self.ready.wait(timeout=0.1):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.stop.set()
                raise RuntimeError("the ingest process did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.rate = float(self.out.get(timeout=60)) if self.ready.is_set() else 0.0
        self.process.join(timeout=60)


def _turn(
    arm: str,
    targets: dict[str, str],
    tokens: dict[str, str],
    rate: float,
    ingest: float,
    seconds: float,
    turn: int,
) -> tuple[np.ndarray, float, float]:
    """One turn of ``arm``: latencies (s), events/s ingested, the load average after."""
    from controlplane.cli.benchload import paced_latency

    if arm == "none":
        lat = paced_latency(targets["same"], tokens["bench"], rate, seconds)
        return lat, 0.0, os.getloadavg()[0]
    loader = _Loader(targets[arm], tokens[arm], ingest, f"t{turn}-")  # new events each turn
    with loader:
        lat = paced_latency(targets["same"], tokens["bench"], rate, seconds)
    return lat, loader.rate, os.getloadavg()[0]


def measure(
    arms: list[str], rate: float, ingest: float, seconds: float, rounds: int
) -> dict[str, dict[str, Any]]:
    """Every arm's figures: ``p50_ms``, ``p99_ms``, ``max_ms``, ``n``, ``ingest_per_s``
    (mean over turns), ``ingest_turns`` and ``loads`` (each turn's events/s stored and
    1-minute load average)."""
    from controlplane.cli.benchload import prepare, server

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'decide.sqlite3'}"
        other_url = f"sqlite:///{Path(tmp) / 'other.sqlite3'}"
        token, loader = prepare(url, 2000)
        _, other_loader = prepare(other_url, 0)
        tokens = {"bench": token, "same": loader, "other": other_loader}
        got: dict[str, list[tuple[np.ndarray, float, float]]] = {a: [] for a in arms}
        with server(url) as target, server(other_url) as other:
            targets = {"same": target, "other": other}
            for turn in range(rounds):
                for arm in arms:
                    got[arm].append(_turn(arm, targets, tokens, rate, ingest, seconds, turn))
    figures = {}
    for arm, turns in got.items():
        lat = np.concatenate([t[0] for t in turns]) * 1e3
        p50, p99 = np.percentile(lat, [50, 99])
        figures[arm] = {
            "p50_ms": float(p50),
            "p99_ms": float(p99),
            "max_ms": float(lat.max()),
            "n": int(lat.size),
            "ingest_per_s": float(np.mean([t[1] for t in turns])),
            "ingest_turns": [round(t[1]) for t in turns],
            "loads": [round(t[2], 2) for t in turns],
        }
    return figures


def lines(figures: dict[str, dict[str, Any]], rate: float, ingest: float) -> list[str]:
    """The printed report."""
    what = {
        "none": "no ingest",
        "same": "ingest into the same server",
        "other": "control: ingest into another server",
    }
    out = [f"DecideTtl at {rate:g} req/s beside {ingest:g} events/s of ingest"]
    for arm, f in figures.items():
        loads = ", ".join(f"{x:.2f}" for x in f["loads"])
        turns = ", ".join(str(x) for x in f["ingest_turns"])
        out.append(
            f"  {arm:<5} ({what[arm]}): p50 {f['p50_ms']:.3f} ms  p99 {f['p99_ms']:.3f} ms  "
            f"max {f['max_ms']:.1f} ms  n {f['n']}  ingest {f['ingest_per_s']:,.0f} events/s "
            f"({turns})  "
            f"load {loads}"
        )
    if "same" in figures and "other" in figures:
        same, other = figures["same"], figures["other"]
        out.append(
            f"  same / other: p50 {same['p50_ms'] / other['p50_ms']:.2f}  "
            f"p99 {same['p99_ms'] / other['p99_ms']:.2f}  "
            f"(target: same p99 <= {TARGET_P99_MS:g} ms at 500 req/s, 1,000 events/s)"
        )
    return out


def run_decide(args: argparse.Namespace, seconds: float) -> int:
    arms = _check(args, seconds)
    figures = measure(arms, args.decide_rate, args.ingest_rate, seconds, args.rounds)
    print("\n".join(lines(figures, args.decide_rate, args.ingest_rate)), flush=True)
    return 0
