"""The step-time model of the CPU engine, fitted to steps it logged, and the bench's
programs as simulator programs (steps 1–3 of ``cachettl bench fidelity``).

:class:`TimedScheduler` (built on first use: importing this module does not import vLLM)
wraps the stock scheduler and logs every step (prefill chunks with their cached context,
decodes, KV context read), every request's arrival and finish, and the scheduler's limits;
:func:`calibration_from_log` reads that log and :func:`fit_step_timer` fits a
:class:`FittedStepTimer` to it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from estimator import DEFAULT_PROFILE, HardwareProfile, get_profile
from simulator.steptime import StepTimer
from simulator.trace import Program, Turn

__all__ = [
    "HOOK_PROFILE",
    "LOG_ENV",
    "Calibration",
    "FittedStepTimer",
    "StepSample",
    "calibration_from_log",
    "convert_trace",
    "fit_step_timer",
    "measure_steps",
    "read_calibration",
]

#: The cost-model profile the hook starts from (``HookConfig.profile``).
HOOK_PROFILE = DEFAULT_PROFILE
#: The hook learns a prefill timing from steps of at least this many tokens.
_MIN_PREFILL_TOKENS = 64
LOG_ENV = "CACHETTL_STEP_LOG"
_SUFFIX = re.compile(r"(?<=[0-9])-[0-9a-f]{8}$")
_TERMS = ("step", "sequence", "prefill token", "attention", "context token")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured engine step."""

    prefills: tuple[tuple[int, int], ...]  # (new tokens, cached context) per chunk
    decodes: int
    context_tokens: int  # KV read by all scheduled sequences (cached + new)
    seconds: float
    new_requests: int = 0

    def features(self) -> list[float]:
        new = sum(n for n, _ in self.prefills)
        attention = sum(n * (c + n / 2.0) for n, c in self.prefills)
        sequences = len(self.prefills) + self.decodes
        return [1.0, float(sequences), float(new), attention, float(self.context_tokens)]


class FittedStepTimer(StepTimer):
    """Step time as a linear function of the step's work, fitted to a measured engine:
    ``c_step + c_seq·sequences + c_tok·prefill tokens + c_attn·Σ new·(cached + new/2)
    + c_ctx·context tokens`` (no roofline: on a CPU engine with a tiny model the fixed
    per-step and per-sequence costs dominate).

    >>> timer = FittedStepTimer((1e-3, 1e-4, 1e-5, 0.0, 0.0))
    >>> round(timer.step([(100, 0)], 2, 300) * 1e3, 3)
    2.3
    """

    def __init__(
        self, coefficients: Sequence[float], profile: HardwareProfile | None = None
    ) -> None:
        if len(coefficients) != len(_TERMS):
            raise ValueError(f"coefficients: need {len(_TERMS)} values, got {len(coefficients)}")
        super().__init__(profile or get_profile(HOOK_PROFILE), overhead_s=0.0)
        self.coefficients = tuple(float(c) for c in coefficients)

    def step(
        self,
        prefills: Sequence[tuple[int, int]],
        decodes: int,
        context_tokens: float,
        reload_tokens: int = 0,
    ) -> float:
        work = StepSample(tuple(prefills), decodes, int(context_tokens), 0.0).features()
        return sum(c * x for c, x in zip(self.coefficients, work, strict=True))

    def describe(self) -> dict[str, float]:
        return dict(zip(_TERMS, self.coefficients, strict=True))


