"""vLLM 0.34's cache-aware admission window and AgentInfer 0.2.0's Progress-TTL as
simulator arms (simulator/policies/stock.py, simulator/policies/agentinfer.py)."""

from __future__ import annotations

import pytest

from simulator.engine import EngineConfig, Request
from simulator.policies import get_scheduling_policy
from simulator.policies.agentinfer import ProgressTtlAdmission, progress_ttl
from simulator.sim import Simulation
from simulator.trace import Program, Turn

HW = "llama3.1-8b-h100"


def _engine_with_a_cached_program(spec: str) -> tuple[Simulation, list[Request]]:
    sim = Simulation([], get_scheduling_policy(spec), HW, EngineConfig(kv_tokens=4_096))
    pool = sim.engine.pool
    pool.allocate(8)
    pool.release("cached", 8, 8)  # "cached"'s 8 blocks stay in the prefix cache
    cold = Request("cold#0", "cold", 0, 0.0, 0.0, 400, 10)
    warm = Request("cached#1", "cached", 1, 1.0, 0.0, 400, 10)
    for request in (cold, warm):
        request.extra["state"] = None
        sim.engine.add(request)
    return sim, [cold, warm]


def test_the_cache_aware_window_puts_a_cached_prompt_first_once_the_cache_is_used():
    sim, (cold, warm) = _engine_with_a_cached_program("vllm-cache-aware(threshold=0)")
    assert list(sim.engine.waiting) == [cold, warm]  # FCFS before the window's reorder
    sim.policy._reorder(sim.engine, sim.config.block_size)  # type: ignore[attr-defined]
    assert list(sim.engine.waiting) == [warm, cold]


def test_the_cache_aware_window_keeps_arrival_order_below_its_threshold():
    sim, (cold, warm) = _engine_with_a_cached_program("vllm-cache-aware")  # threshold 0.5
    sim.policy._reorder(sim.engine, sim.config.block_size)  # type: ignore[attr-defined]
    assert list(sim.engine.waiting) == [cold, warm]


def test_cache_aware_parameters_are_checked():
    with pytest.raises(ValueError, match="threshold must be in"):
        get_scheduling_policy("vllm-cache-aware(threshold=1.5)")


def test_progress_ttl_is_zero_until_its_window_is_full_and_zero_when_it_cannot_pay():
    assert progress_ttl([1.0, 1.2] * 49, impact=5.0) == 0.0  # 98 of 100 samples
    full = [0.8, 1.0, 1.2, 1.1] * 25
    ttl = progress_ttl(full, impact=5.0)
    assert 1.2 <= ttl <= 5.0  # covers the gaps, never past the miss it saves
    assert progress_ttl(full, impact=0.3) == 0.0  # a miss cheaper than any wait


def _warm(admission: ProgressTtlAdmission) -> float:
    """101 programs with one 1-s tool gap each: the interval window fills."""
    t = 0.0
    for i in range(101):
        pid = f"w{i}"
        assert admission.arrived(pid, 100, t)
        admission.acting(pid, 200, t + 0.5)
        admission.arrived(pid, 300, t + 1.5)
        admission.acting(pid, 400, t + 2.0)
        admission.observe(pid, 100, 0.5, t + 2.0)
        admission.ended(pid)
        t += 3.0
    return t


def test_a_program_in_its_tool_holds_a_new_program_out_until_its_ttl_ends():
    admission = ProgressTtlAdmission(30_000, lambda: (0, 0))
    t = _warm(admission)
    assert admission.arrived("a", 19_000, t)
    admission.acting("a", 20_000, t + 1.0)  # in its tool, reserved for the TTL
    deadline = admission.next_tick()
    assert t + 2.0 < deadline <= t + 1.0 + 32.0
    assert not admission.arrived("b", 15_000, t + 1.5)  # 30,000 - 20,100 < 15,100
    assert admission.held("b")
    assert admission.tick(t + 1.6) == []
    assert admission.tick(deadline) == ["b"]  # a paused at its TTL: b goes in
    assert not admission.held("b")


def test_agentinfer_runs_a_trace_and_never_pins():
    a = Program("a", 0.0, (Turn(900, 10, "bash", "ls", 3.0), Turn(10, 2)))
    b = Program("b", 0.5, (Turn(900, 10),))
    sim = Simulation([a, b], get_scheduling_policy("agentinfer"), HW, EngineConfig())
    result = sim.run()
    assert sorted(r.program_id for r in result.programs) == ["a", "b"]
    assert result.pins == {}
    assert isinstance(sim.controller.admission, ProgressTtlAdmission)
