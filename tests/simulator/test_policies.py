"""Scheduling policies: registry, waiting order, TTL rules, online learning."""

import pytest

from enginehook.core.host import FinishedTurn
from enginehook.core.rules import SchedulingRules
from estimator import RequestFacts
from simulator.engine import EngineConfig, Request
from simulator.policies import POLICIES, get_scheduling_policy, paper_tool_key
from simulator.sim import Simulation
from simulator.trace import Program, Turn
from simulator.workloads import generate

HW = "llama3.1-8b-h100"


def _request(pid: str, arrival: float, program_arrival: float, preempted: bool = False) -> Request:
    r = Request(f"{pid}#x", pid, 1, arrival, program_arrival, 100, 10)
    r.preempted = preempted
    return r


def test_registry_names_and_error():
    assert {
        "vllm",
        "autellix",
        "infercept",
        "continuum-preview",
        "continuum",
        "cachettl",
        "oracle",
        "program-fcfs",
        "static-ttl",
        "agentinfer",
        "vllm-cache-aware",
    } <= set(POLICIES)
    with pytest.raises(
        ValueError, match="unknown policy 'lifo'; valid: agentinfer, autellix, cachettl"
    ):
        get_scheduling_policy("lifo")


def _sim(spec: str, requests: list[Request], pinned: tuple[str, ...] = ()) -> Simulation:
    """A simulation whose controller has seen ``requests``' programs arrive and holds a
    pin for each program in ``pinned``."""
    sim = Simulation([], get_scheduling_policy(spec), HW)
    for r in requests:
        sim.controller.arrived(r.program_id, r.program_arrival, r.program_arrival)
    for program in pinned:
        sim.pins.pin(program, 1, 0.0, 60.0, handle=1)
    return sim


def _turn(tool_duration_s: float = 1.0) -> FinishedTurn:
    return FinishedTurn("p", "bash", "ls", context_tokens=100, true_duration_s=tool_duration_s)


def test_vllm_is_request_fcfs_and_continuum_is_program_fcfs_with_pins_first():
    old = _request("old", arrival=10.0, program_arrival=0.0)
    new = _request("new", arrival=5.0, program_arrival=4.0)
    pinned = _request("pinned", arrival=11.0, program_arrival=6.0)
    preempted = _request("pre", arrival=12.0, program_arrival=9.0, preempted=True)
    queue = [old, new, pinned, preempted]
    vllm = _sim("vllm", queue, pinned=("pinned",))
    assert [r.program_id for r in sorted(queue, key=vllm._key)] == ["pre", "new", "old", "pinned"]
    continuum = _sim("continuum", queue, pinned=("pinned",))
    order = sorted(queue, key=continuum._key)
    assert [r.program_id for r in order] == ["pre", "pinned", "old", "new"]
    preview = _sim("continuum-preview", queue, pinned=("pinned",))
    order = sorted(queue, key=preview._key)
    assert [r.program_id for r in order] == ["pinned", "old", "new", "pre"]


def test_autellix_serves_least_attained_service_first():
    busy = _request("busy", arrival=1.0, program_arrival=0.0)
    fresh = _request("fresh", arrival=2.0, program_arrival=2.0)
    sim = _sim("autellix", [busy, fresh])
    take = lambda: (0, 0)  # noqa: E731  (never pins)
    sim.controller.finished(FinishedTurn("busy", "bash", service_s=5.0), 1.0, take)
    assert sorted([busy, fresh], key=sim._key)[0] is fresh


def test_infercept_ttl_is_the_discard_waste_break_even():
    policy = get_scheduling_policy("infercept")
    policy.bind(HW, False)
    policy.other_context = lambda: 30_000
    facts = RequestFacts(tool="bash", tool_args="ls", context_tokens=10_000)
    assert policy.models is not None
    forward = policy.models.cost.prefill_s(10_000)
    assert policy.decide(facts, _turn()).ttl_s == pytest.approx(forward * 4.0)


def test_oracle_pins_exactly_when_it_pays():
    policy = get_scheduling_policy("oracle")
    policy.bind(HW, False)
    facts = RequestFacts(tool="bash", tool_args="ls", context_tokens=60_000)
    assert policy.decide(facts, _turn(0.1)).ttl_s == pytest.approx(0.1, abs=1e-5)
    assert policy.decide(facts, _turn(600.0)).ttl_s == 0.0


def test_paper_tool_key():
    assert paper_tool_key("bash", "/usr/bin/python x.py") == "python"
    assert paper_tool_key("bash", "") == "bash"
    assert paper_tool_key("web_search", '{"query": "x"}') == "web_search"


def test_continuum_learns_durations_eta_and_queue_delay_online():
    programs = generate("swe", 60, rate=0.3, seed=2)
    policy = get_scheduling_policy("continuum")
    Simulation(programs, policy, HW, EngineConfig(kv_tokens=300_000)).run()
    models = policy.models
    assert models is not None
    stats = models.workload("default")
    assert stats.eta.n_programs == 60
    assert 0.5 < stats.eta.get() <= 1.0  # near-fixed turn counts: memoryful
    assert stats.queue.n_samples > 0
    calls = sum(len(p.turns) - 1 for p in programs)
    assert models.durations.tenant_samples("default") == calls
    assert "cd" in models.durations.tools("default")  # keyed by the command's first word


