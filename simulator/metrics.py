"""Per-policy figures of a run, and the isolated (no contention) run of each program.

>>> percentile([1.0, 2.0, 3.0, 4.0], 50)
2.5
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from simulator.engine import EngineConfig
from simulator.sim import RunResult, simulate
from simulator.trace import Program

__all__ = ["PolicyMetrics", "isolated_jct", "isolated_metrics", "percentile", "summarise"]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class PolicyMetrics:
    """The figures ``cachettl simulate`` reports for one policy."""

    mean_jct_s: float
    p50_jct_s: float
    p90_jct_s: float
    p99_jct_s: float
    mean_slowdown: float
    throughput_programs_per_s: float
    throughput_tokens_per_s: float
    prefix_hit_rate: float
    pinned_memory_share: float
    preemptions: int
    first_turn_wait_p90_s: float
    programs: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def isolated_jct(
    programs: Sequence[Program],
    hardware: str,
    config: EngineConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Each program alone on the engine (vLLM policy, nothing else running): its JCT."""
    out: dict[str, float] = {}
    for i, program in enumerate(programs):
        result = simulate([program], "vllm", hardware, config)
        out[program.program_id] = result.programs[0].jct_s
        if progress is not None:
            progress(i + 1)
    return out


def summarise(result: RunResult, isolated: dict[str, float]) -> PolicyMetrics:
    """Figures of one run; slowdown is JCT over the program's isolated JCT."""
    jct = [p.jct_s for p in result.programs]
    slowdowns = [
        p.jct_s / isolated[p.program_id]
        for p in result.programs
        if isolated.get(p.program_id, 0.0) > 0
    ]
    waits = [p.first_turn_wait_s for p in result.programs if not math.isnan(p.first_turn_wait_s)]
    span = result.makespan_s if result.makespan_s > 0 else math.nan
    tokens = sum(p.tokens for p in result.programs)
    return PolicyMetrics(
        mean_jct_s=math.fsum(jct) / len(jct) if jct else math.nan,
        p50_jct_s=percentile(jct, 50),
        p90_jct_s=percentile(jct, 90),
        p99_jct_s=percentile(jct, 99),
        mean_slowdown=math.fsum(slowdowns) / len(slowdowns) if slowdowns else math.nan,
        throughput_programs_per_s=len(jct) / span,
        throughput_tokens_per_s=tokens / span,
        prefix_hit_rate=result.hit_tokens / result.prompt_tokens if result.prompt_tokens else 0.0,
        pinned_memory_share=result.pinned_block_seconds / (result.num_blocks * span),
        preemptions=result.preemptions,
        first_turn_wait_p90_s=percentile(waits, 90),
        programs=len(jct),
    )


def isolated_metrics(programs: Sequence[Program], isolated: dict[str, float]) -> PolicyMetrics:
    """The ``isolated`` row: every program alone (no queueing, no contention)."""
    jct = [isolated[p.program_id] for p in programs]
    return PolicyMetrics(
        mean_jct_s=math.fsum(jct) / len(jct),
        p50_jct_s=percentile(jct, 50),
        p90_jct_s=percentile(jct, 90),
        p99_jct_s=percentile(jct, 99),
        mean_slowdown=1.0,
        throughput_programs_per_s=math.nan,
        throughput_tokens_per_s=math.nan,
        prefix_hit_rate=math.nan,
        pinned_memory_share=0.0,
        preemptions=0,
        first_turn_wait_p90_s=0.0,
        programs=len(jct),
    )
