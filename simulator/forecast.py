"""What turning the hook on would change, forecast from what a shadow deployment recorded.

An engine with the hook in shadow mode schedules exactly as stock vLLM does, and reports
every tool call it would have pinned for. :func:`forecast` replays such a record, agent
programs in the trace format (:mod:`simulator.trace`), through the simulator under stock
vLLM and under the ``cachettl`` policy, on the same engine and the same programs, and
reports the ratios (hook / stock) of mean JCT, first-turn wait P90 and prefill tokens, and
both prefix hit rates.

One record is one window of traffic; another window would differ. So the forecast is an
interval: replica 0 is the record as it came, each further replica draws the record's
programs again with replacement and redraws their arrivals (Poisson) at a rate drawn
around the record's own (as uncertain as that many arrivals leave it), and the interval
spans the replicas' central ``confidence`` share. How well that
interval holds what the hook then measures is itself measured: ``cachettl bench forecast``
forecasts from one seed's record and counts the other seeds whose measured ratio it holds.

:func:`simulator.studies.forecasting.programs_from_store` rebuilds such a record from what
the control plane stored for a tenant (the engines' reports).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from estimator import DEFAULT_PROFILE
from simulator.engine import EngineConfig
from simulator.sim import RunResult, simulate
from simulator.trace import Program, redraw_arrivals

__all__ = ["Forecast", "Interval", "arrival_rate", "forecast"]


@dataclass(frozen=True, slots=True)
class Interval:
    """A forecast figure: replica 0's value (the record as it came) and the interval."""

    point: float
    low: float
    high: float

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high

    def __str__(self) -> str:
        return f"{self.point:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True, slots=True)
class Forecast:
    """Hook against stock on the same record (ratios are hook / stock)."""

    programs: int
    replicas: int
    confidence: float
    mean_jct_ratio: Interval
    first_turn_wait_p90_ratio: Interval
    prefill_tokens_ratio: Interval
    hit_rate_stock: Interval
    hit_rate_hook: Interval
    mean_jct_stock_s: float

    def lines(self) -> list[str]:
        """The forecast as a reader wants it."""
        pct = f"{self.confidence:.0%}"
        return [
            f"forecast from {self.programs} programs, {self.replicas} replicas "
            f"(point [{pct} interval]; ratios: hook / stock)",
            f"  mean JCT ratio           {self.mean_jct_ratio}"
            f"   (stock: {self.mean_jct_stock_s:.1f} s)",
            f"  first-turn wait P90 ratio {self.first_turn_wait_p90_ratio}",
            f"  prefill tokens ratio     {self.prefill_tokens_ratio}",
            f"  prefix hit rate          stock {self.hit_rate_stock}, hook {self.hit_rate_hook}",
        ]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def arrival_rate(programs: Sequence[Program]) -> float:
    """Programs a second over the record's span (first to last arrival)."""
    arrivals = sorted(p.arrival_s for p in programs)
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        raise ValueError(
            "a forecast needs at least two programs arriving at different times, "
            f"got {len(arrivals)}"
        )
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def _replica(programs: Sequence[Program], r: int, rate: float, seed: int) -> list[Program]:
    """Replica ``r`` of the record: the record itself for 0, else its programs drawn again
    with replacement (fresh ids), arriving as a Poisson process whose rate is drawn too:
    n arrivals over a span tell the rate only to about 1/sqrt(n), and near an engine's
    saturation that much decides whether stock's queue collapses (the rate's posterior
    given n - 1 gaps: a gamma of shape n - 1 and mean ``rate``)."""
    if r == 0:
        return list(programs)
    rng = random.Random(f"forecast:{seed}:{r}")
    drawn = [rng.choice(programs) for _ in programs]
    renamed = [replace(p, program_id=f"{p.program_id}#{r}.{i}") for i, p in enumerate(drawn)]
    gaps = len(programs) - 1
    return redraw_arrivals(renamed, rng.gammavariate(gaps, rate / gaps), seed=seed * 1_000 + r)


def _figures(run: RunResult) -> tuple[float, float, float, float]:
    """(mean JCT, first-turn wait P90, prefill tokens, prefix hit rate) of a run."""
    jct = [p.jct_s for p in run.programs]
    waits = [p.first_turn_wait_s for p in run.programs if not math.isnan(p.first_turn_wait_s)]
    wait_p90 = float(np.percentile(waits, 90)) if waits else math.nan
    prefill = float(run.prompt_tokens - run.hit_tokens)
    hits = run.hit_tokens / run.prompt_tokens if run.prompt_tokens else 0.0
    return math.fsum(jct) / len(jct), wait_p90, prefill, hits


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == b else math.inf)


def forecast(
    programs: Sequence[Program],
    policy: str = "cachettl",
    baseline: str = "vllm",
    hardware: str = DEFAULT_PROFILE,
    config: EngineConfig | None = None,
    replicas: int = 16,
    confidence: float = 0.9,
    seed: int = 0,
) -> Forecast:
    """The forecast of ``policy`` against ``baseline`` on the record ``programs`` (the module
    doc); ``replicas`` ≥ 2 runs of each."""
    if replicas < 2:
        raise ValueError(f"replicas must be at least 2, got {replicas}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    rate = arrival_rate(programs)
    rows: list[tuple[float, ...]] = []
    stock_jct = math.nan
    for r in range(replicas):
        trace = _replica(programs, r, rate, seed)
        stock = _figures(simulate(trace, baseline, hardware, config))
        hook = _figures(simulate(trace, policy, hardware, config))
        if r == 0:
            stock_jct = stock[0]
        rows.append(
            (
                _ratio(hook[0], stock[0]),
                _ratio(hook[1], stock[1]),
                _ratio(hook[2], stock[2]),
                stock[3],
                hook[3],
            )
        )
    table = np.asarray(rows, dtype=np.float64)
    tail = (1 - confidence) / 2 * 100

    def interval(column: int) -> Interval:
        values = table[:, column]
        finite = values[np.isfinite(values)]
        if not finite.size:
            return Interval(float(values[0]), math.nan, math.nan)
        low, high = np.percentile(finite, [tail, 100 - tail])
        return Interval(float(values[0]), float(low), float(high))

    return Forecast(
        programs=len(programs),
        replicas=replicas,
        confidence=confidence,
        mean_jct_ratio=interval(0),
        first_turn_wait_p90_ratio=interval(1),
        prefill_tokens_ratio=interval(2),
        hit_rate_stock=interval(3),
        hit_rate_hook=interval(4),
        mean_jct_stock_s=stock_jct,
    )