def fit_step_timer(samples: Sequence[StepSample]) -> tuple[FittedStepTimer, dict[str, float]]:
    """Least-squares fit (non-negative coefficients) of a :class:`FittedStepTimer`;
    returns it and the fit's quality (median and mean absolute relative error, R²)."""
    import numpy as np
    from scipy.optimize import nnls

    if len(samples) < len(_TERMS):
        raise ValueError(f"need at least {len(_TERMS)} measured steps, got {len(samples)}")
    x = np.array([s.features() for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    coef, _ = nnls(x / scale, y)
    timer = FittedStepTimer(tuple(float(c) for c in coef / scale))
    predicted = (x / scale) @ coef
    relative = np.abs(predicted - y) / np.maximum(y, 1e-9)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 1.0
    quality = {
        "steps": float(len(samples)),
        "median_abs_rel_error": float(np.median(relative)),
        "mean_abs_rel_error": float(relative.mean()),
        "r2": r2,
        "mean_step_s": float(y.mean()),
        "mean_predicted_step_s": float(predicted.mean()),
    }
    return timer, quality


def convert_trace(programs: Sequence[Any], turn_overhead_s: float = 0.0) -> list[Program]:
    """The bench's programs (``enginehook.tools.bench.BenchProgram``) as simulator programs:
    every turn but the last calls ``bash`` with the bench's command line; a tool gap is the
    bench's sleep plus ``turn_overhead_s`` (the client's own time between a turn's last token
    and the follow-up's arrival in the engine).

    >>> from types import SimpleNamespace as NS
    >>> bench = [NS(pid="p", arrival_s=0.5, turns=[NS(input_tokens=700, output_tokens=30,
    ...     tool_args="ls -la", tool_s=0.02), NS(input_tokens=90, output_tokens=40,
    ...     tool_args=None, tool_s=0.0)])]
    >>> [(t.tool, t.tool_args, round(t.tool_duration_s, 3)) for t in
    ...  convert_trace(bench, 0.004)[0].turns]
    [('bash', 'ls -la', 0.024), (None, None, 0.0)]
    """
    if turn_overhead_s < 0:
        raise ValueError(f"turn_overhead_s must be >= 0, got {turn_overhead_s}")
    out: list[Program] = []
    for program in programs:
        turns: list[Turn] = []
        last = len(program.turns) - 1
        for k, turn in enumerate(program.turns):
            if k == last:
                turns.append(Turn(turn.input_tokens, turn.output_tokens))
            else:
                gap = turn.tool_s + turn_overhead_s
                turns.append(
                    Turn(turn.input_tokens, turn.output_tokens, "bash", turn.tool_args, gap)
                )
        out.append(Program(program.pid, program.arrival_s, tuple(turns)))
    out.sort(key=lambda p: (p.arrival_s, p.program_id))
    return out


@dataclass
class Calibration:
    """What the measured replay showed: steps, client overhead, scheduler limits."""

    samples: list[StepSample]
    turn_overhead_s: float
    prefill_timings: list[tuple[int, float]]
    limits: dict[str, int] = field(default_factory=dict)


def _step_sample(record: dict[str, Any], seconds: float) -> StepSample:
    return StepSample(
        tuple((int(n), int(c)) for n, c in record["prefills"]),
        int(record["decodes"]),
        int(record["context"]),
        seconds,
        int(record.get("new", 0)),
    )


def _client_id(request_id: str) -> str:
    """The client's request id: vLLM appends ``-<8 hex digits>`` to it internally.

    >>> _client_id("prog-003-2-8d4877d2"), _client_id("prog-003-2")
    ('prog-003-2', 'prog-003-2')
    """
    return _SUFFIX.sub("", request_id)


def calibration_from_log(
    records: Sequence[dict[str, Any]], tool_s: dict[str, float]
) -> Calibration:
    """Read :class:`TimedScheduler`'s records. ``tool_s``: request id → the tool sleep that
    follows it (what the client waits between the request's finish and the next turn).

    A step's time runs from its ``schedule()`` to the next ``schedule()`` when the engine
    still had work at its end (otherwise the gap includes idle waiting and is dropped).
    """
    steps = [r for r in records if r["kind"] == "step"]
    samples: list[StepSample] = []
    prefills: list[tuple[int, float]] = []
    for this, after in itertools.pairwise(steps):
        if not this["busy"] or not (this["prefills"] or this["decodes"]):
            continue
        sample = _step_sample(this, after["t"] - this["t"])
        samples.append(sample)
        tokens = sum(n for n, _ in sample.prefills) + sample.decodes
        if sample.new_requests and tokens >= _MIN_PREFILL_TOKENS:
            prefills.append((tokens, this["compute_s"]))
    arrivals = {_client_id(r["id"]): r["t"] for r in records if r["kind"] == "arrival"}
    finishes = {_client_id(r["id"]): r["t"] for r in records if r["kind"] == "finish"}
    gaps: list[float] = []
    for request_id, finished in finishes.items():
        program, _, turn = request_id.rpartition("-")
        follow = arrivals.get(f"{program}-{int(turn) + 1}") if turn.isdigit() else None
        if follow is not None and request_id in tool_s:
            gaps.append(max(0.0, follow - finished - tool_s[request_id]))
    limits: dict[str, int] = next((r["limits"] for r in records if r["kind"] == "limits"), {})
    overhead = statistics.median(gaps) if gaps else 0.0
    return Calibration(samples, overhead, prefills, dict(limits))


# -- the step-logging scheduler (vLLM imported on first use) ---------------------------


class _StepLog:
    """Mixed in before vLLM's ``Scheduler``: logs every step to ``$CACHETTL_STEP_LOG``."""

    vllm_config: Any
    kv_cache_manager: Any
    requests: dict[str, Any]
    running: list[Any]
    waiting: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._log = open(os.environ[LOG_ENV], "a", encoding="utf-8")  # noqa: SIM115
        config = self.vllm_config.scheduler_config
        limits = {
            "max_num_batched_tokens": int(config.max_num_batched_tokens),
            "max_num_seqs": int(config.max_num_seqs),
            "chunked_prefill": int(bool(config.enable_chunked_prefill)),
            "num_gpu_blocks": int(self.kv_cache_manager.block_pool.num_gpu_blocks),
        }
        self._write({"kind": "limits", "limits": limits})
        self._pending: dict[str, Any] | None = None

    def _write(self, record: dict[str, Any]) -> None:
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def add_request(self, request: Any) -> None:
        self._write({"kind": "arrival", "id": request.request_id, "t": time.time()})
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        prefills: list[tuple[int, int]] = []
        decodes = 0
        context = 0
        for request_id, n in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            before = request.num_computed_tokens - n
            context += before + n
            if n == 1 and before >= request.num_prompt_tokens:
                decodes += 1
            else:
                prefills.append((n, before))
        self._pending = {
            "kind": "step",
            "t": started,
            "prefills": prefills,
            "decodes": decodes,
            "context": context,
            "new": len(output.scheduled_new_reqs),
            "scheduled_at": time.perf_counter(),
        }
        return output

    def update_from_output(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().update_from_output(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        record = self._pending
        if record is not None:
            self._pending = None
            record["compute_s"] = time.perf_counter() - record.pop("scheduled_at")
            record["busy"] = bool(self.running or self.waiting)
            self._write(record)
        return result

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._write({"kind": "finish", "id": request.request_id, "t": time.time()})
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]


def _timed_scheduler_class() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return type("TimedScheduler", (_StepLog, Scheduler), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    """``TimedScheduler`` is built on first access (vLLM resolves it by this name)."""
    if name == "TimedScheduler":
        cls = _timed_scheduler_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- measuring on the CPU engine ----------------------------------------------------------


def _tool_sleeps(programs: Sequence[Any]) -> dict[str, float]:
    return {
        f"{p.pid}-{k}": turn.tool_s
        for p in programs
        for k, turn in enumerate(p.turns)
        if k < len(p.turns) - 1
    }


async def _calibrate(config: Any, model: Path, programs: Sequence[Any], log: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from enginehook.tools import bench

    args = bench._engine_args(
        config, model, None, scheduler_cls="simulator.studies.calibration.TimedScheduler"
    )
    os.environ[LOG_ENV] = str(log)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    try:
        warm = bench.make_trace(bench.BenchConfig(programs=2, seed=99), 0.01)
        await bench._replay(engine, warm, 99)
        await engine.reset_prefix_cache()
        with log.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"kind": "mark"}) + "\n")
        await bench._replay(engine, list(programs), config.seed)
    finally:
        engine.shutdown()
        os.environ.pop(LOG_ENV, None)


def measure_steps(config: Any, model: Path, programs: Sequence[Any], log: Path) -> Calibration:
    """Replay ``programs`` once on the stock scheduler with step logging; the calibration
    from the replay after the warm-up (``log`` receives the raw records)."""
    import asyncio

    log.write_text("")
    asyncio.run(_calibrate(config, model, programs, log))
    return read_calibration(log, programs)


def read_calibration(log: Path, programs: Sequence[Any]) -> Calibration:
    """The calibration in a step log written by :func:`measure_steps`."""
    try:
        text = log.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read step log {str(log)!r}: {error.strerror}") from None
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    marks = [i for i, r in enumerate(records) if r["kind"] == "mark"]
    limits = [r for r in records if r["kind"] == "limits"]
    measured = limits + records[marks[-1] + 1 :] if marks else records
    return calibration_from_log(measured, _tool_sleeps(programs))