def test_policy_specs_with_parameters():
    policy = get_scheduling_policy("continuum(pressure=running, victim=lowest-loss)")
    assert policy.label == "continuum(pressure=running, victim=lowest-loss)"
    assert policy.rules.pressure.value == "running"
    capped = get_scheduling_policy("cachettl(ttl_cap_s=30,budget_share=0.25)")
    assert capped.rules.ttl_cap_s == 30.0
    assert capped.rules.budget_share == 0.25
    assert get_scheduling_policy("cachettl").rules == SchedulingRules()
    with pytest.raises(
        ValueError, match="no parameter 'foo'; valid: admission, admission_interval_s, budget_share"
    ):
        get_scheduling_policy("continuum(foo=1)")
    with pytest.raises(ValueError, match="policy 'continuum': victim must be one of: latest"):
        get_scheduling_policy("continuum(victim=random)")
    with pytest.raises(ValueError, match="policy 'cachettl': ttl_cap_s must be a number >= 0"):
        get_scheduling_policy("cachettl(ttl_cap_s=-1)")
    with pytest.raises(ValueError, match="has no parameter 'pressure'; valid: none"):
        get_scheduling_policy("vllm(pressure=always)")
    with pytest.raises(ValueError, match="expected key=value"):
        get_scheduling_policy("cachettl(oops)")


def test_pin_budget_and_cap_reach_the_pin_table():
    programs = generate("swe", 30, rate=0.3, seed=1)
    sim = Simulation(
        programs, get_scheduling_policy("cachettl(ttl_cap_s=0.05,budget_share=0.1)"), HW
    )
    assert sim.pins.ttl_cap_s == 0.05
    assert sim.pins.budget_blocks == int(0.1 * sim.engine.pool.num_blocks)
    sim.run()
    assert len(sim.results) == 30


def test_autellix_preempts_the_worst_priority_running_request():
    light = _request("light", arrival=5.0, program_arrival=5.0)
    heavy = _request("heavy", arrival=1.0, program_arrival=0.0)
    sim = _sim("autellix", [light, heavy])
    take = lambda: (0, 0)  # noqa: E731  (never pins)
    sim.controller.finished(FinishedTurn("heavy", "bash", service_s=10.0), 1.0, take)
    assert sim.engine._victim([heavy, light]) is heavy
    assert _sim("vllm", [light, heavy]).engine._victim([heavy, light]) is light


def test_tool_keys_follow_the_paper_for_continuum_and_the_hook_for_cachettl():
    programs = generate("swe", 80, rate=0.3, seed=3)
    continuum = get_scheduling_policy("continuum")
    Simulation(programs, continuum, HW, EngineConfig(kv_tokens=300_000)).run()
    key = continuum.tool_key("bash", "cd /testbed && grep -n x y.py")
    assert key == "cd"
    assert continuum.models is not None
    decision = continuum.decide(
        RequestFacts(tool=key, tool_args="cd /testbed && grep x", context_tokens=30_000), _turn()
    )
    assert decision.basis == "tool"  # cd has > 100 samples: its own CDF, not the pooled one
    ours = get_scheduling_policy("cachettl")
    Simulation(programs, ours, HW, EngineConfig(kv_tokens=300_000)).run()
    assert ours.tool_key("bash", "cd /testbed && ls") == "bash"
    assert ours.models is not None
    assert ours.models.durations.tools("default") == ["bash"]
    assert "cd+grep" in ours.models.durations.signatures_of("bash", "default")


def test_oracle_law_decides_on_the_law_around_the_call_not_on_its_draw():
    # 60 programs call `sleep`; from the 30th on every call takes 6x as long, with a spread.
    def program(i: int) -> Program:
        duration = (6.0 if i >= 30 else 1.0) * (1.0 + (i % 5) / 10)
        call = Turn(100, 10, "bash", "sleep 1", duration)
        return Program(f"p{i}", float(i), (call, Turn(10, 10)))

    programs = [program(i) for i in range(60)]
    policy = get_scheduling_policy("oracle-law(law_samples=10)")
    policy.bind(HW, False)
    policy.see_trace(programs)
    facts = RequestFacts(tool="bash", tool_args="sleep 1", context_tokens=120_000)

    def ttl(i: int) -> float:
        call = programs[i].turns[0]
        turn = FinishedTurn(
            f"p{i}", "bash", "sleep 1", 120_000, true_duration_s=call.tool_duration_s
        )
        return policy.decide(facts, turn).ttl_s

    # Before the change: the longest duration of the old law (1.4 s), whatever this call's own.
    assert ttl(10) == pytest.approx(1.4)
    assert ttl(12) == pytest.approx(1.4)
    # Half a window after the change it already decides on the new law (longest 8.4 s):
    # no lag, no samples to wait for.
    assert ttl(35) == pytest.approx(8.4)
    assert ttl(59) == pytest.approx(8.4)


def test_oracle_law_needs_the_trace():
    policy = get_scheduling_policy("oracle-law")
    policy.bind(HW, False)
    facts = RequestFacts(tool="bash", tool_args="ls", context_tokens=60_000)
    with pytest.raises(ValueError, match="oracle-law decides only in a simulation"):
        policy.decide(facts, _turn(0.1))
