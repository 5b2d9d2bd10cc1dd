"""``cachettl bench fidelity``: does the simulator predict the CPU engine?

1. **Measure** step times: the saturated trace of ``cachettl bench vllm`` is replayed once
   on the stock scheduler wrapped by :class:`TimedScheduler` (built on first use: importing
   this module does not import vLLM), which logs every step (prefill chunks with their
   cached context, decodes, KV context read), every request's arrival and finish, and the
   scheduler's limits.
2. **Fit** a :class:`FittedStepTimer` to the steps, and the client's own time per turn.
3. **Convert** the bench's programs into simulator programs (:func:`convert_trace`).
4. **Predict** the stock-vs-hook mean-JCT ratio: ``vllm`` for the stock scheduler,
   ``cachettl`` set up as the bench's hook (:func:`hook_policy`) with the hook's cost model
   and its models carried from one replay to the next, as the hook's engine keeps them.
5. **Measure** the ratio with ``enginehook.bench.run_bench`` (saturated regime); print both.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from enginehook.rules import SchedulingRules
from estimator import HardwareProfile, get_profile
from simulator.steptime import StepTimer
from simulator.trace import Program, Turn

__all__ = [
    "Calibration",
    "FittedStepTimer",
    "HookPolicy",
    "StepSample",
    "calibration_from_log",
    "convert_trace",
    "fit_step_timer",
    "hook_policy",
    "predict",
]


@dataclass(frozen=True)
class HookPolicy:
    """The simulator's ``cachettl`` as a hook runs it: the hook's own
    :class:`~enginehook.rules.SchedulingRules`, K and estimator settings."""

    rules: SchedulingRules
    params: dict[str, Any]

    def make(self) -> Any:
        """A fresh simulator policy (one per replay)."""
        from simulator.policies import get_scheduling_policy

        return get_scheduling_policy("cachettl", rules=self.rules, **self.params)

    def with_rules(self, **changes: Any) -> HookPolicy:
        """The same hook with some rules changed."""
        return HookPolicy(self.rules.replace(**changes), self.params)

    def describe(self) -> dict[str, Any]:
        return {"rules": self.rules.as_dict(), **self.params}


def hook_policy(config: Any) -> HookPolicy:
    """The simulator's ``cachettl`` set up as ``cachettl bench vllm`` sets up the hook
    (``config``: an ``enginehook.bench.BenchConfig``): the hook's config as the bench
    writes it (:func:`enginehook.bench.hook_settings`), its rules as they are (what the bench
    leaves unset keeps the hook's defaults), the estimator's TTL cap where it is tighter
    than the rules' cap, and the estimator policy's load-aware cost and per-program η.

    >>> from enginehook.bench import BenchConfig
    >>> hook = hook_policy(BenchConfig())
    >>> hook.rules.ttl_cap_s, hook.rules.victim, hook.params["min_samples"]
    (30.0, 'lowest-loss', 20)
    """
    from enginehook.bench import hook_settings
    from enginehook.config import HookConfig
    from estimator import get_policy

    if config.policy != "cachettl":
        raise ValueError(
            f"the fidelity check models the hook's 'cachettl' policy, not {config.policy!r}"
        )
    hook = HookConfig.from_additional({"cachettl": hook_settings(config)})
    estimator: Any = get_policy("cachettl", **hook.policy_params)
    cap = min(float(estimator.ttl_cap_s), hook.rules.ttl_cap_s)
    params = {
        "min_samples": hook.min_samples,
        "load_aware": bool(estimator.load_aware),
        "per_program": bool(estimator.per_program),
    }
    return HookPolicy(hook.rules.replace(ttl_cap_s=cap), params)


#: The cost-model profile the hook starts from (``HookConfig.profile``).
HOOK_PROFILE = "llama3.1-8b-h100"
#: The hook learns a prefill timing from steps of at least this many tokens.
_MIN_PREFILL_TOKENS = 64
_LOG_ENV = "CACHETTL_STEP_LOG"
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
    """The bench's programs (``enginehook.bench.Program``) as simulator programs: every turn
    but the last calls ``bash`` with the bench's command line; a tool gap is the bench's
    sleep plus ``turn_overhead_s`` (the client's own time between a turn's last token and
    the follow-up's arrival in the engine).

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
        self._log = open(os.environ[_LOG_ENV], "a", encoding="utf-8")  # noqa: SIM115
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


# -- measuring, predicting, comparing ---------------------------------------------------


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

    from enginehook import bench

    args = bench._engine_args(config, model, None, scheduler_cls=f"{__name__}.TimedScheduler")
    os.environ[_LOG_ENV] = str(log)
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
        os.environ.pop(_LOG_ENV, None)


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


def engine_config(limits: dict[str, int], block_size: int, blocks: int, max_num_seqs: int) -> Any:
    """The simulated engine for the bench's settings. vLLM keeps one of its blocks as the
    null block, so the pool has ``blocks − 1`` usable blocks."""
    from simulator.engine import EngineConfig

    return EngineConfig(
        block_size=block_size,
        max_num_batched_tokens=int(limits.get("max_num_batched_tokens", 2048)),
        max_num_seqs=int(limits.get("max_num_seqs", max_num_seqs)),
        kv_tokens=(int(limits.get("num_gpu_blocks", blocks)) - 1) * block_size,
    )


def predict(
    programs: Sequence[Program],
    timer: StepTimer,
    config: Any,
    prefill_timings: Sequence[tuple[int, float]] = (),
    repeats: int = 2,
    hook: HookPolicy | None = None,
) -> dict[str, Any]:
    """Simulated stock (``vllm``) and hook (``hook``, default: ``cachettl``'s defaults)
    replays of ``programs``.

    As in the bench, the hook's engine keeps what it learned across replays (duration
    models, η, T, prefill timings): replay ``k`` starts from replay ``k − 1``'s models.
    Mean JCTs are over all replays' programs.

    Two prefix-hit shares: ``prefix_hit_share`` over every admission (the simulator's
    figure: a request back from preemption is admitted, and hits, again), and
    ``first_admission_hit_share`` over each request's first admission only, as vLLM
    counts a request's ``num_cached_tokens`` (its prefill statistics are recorded when it
    is first scheduled, not after a preemption), which is what the bench measures."""
    from simulator.policies import get_scheduling_policy
    from simulator.sim import Simulation

    class FirstAdmissions(Simulation):
        first_prompt_tokens = 0
        first_hit_tokens = 0

        def on_admit(self, request: Any, now: float) -> None:
            if request.first_admitted_at is None:
                self.first_prompt_tokens += request.prompt_tokens
                self.first_hit_tokens += request.hit_tokens
            super().on_admit(request, now)

    profile = get_profile(HOOK_PROFILE)
    figures: dict[str, Any] = {}
    ours = hook.make if hook is not None else lambda: get_scheduling_policy("cachettl")
    for name, make in (("stock", lambda: get_scheduling_policy("vllm")), ("cachettl", ours)):
        jcts: list[float] = []
        hits = prompts = first_hits = first_prompts = 0
        models = None
        for _ in range(repeats):
            policy = make()
            sim = FirstAdmissions(programs, policy, profile, config, timer=timer)
            if sim.policy.models is not None:
                if models is None:
                    for tokens, seconds in prefill_timings:
                        sim.policy.models.record_prefill(tokens, seconds)
                else:
                    sim.policy.models = models
                models = sim.policy.models
            run = sim.run()
            jcts += [p.jct_s for p in run.programs]
            hits += run.hit_tokens
            prompts += run.prompt_tokens
            first_hits += sim.first_hit_tokens
            first_prompts += sim.first_prompt_tokens
        figures[name] = {
            "mean_jct_s": statistics.fmean(jcts),
            "prefix_hit_share": hits / max(1, prompts),
            "first_admission_hit_share": first_hits / max(1, first_prompts),
        }
    figures["mean_jct_ratio"] = figures["cachettl"]["mean_jct_s"] / figures["stock"]["mean_jct_s"]
    return figures


def run_fidelity(
    config: Any,
    bench_report: dict[str, Any] | None = None,
    log: Path | None = None,
    reuse_log: bool = False,
) -> dict[str, Any]:
    """Steps 1–5: measure step times (``reuse_log``: read them from ``log`` instead), fit,
    convert, predict, and measure (unless ``bench_report`` — a ``cachettl bench vllm
    --json`` report of the same settings — is given)."""
    import tempfile

    from enginehook import bench
    from enginehook.tinymodel import build_tiny_llama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    model_dir = config.model_dir or str(Path.home() / ".cache" / "cachettl" / "tiny-llama")
    model = build_tiny_llama(model_dir)
    compress = config.regimes["saturated"]
    trace = bench.make_trace(config, compress)
    log = log or Path(tempfile.mkdtemp(prefix="cachettl-fidelity-")) / "steps.jsonl"
    if reuse_log:
        calibration = read_calibration(log, trace)
    else:
        calibration = measure_steps(config, model, trace, log)
    timer, quality = fit_step_timer(calibration.samples)
    programs = convert_trace(trace, calibration.turn_overhead_s)
    engine = engine_config(
        calibration.limits, config.block_size, config.blocks, config.max_num_seqs
    )
    spec = hook_policy(config)
    timings = calibration.prefill_timings
    predicted = predict(programs, timer, engine, timings, config.repeats, spec)
    old_budget = spec.with_rules(budget_share=0.3)
    roofline = StepTimer(get_profile(HOOK_PROFILE))
    variants: dict[str, float] = {}
    for label, p, t, e, h in (
        ("roofline 8B/H100 step times", programs, roofline, engine, spec),
        ("no client overhead per turn", convert_trace(trace), timer, engine, spec),
        ("blocks of 16 tokens", programs, timer, replace(engine, block_size=16), spec),
        ("pin budget 30 % (old hook default)", programs, timer, engine, old_budget),
    ):
        variants[label] = predict(p, t, e, timings, config.repeats, h)["mean_jct_ratio"]
    if bench_report is None:
        bench_report = bench.run_bench(config)
    regime = bench_report["regimes"]["saturated"]
    keys = ("mean_jct_s", "prefix_hit_share")
    measured: dict[str, Any] = {n: {k: regime[n][k] for k in keys} for n in ("stock", "cachettl")}
    measured["mean_jct_ratio"] = regime["mean_jct_ratio"]
    error = predicted["mean_jct_ratio"] / measured["mean_jct_ratio"] - 1.0
    return {
        "predicted": predicted,
        "measured": measured,
        "ratio_error": error,
        "within_15_percent": abs(error) <= 0.15,
        "step_model": {**timer.describe(), **quality},
        "turn_overhead_s": calibration.turn_overhead_s,
        "engine": calibration.limits,
        "hook_policy": spec.describe(),
        "variants": variants,
        "step_log": str(log),
    }


def format_report(report: dict[str, Any]) -> str:
    """The side-by-side table."""
    p, m = report["predicted"], report["measured"]
    lines = [
        f"{'':10s} {'predicted':>22s} {'measured':>22s}",
        f"{'':10s} {'mean JCT':>10s} {'hit share':>11s} {'mean JCT':>10s} {'hit share':>11s}",
    ]
    for name in ("stock", "cachettl"):
        lines.append(
            f"{name:10s} {p[name]['mean_jct_s']:9.2f}s {p[name]['prefix_hit_share']:10.1%} "
            f"{m[name]['mean_jct_s']:9.2f}s {m[name]['prefix_hit_share']:10.1%}"
        )
    lines.append(f"{'ratio':10s} {p['mean_jct_ratio']:9.3f}× {'':11s} {m['mean_jct_ratio']:9.3f}×")
    if all("first_admission_hit_share" in p[name] for name in ("stock", "cachettl")):
        lines.append(
            "predicted hit share over first admissions only (as vLLM counts the measured one): "
            f"stock {p['stock']['first_admission_hit_share']:.1%}, "
            f"cachettl {p['cachettl']['first_admission_hit_share']:.1%}"
        )
    verdict = "within" if report["within_15_percent"] else "NOT within"
    lines.append(f"predicted/measured ratio − 1: {report['ratio_error']:+.1%} ({verdict} 15 %)")
    s = report["step_model"]
    lines.append(
        f"step model: {s['step'] * 1e3:.3f} ms + {s['sequence'] * 1e3:.3f} ms/seq + "
        f"{s['prefill token'] * 1e6:.2f} µs/prefill token + {s['attention'] * 1e9:.4f} ns/attn "
        f"+ {s['context token'] * 1e9:.2f} ns/context token; {int(s['steps'])} steps, median "
        f"|error| {s['median_abs_rel_error']:.1%}, R² {s['r2']:.2f}; client overhead per "
        f"turn {report['turn_overhead_s'] * 1e3:.1f} ms"
    )
    lines += [f"  predicted ratio with {k}: {v:.3f}×" for k, v in report["variants"].items()]
    return "\n".join(lines)


def register(bench: Any) -> None:
    """``cachettl bench fidelity``."""
    parser = bench.add_parser(
        "fidelity",
        help="fit the simulator to the CPU engine, predict and measure `bench vllm`'s ratio",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--programs", type=int, default=24, help="agent programs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="alternating replays")
    parser.add_argument(
        "--bench-json",
        metavar="FILE",
        help="a `cachettl bench vllm --json` report of the same settings to compare "
        "with, instead of running the bench again",
    )
    parser.add_argument("--step-log", metavar="FILE", help="where to keep the step log")
    parser.add_argument(
        "--from-log", metavar="FILE", help="read step times from this step log, do not measure"
    )
    parser.set_defaults(handler=_handle)


def _handle(args: Any) -> int:
    from enginehook.bench import BenchConfig

    if args.programs < 1:
        raise ValueError(f"--programs must be >= 1, got {args.programs}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    report_in = None
    if args.bench_json:
        try:
            report_in = json.loads(Path(args.bench_json).read_text())
            report_in["regimes"]["saturated"]["mean_jct_ratio"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"--bench-json: not a bench vllm report ({error})") from None
    config = BenchConfig(
        programs=args.programs,
        seed=args.seed,
        repeats=args.repeats,
        regimes={"saturated": 0.1},
        overhead_pins=0,
    )
    if args.from_log and args.step_log:
        raise ValueError("--from-log and --step-log: give one of them")
    path = args.from_log or args.step_log
    report = run_fidelity(config, report_in, Path(path) if path else None, bool(args.from_log))
    print(json.dumps(report) if args.json else format_report(report))
    return 0
