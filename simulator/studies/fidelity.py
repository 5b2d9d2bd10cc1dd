"""``cachettl bench fidelity``: does the simulator predict the CPU engine?

1. **Measure** step times (:mod:`simulator.studies.calibration`): the saturated trace of
   ``cachettl bench vllm`` is replayed once on the stock scheduler wrapped by its
   ``TimedScheduler``, which logs every step (prefill chunks with their cached context,
   decodes, KV context read), every request's arrival and finish, and the scheduler's limits.
2. **Fit** a ``FittedStepTimer`` to the steps, and the client's own time per turn.
3. **Convert** the bench's programs into simulator programs (``convert_trace``).
4. **Predict** the stock-vs-hook mean-JCT ratio: ``vllm`` for the stock scheduler,
   ``cachettl`` set up as the bench's hook (:func:`hook_policy`) with the hook's cost model
   and its models carried from one replay to the next, as the hook's engine keeps them.
5. **Measure** the ratio with ``enginehook.tools.bench.run_bench`` (saturated regime); print both.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from enginehook.core.rules import SchedulingRules
from estimator import get_profile
from simulator.steptime import StepTimer
from simulator.studies.calibration import (
    HOOK_PROFILE,
    Calibration,
    convert_trace,
    fit_step_timer,
    measure_steps,
    read_calibration,
)
from simulator.trace import Program

__all__ = ["HookPolicy", "engine_config", "hook_policy", "predict"]


@dataclass(frozen=True)
class HookPolicy:
    """The simulator's ``cachettl`` as a hook runs it: the hook's own
    :class:`~enginehook.core.rules.SchedulingRules`, K and estimator settings."""

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
    (``config``: an ``enginehook.tools.bench.BenchConfig``): the hook's config as the bench
    writes it (:func:`enginehook.tools.bench.hook_settings`), its rules as they are (what the bench
    leaves unset keeps the hook's defaults), the estimator's TTL cap where it is tighter
    than the rules' cap, and the estimator policy's load-aware cost and per-program η.

    >>> from enginehook.tools.bench import BenchConfig
    >>> hook = hook_policy(BenchConfig())
    >>> hook.rules.ttl_cap_s, hook.rules.victim, hook.params["min_samples"]
    (30.0, 'lowest-loss', 20)
    """
    from enginehook.config import HookConfig
    from enginehook.tools.bench import hook_settings
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


# -- measuring, predicting, comparing ---------------------------------------------------


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

    ours = hook.make if hook is not None else lambda: get_scheduling_policy("cachettl")
    figures: dict[str, Any] = {
        name: _replays(make, programs, timer, config, prefill_timings, repeats)
        for name, make in (("stock", lambda: get_scheduling_policy("vllm")), ("cachettl", ours))
    }
    figures["mean_jct_ratio"] = figures["cachettl"]["mean_jct_s"] / figures["stock"]["mean_jct_s"]
    return figures


def _replays(
    make: Any,
    programs: Sequence[Program],
    timer: StepTimer,
    config: Any,
    prefill_timings: Sequence[tuple[int, float]],
    repeats: int,
) -> dict[str, float]:
    """``repeats`` replays of one scheduler (``make()``: a fresh policy), its models carried
    from one replay to the next."""
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
    jcts: list[float] = []
    hits = prompts = first_hits = first_prompts = 0
    models = None
    for _ in range(repeats):
        sim = FirstAdmissions(programs, make(), profile, config, timer=timer)
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
    return {
        "mean_jct_s": statistics.fmean(jcts),
        "prefix_hit_share": hits / max(1, prompts),
        "first_admission_hit_share": first_hits / max(1, first_prompts),
    }


def _calibration(
    config: Any, trace: Sequence[Any], log: Path | None, reuse_log: bool
) -> tuple[Calibration, Path]:
    """Step 1: the CPU engine's steps on the bench's trace (read from ``log`` when
    ``reuse_log``), and the log's path."""
    import tempfile

    from enginehook.tools.tinymodel import build_tiny_llama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    log = log or Path(tempfile.mkdtemp(prefix="cachettl-fidelity-")) / "steps.jsonl"
    if reuse_log:
        return read_calibration(log, trace), log
    model_dir = config.model_dir or str(Path.home() / ".cache" / "cachettl" / "tiny-llama")
    return measure_steps(config, build_tiny_llama(model_dir), trace, log), log


def run_fidelity(
    config: Any,
    bench_report: dict[str, Any] | None = None,
    log: Path | None = None,
    reuse_log: bool = False,
) -> dict[str, Any]:
    """Steps 1–5: measure step times (``reuse_log``: read them from ``log`` instead), fit,
    convert, predict, and measure (unless ``bench_report`` — a ``cachettl bench vllm
    --json`` report of the same settings — is given)."""
    from enginehook.tools import bench

    trace = bench.make_trace(config, config.regimes["saturated"])
    calibration, log = _calibration(config, trace, log, reuse_log)
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
    from enginehook.tools.bench import BenchConfig

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
