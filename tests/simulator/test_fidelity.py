"""The fidelity check's conversion, fitting and prediction logic (no engine)."""

import json
import random
from pathlib import Path
from typing import Any

import pytest

from enginehook.config import HookConfig
from enginehook.tools.bench import BenchConfig, make_trace
from estimator import get_policy
from simulator.policies import Cachettl
from simulator.studies.calibration import (
    FittedStepTimer,
    StepSample,
    calibration_from_log,
    convert_trace,
    fit_step_timer,
    read_calibration,
)
from simulator.studies.fidelity import engine_config, hook_policy, predict

TRUE = (2e-3, 3e-4, 1e-5, 5e-9, 2e-8)


def _samples(n: int, noise: float, seed: int = 0) -> list[StepSample]:
    rng = random.Random(seed)
    truth = FittedStepTimer(TRUE)
    out = []
    for _ in range(n):
        prefills = tuple(
            (rng.randint(1, 900), rng.choice([0, 0, 320, 1600])) for _ in range(rng.randint(0, 2))
        )
        decodes = rng.randint(0 if prefills else 1, 8)
        context = sum(n + c for n, c in prefills) + decodes * rng.randint(600, 3000)
        seconds = truth.step(prefills, decodes, context) * (1 + rng.uniform(-noise, noise))
        out.append(StepSample(prefills, decodes, context, seconds))
    return out


def test_fit_recovers_the_coefficients_of_noise_free_steps():
    timer, quality = fit_step_timer(_samples(300, 0.0))
    for got, want in zip(timer.coefficients, TRUE, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert quality["median_abs_rel_error"] < 1e-9
    assert quality["r2"] == pytest.approx(1.0)


def test_fit_with_noise_predicts_step_times_closely():
    samples = _samples(500, 0.2, seed=1)
    timer, quality = fit_step_timer(samples)
    assert all(c >= 0 for c in timer.coefficients)
    assert quality["median_abs_rel_error"] < 0.12
    truth = FittedStepTimer(TRUE)
    for prefills, decodes, context in [
        ([(800, 0)], 0, 800),
        ([], 8, 16000),
        ([(200, 1600)], 4, 9000),
    ]:
        assert timer.step(prefills, decodes, context) == pytest.approx(
            truth.step(prefills, decodes, context), rel=0.1
        )


def test_fit_refuses_too_few_steps():
    with pytest.raises(ValueError, match="at least 5 measured steps"):
        fit_step_timer(_samples(3, 0.0))
    with pytest.raises(ValueError, match="coefficients"):
        FittedStepTimer((1.0, 2.0))


def test_convert_trace_keeps_tokens_tools_and_adds_the_client_overhead():
    bench = make_trace(BenchConfig(programs=6, seed=3), 0.1)
    programs = convert_trace(bench, 0.005)
    assert [p.program_id for p in programs] == sorted(p.pid for p in bench)
    for ours, theirs in zip(programs, sorted(bench, key=lambda p: p.arrival_s), strict=True):
        assert ours.arrival_s == theirs.arrival_s
        assert len(ours.turns) == len(theirs.turns)
        for k, (a, b) in enumerate(zip(ours.turns, theirs.turns, strict=True)):
            assert (a.input_tokens, a.output_tokens) == (b.input_tokens, b.output_tokens)
            if k == len(ours.turns) - 1:
                assert a.tool is None
                assert a.tool_duration_s == 0.0
            else:
                assert (a.tool, a.tool_args) == ("bash", b.tool_args)
                assert a.tool_duration_s == pytest.approx(b.tool_s + 0.005)
    with pytest.raises(ValueError, match="turn_overhead_s"):
        convert_trace(bench, -1.0)


def _step(
    t: float, prefills: list[list[int]], decodes: int, busy: bool, new: int = 0
) -> dict[str, Any]:
    context = sum(n + c for n, c in prefills) + decodes * 1000
    return {
        "kind": "step",
        "t": t,
        "prefills": prefills,
        "decodes": decodes,
        "context": context,
        "new": new,
        "compute_s": 0.004,
        "busy": busy,
    }


def test_calibration_reads_steps_overhead_and_limits():
    limits = {"max_num_batched_tokens": 2048, "max_num_seqs": 8, "num_gpu_blocks": 240}
    records: list[dict[str, Any]] = [
        {"kind": "limits", "limits": limits},
        {"kind": "arrival", "id": "p-0-1a2b3c4d", "t": 0.0},
        _step(0.000, [[700, 0]], 0, True, new=1),
        _step(0.010, [], 1, True),
        _step(0.013, [], 1, False),  # ends idle: the gap to the next step is not a step
        {"kind": "finish", "id": "p-0-1a2b3c4d", "t": 0.016},
        {"kind": "arrival", "id": "p-1-99aa00ff", "t": 0.076},  # 0.05 s tool + 10 ms client
        _step(5.000, [[100, 672]], 0, True, new=1),
        _step(5.006, [], 1, True),
    ]
    calibration = calibration_from_log(records, {"p-0": 0.05})
    assert [round(s.seconds, 6) for s in calibration.samples] == [0.01, 0.003, 0.006]
    assert calibration.samples[2].prefills == ((100, 672),)
    assert calibration.turn_overhead_s == pytest.approx(0.01)
    assert calibration.prefill_timings == [(700, 0.004), (100, 0.004)]
    config = engine_config(calibration.limits, 32, 240, 8)
    assert (config.block_size, config.max_num_seqs, config.kv_tokens) == (32, 8, 239 * 32)


def test_hook_policy_follows_the_bench_and_the_hook_defaults():
    config = BenchConfig()
    policy = hook_policy(config).make()
    assert isinstance(policy, Cachettl)
    hook = HookConfig()  # what the bench leaves at the hook's defaults
    assert policy.min_samples == config.min_samples == 20
    assert policy.rules == hook.rules.replace(ttl_cap_s=30.0)  # the hook's rules object
    estimator: Any = get_policy("cachettl")
    assert policy.load_aware == estimator.load_aware
    assert policy.per_program == estimator.per_program
    windowed = hook_policy(BenchConfig(order_window_s=0.25)).make()
    assert windowed.rules.order_window_s == 0.25
    halved = hook_policy(config).with_rules(budget_share=0.5).make()
    assert halved.rules.budget_share == 0.5
    with pytest.raises(ValueError, match="'fixed'"):
        hook_policy(BenchConfig(policy="fixed"))


def test_predict_runs_both_schedulers_on_the_bench_trace():
    bench = make_trace(BenchConfig(programs=8, seed=0), 0.1)
    timer = FittedStepTimer(TRUE)
    config = engine_config({"max_num_batched_tokens": 2048}, 32, 240, 8)
    figures = predict(convert_trace(bench, 0.005), timer, config, [(700, 0.01)], repeats=2)
    for name in ("stock", "cachettl"):
        assert figures[name]["mean_jct_s"] > 0
        assert 0.0 <= figures[name]["prefix_hit_share"] < 1.0
        assert 0.0 <= figures[name]["first_admission_hit_share"] < 1.0
    assert figures["mean_jct_ratio"] == pytest.approx(
        figures["cachettl"]["mean_jct_s"] / figures["stock"]["mean_jct_s"]
    )


def test_read_calibration_uses_the_replay_after_the_warm_up_mark(tmp_path: Path) -> None:
    limits = {"max_num_batched_tokens": 2048, "max_num_seqs": 8, "num_gpu_blocks": 240}
    warm = [_step(0.0, [[50, 0]], 0, True), _step(1.0, [], 1, True)]
    replay = [_step(2.0, [[700, 0]], 0, True, new=1), _step(2.02, [], 1, False)]
    lines = [{"kind": "limits", "limits": limits}, *warm, {"kind": "mark"}, *replay]
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    calibration = read_calibration(log, [])
    assert [s.prefills for s in calibration.samples] == [((700, 0),)]
    assert calibration.samples[0].seconds == pytest.approx(0.02)
    assert calibration.limits == limits
    with pytest.raises(ValueError, match="cannot read step log"):
        read_calibration(tmp_path / "missing.jsonl", [])


def test_first_admission_hit_share_leaves_out_hits_after_preemption():
    """vLLM records a request's cached tokens when it is first scheduled; a request back
    from preemption hits its own blocks again, which only the every-admission share counts.
    Two single-turn programs with long outputs on a pool of 99 usable blocks: both are
    admitted, their decodes outgrow the pool, the later one is preempted."""
    from simulator.trace import Program, Turn

    programs = [
        Program("a", 0.0, (Turn(600, 1200),)),
        Program("b", 0.01, (Turn(600, 1200),)),
    ]
    config = engine_config({"num_gpu_blocks": 100}, 32, 100, 8)
    figures = predict(programs, FittedStepTimer(TRUE), config, repeats=1)
    stock = figures["stock"]
    assert stock["first_admission_hit_share"] == 0.0  # single turns: nothing to hit first
    assert stock["prefix_hit_share"] > 0.2  # the preempted request's recompute hits
