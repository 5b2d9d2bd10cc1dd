"""cachettl's switches, the ablation harness and its robustness workloads."""

from __future__ import annotations

import json
import math

import pytest

from controlplane.cli import main
from enginehook.core.pressure import PressureRule
from enginehook.core.rules import SchedulingRules
from simulator.engine import EngineConfig
from simulator.policies import BASE, IMPROVEMENTS, Cachettl, get_scheduling_policy
from simulator.sim import Simulation, simulate
from simulator.studies.study import (
    UNLIMITED_KV,
    Study,
    cachettl_spec,
    minutes,
    shifted,
    short_tools,
    tenants,
    variants,
)
from simulator.trace import redraw_arrivals
from simulator.workloads import generate


def _trace(n: int = 40, rate: float = 0.06, seed: int = 3) -> list:  # type: ignore[type-arg]
    return redraw_arrivals(generate("swe", n, seed=seed), rate, seed)


def test_everything_off_decides_as_continuum() -> None:
    trace = _trace()
    paper = simulate(trace, "continuum")
    base = simulate(trace, cachettl_spec(BASE))
    assert [p.finish_s for p in base.programs] == [p.finish_s for p in paper.programs]
    assert base.pins == paper.pins
    assert base.hit_tokens == paper.hit_tokens


def test_each_switch_changes_the_policy_it_names() -> None:
    for on in IMPROVEMENTS.values():
        policy = get_scheduling_policy(cachettl_spec({**BASE, **on}))
        for key, value in on.items():
            where = policy.rules if key in SchedulingRules.names() else policy
            assert getattr(where, key) == value
    default = get_scheduling_policy("cachettl")
    assert default.keys == "invocation"  # type: ignore[attr-defined]
    assert default.rules == SchedulingRules()
    with pytest.raises(ValueError, match="parameter 'keys': must be one of: invocation, tool"):
        get_scheduling_policy("cachettl(keys=word)")
    with pytest.raises(ValueError, match="parameter 'drift': must be one of: 0, 1"):
        get_scheduling_policy("cachettl(drift=maybe)")
    with pytest.raises(ValueError, match="parameter 'load_floor': must be in"):
        get_scheduling_policy("cachettl(load_floor=0)")
    slack = get_scheduling_policy("cachettl(ttl_slack=2)")
    assert slack._ttl.ttl_slack == 2.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="parameter 'ttl_slack': must be a finite number >= 1"):
        get_scheduling_policy("cachettl(ttl_slack=0.5)")


def test_simulator_feeds_load_signals_and_progress() -> None:
    seen = []
    policy = get_scheduling_policy("cachettl(load_aware=1,per_program=1)")
    decide = policy.decide

    def spy(facts, turn):
        seen.append(facts)
        return decide(facts, turn)

    policy.decide = spy  # type: ignore[method-assign]
    Simulation(_trace(30, 0.2), policy).run()
    assert seen
    assert all(f.free_tokens is not None and f.waiting_tokens is not None for f in seen)
    assert any(f.waiting_tokens > 0 for f in seen)  # the queue was not always empty
    assert {f.turns_served for f in seen} >= {1, 2, 3}
    pool = 396_000
    assert all(0 <= f.free_tokens <= pool for f in seen)


def test_tool_keys_learn_by_first_word_invocation_keys_by_signature() -> None:
    trace = _trace(20)
    tool = get_scheduling_policy("cachettl(keys=tool)")
    Simulation(trace, tool).run()
    assert tool.models is not None
    assert "cd" in tool.models.durations.tools()
    ours = get_scheduling_policy("cachettl")
    Simulation(trace, ours).run()
    assert ours.models is not None
    assert ours.models.durations.tools() == ["bash"]
    assert len(ours.models.durations.signatures_of("bash")) > 3


def test_shared_priors_are_learned_across_tenants() -> None:
    trace = tenants(_trace(20), 5)
    assert {p.tenant for p in trace} == {f"tenant-{i}" for i in range(5)}
    policy = get_scheduling_policy("cachettl(share=1)")
    Simulation(trace, policy).run()
    assert policy.models is not None
    shared = [k for k, _ in policy.models.durations.items() if k[0] == "shared"]
    assert shared


def test_robustness_workloads_change_only_durations() -> None:
    base = generate("swe", 10, seed=1)
    shift = shifted(base, 8.0)
    for i, (a, b) in enumerate(zip(base, shift, strict=True)):
        factor = 8.0 if i >= 5 else 1.0
        for ta, tb in zip(a.turns, b.turns, strict=True):
            assert tb.tool_duration_s == pytest.approx(ta.tool_duration_s * factor)
            assert (ta.input_tokens, ta.tool_args) == (tb.input_tokens, tb.tool_args)
    slow = [t.tool_duration_s for p in minutes(base, 1) for t in p.turns if t.tool]
    assert any(60 <= d <= 600 for d in slow)
    assert max(slow) <= 600
    assert minutes(base, 1) == minutes(base, 1)
    quick = short_tools(base)
    assert all(
        math.isclose(tq.tool_duration_s, max(t.tool_duration_s / 10, 0.001))
        for p, q in zip(base, quick, strict=True)
        for t, tq in zip(p.turns, q.turns, strict=True)
        if t.tool is not None
    )


def test_variants_cover_each_improvement_and_all() -> None:
    labels = [label for label, _ in variants()]
    assert labels[:8] == [
        "vllm",
        "continuum",
        "thunderagent",
        "llmd-fairness",
        "sglang-session",
        "agentinfer",
        "vllm-cache-aware",
        "paper as cachettl (all off)",
    ]
    assert "+ shared priors" not in labels
    assert "+ shared priors" in dict(variants(True))
    assert {"all together", "cachettl (defaults)", "oracle"} <= set(labels)
    assert dict(variants())["vllm, unlimited KV (no eviction)"] == UNLIMITED_KV


def test_unlimited_kv_row_bounds_what_retention_can_do() -> None:
    study = Study(programs=40, seeds=[3])
    fig = study.measure("swe", 0.09, ["vllm", UNLIMITED_KV])
    isolated = study._iso[("swe", 3)]
    floor = sum(isolated.values()) / len(isolated)
    vllm, unlimited = fig["vllm"][0], fig[UNLIMITED_KV][0]
    assert floor <= unlimited < vllm  # contention for compute only, none for memory


def test_bench_ablation_command(tmp_path, capsys) -> None:
    out = tmp_path / "abl"
    code = main(
        [
            "bench", "ablation", "--workloads", "swe", "--programs", "12", "--seeds", "0",
            "--loads", "1", "--policy", "cachettl(drift=0)", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {"vllm", "continuum", "oracle", "cachettl(drift=0)", f"{UNLIMITED_KV} (no eviction)"}
    rows |= {"thunderagent", "llmd-fairness", "sglang-session"}  # the peers, in every table
    rows |= {"agentinfer", "vllm-cache-aware"}
    assert set(data["swe"]["rows"]) == rows
    assert "| cachettl(drift=0) |" in out.with_suffix(".md").read_text()
    assert main(["bench", "ablation", "--workloads", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err


def test_bench_ablation_with_a_cpu_tier(tmp_path, capsys) -> None:
    out = tmp_path / "tier"
    args = ["bench", "ablation", "--workloads", "swe", "--programs", "12", "--seeds", "0"]
    args += ["--loads", "1", "--policy", "cachettl(cpu_reload=0)", "--out", str(out)]
    assert main([*args, "--cpu-tier-tokens", "100000"]) == 0
    text = out.with_suffix(".md").read_text()
    assert "--cpu-tier-tokens 100000" in text
    assert "CPU tier of 100,000 tokens" in text
    assert main([*args, "--cpu-tier-tokens", "-1"]) == 2
    assert "--cpu-tier-tokens must be >= 0" in capsys.readouterr().err


def test_a_cpu_tier_raises_the_load_where_vllm_reaches_slowdown_3() -> None:
    without = Study(programs=30, seeds=[2])
    tier = Study(programs=30, seeds=[2], cpu_tier_tokens=2_000_000)
    assert tier.rate("swe") > without.rate("swe")


def test_everything_off_decides_as_continuum_with_a_cpu_tier_too() -> None:
    trace = _trace()
    config = EngineConfig(cpu_tier_tokens=400_000)
    paper = simulate(trace, "continuum", config=config)
    base = simulate(trace, cachettl_spec(BASE), config=config)
    assert [p.finish_s for p in base.programs] == [p.finish_s for p in paper.programs]
    assert base.hit_tokens == paper.hit_tokens


def test_tier_settings_replace_pressure_and_order_window_only_with_a_tier() -> None:
    policy = get_scheduling_policy("cachettl(tier_order_window_s=3)")
    assert isinstance(policy, Cachettl)
    tiered = Simulation(_trace(10), policy, config=EngineConfig(cpu_tier_tokens=400_000))
    rules = tiered.controller
    assert (rules.pressure_rule, rules.order_window_s) == (PressureRule.ALWAYS, 3.0)
    tiered.run()
    plain = Simulation(_trace(10), policy).controller  # the same policy without a tier
    assert (plain.pressure_rule, plain.order_window_s) == (PressureRule.RUNNING, 0.0)
    with pytest.raises(ValueError, match="tier_pressure must be one of"):
        get_scheduling_policy("cachettl(tier_pressure=sometimes)")


def test_the_engine_hook_and_the_estimator_ship_the_defaults_the_ablation_chose() -> None:
    from enginehook.config import HookConfig
    from estimator import CachettlPolicy
    from simulator.policies import DEFAULTS

    hook = HookConfig()
    assert hook.policy == "cachettl"
    assert hook.rules == get_scheduling_policy("cachettl").rules  # one object, both hosts
    for name in SchedulingRules.names():
        assert getattr(hook.rules, name) == DEFAULTS[name]
    assert hook.min_samples == DEFAULTS["min_samples"]
    policy = CachettlPolicy()
    assert policy.load_aware == DEFAULTS["load_aware"]
    assert policy.load_floor == DEFAULTS["load_floor"]
    assert policy.per_program == DEFAULTS["per_program"]
    assert policy.prior_samples == DEFAULTS["prior_samples"]
    assert policy.ttl_cap_s == DEFAULTS["ttl_cap_s"]
    assert policy.ttl_slack == DEFAULTS["ttl_slack"]
