"""Running several policies over one trace and printing the comparison."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from estimator import get_profile
from simulator.engine import EngineConfig
from simulator.metrics import PolicyMetrics, isolated_jct, isolated_metrics, summarise
from simulator.policies import get_scheduling_policy, split_policy_list
from simulator.sim import Simulation
from simulator.trace import Program

__all__ = ["Progress", "check_fits", "format_table", "parse_policies", "run_policies"]


class Progress:
    """A one-line progress bar on stderr, drawn at most every 0.2 s once a run has lasted
    more than a second (short runs print nothing)."""

    def __init__(
        self,
        total: int,
        enabled: bool,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.clock = clock
        self.done = 0
        self.label = ""
        self._start = clock()
        self._drawn = 0.0
        self._shown = False

    def advance(self, count: int = 1, label: str | None = None) -> None:
        self.done += count
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        now = self.clock()
        if now - self._start < 1.0 or now - self._drawn < 0.2:
            return
        self._drawn = now
        width = 30
        filled = int(width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "-" * (width - filled)
        line = f"\r[{bar}] {self.done}/{self.total} programs  {self.label:<20}"
        self.stream.write(line)
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names, validated together (nothing runs on a bad one)."""
    names = split_policy_list(text)
    if not names:
        raise ValueError("--policy needs at least one policy name")
    for name in names:
        if name != "isolated":  # each program alone: the lower bound
            get_scheduling_policy(name)
    if len(set(names)) != len(names):
        raise ValueError(f"--policy names a policy twice: {text!r}")
    return names


def check_fits(programs: Sequence[Program], hardware: str, config: EngineConfig) -> None:
    """Every program's final context must fit the KV pool, or the run could never end."""
    pool = config.kv_tokens or get_profile(hardware).kv_pool_tokens
    if pool < config.block_size:
        raise ValueError(f"the KV pool of {hardware!r} holds no block")
    for program in programs:
        if program.total_tokens + config.block_size > pool:
            raise ValueError(
                f"program {program.program_id!r} needs {program.total_tokens} tokens of KV; "
                f"the pool holds {pool} (raise --kv-tokens or pick larger hardware)"
            )


def run_policies(
    programs: Sequence[Program],
    policies: Sequence[str],
    hardware: str,
    config: EngineConfig,
    progress: Progress | None = None,
    isolated: dict[str, float] | None = None,
    timeline_dir: Path | None = None,
) -> dict[str, PolicyMetrics]:
    """Each policy over the trace, plus (once) the isolated run of every program.

    With ``timeline_dir``, each policy's memory timeline is written to
    ``<dir>/<policy>.csv`` (time, pinned share, used share, running, waiting)."""
    check_fits(programs, hardware, config)
    if isolated is None:
        if progress is not None:
            progress.label = "isolated"
        isolated = isolated_jct(
            programs, hardware, config, (lambda _: progress.advance()) if progress else None
        )
    out: dict[str, PolicyMetrics] = {}
    for name in policies:
        if name == "isolated":
            out[name] = isolated_metrics(programs, isolated)
            continue
        if progress is not None:
            progress.label = name
        sim = Simulation(
            programs,
            get_scheduling_policy(name),
            hardware,
            config,
            (lambda _: progress.advance()) if progress else None,
        )
        result = sim.run()
        out[name] = summarise(result, isolated)
        if timeline_dir is not None:
            _write_timeline(timeline_dir / f"{_file_name(name)}.csv", result.timeline)
    return out


def _file_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label).strip("_") or "policy"


def _write_timeline(path: Path, rows: Sequence[tuple[float, float, float, int, int]]) -> None:
    lines = ["time_s,pinned_share,used_share,running,waiting"]
    lines += [f"{t:.3f},{p:.5f},{u:.5f},{r},{w}" for t, p, u, r, w in rows]
    path.write_text("\n".join(lines) + "\n")


_COLUMNS = (
    ("policy", "", 0),
    ("mean_jct_s", "mean JCT s", 1),
    ("p50_jct_s", "P50", 1),
    ("p90_jct_s", "P90", 1),
    ("p99_jct_s", "P99", 1),
    ("mean_slowdown", "slowdown", 2),
    ("throughput_programs_per_s", "prog/s", 4),
    ("prefix_hit_rate", "hit rate", 3),
    ("pinned_memory_share", "pinned", 3),
    ("preemptions", "preempt", 0),
    ("first_turn_wait_p90_s", "1st wait P90", 2),
)


def format_table(results: dict[str, PolicyMetrics], markdown: bool = False) -> str:
    """A fixed-width (or markdown) table, one row per policy."""
    header = [label or "policy" for _, label, _ in _COLUMNS]
    rows = [header]
    for name, metrics in results.items():
        values = metrics.as_dict()
        row = [name]
        for key, _, digits in _COLUMNS[1:]:
            value = values[key]
            row.append(f"{value:.{digits}f}" if isinstance(value, float) else str(value))
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )
