"""An admission scheduler with cachettl's retention runs both: the scheduler's mechanism
(pauses, holds, its order) and cachettl's pins (simulator/studies/composition.py)."""

import pytest

from controlplane.cli import main
from enginehook.core.host import FinishedTurn
from simulator.engine import EngineConfig, Request
from simulator.policies import get_scheduling_policy
from simulator.policies.agentinfer import ProgressTtlAdmission
from simulator.sim import RunResult, Simulation
from simulator.studies import provenance
from simulator.studies.composition import PAIRS
from simulator.trace import Program
from simulator.workloads import generate

HW = "llama3.1-8b-h100"


@pytest.fixture(scope="module")
def trace():
    # Contended: 24 SWE programs arriving every ~3 s on a pool of 250k tokens.
    return generate("swe", 24, rate=0.3, seed=0)


def _run(spec: str, trace: list[Program]) -> tuple[Simulation, RunResult]:
    sim = Simulation(trace, get_scheduling_policy(spec), HW, EngineConfig(kv_tokens=250_000))
    return sim, sim.run()


@pytest.mark.parametrize("scheduler", ["thunderagent", "agentinfer"])
def test_composed_admission_pauses_programs_and_pins_hit(trace, scheduler):
    alone, composed = PAIRS[scheduler]
    sim, result = _run(alone, trace)
    assert result.pins == {}  # the scheduler alone never pins
    kind = type(sim.controller.admission)
    assert sim.controller.admission is not None
    assert sim.controller.admission.pauses > 0
    sim, result = _run(composed, trace)
    admission = sim.controller.admission
    assert admission is not None, "the composition dropped the admission"
    assert type(admission) is kind
    assert admission.pauses > 0, "the admission never paused a program"
    assert result.pins.get("hit", 0) > 0, "no pin ever hit: the retention was dropped"


def test_composed_llmd_fairness_orders_by_attained_service_and_pins_hit(trace):
    _, composed = PAIRS["llmd-fairness"]
    assert get_scheduling_policy(composed).rules.ordering == "las"
    _, result = _run(composed, trace)
    assert result.pins.get("hit", 0) > 0
    # The order is llm-d's: least weighted-token service first, not the program's arrival.
    sim = Simulation([], get_scheduling_policy(composed), HW)
    old, light = (
        Request("o#1", "o", 1, 1.0, 1.0, 100, 10),
        Request("l#1", "l", 1, 2.0, 2.0, 100, 10),
    )
    for r in (old, light):
        sim.controller.arrived(r.program_id, r.arrival, r.arrival)
    turn = FinishedTurn("o", "bash", "ls", context_tokens=10_000, output_tokens=100)
    sim.controller.finished(turn, 3.0, lambda: (0, 0))
    assert [r.program_id for r in sorted([old, light], key=sim._key)] == ["l", "o"]


def test_agentinfer_with_pins_reads_used_kv_as_the_hook_publishes_it():
    # With the hook, pinned blocks count as free in vLLM's KV usage unless
    # pins_in_kv_usage; the admission must read that, not the raw pool.
    assert get_scheduling_policy("cachettl-agentinfer").rules.pins_in_kv_usage is False
    sim = Simulation([], get_scheduling_policy("cachettl-agentinfer"), HW)
    admission = sim.controller.admission
    assert isinstance(admission, ProgressTtlAdmission)
    sim.pins._pinned_blocks = 100  # as if pins held 100 blocks the pool counts used
    sim.engine.pool.used += 100
    assert admission._native()[0] == 0
    sim = Simulation([], get_scheduling_policy("cachettl-agentinfer(pins_in_kv_usage=1)"), HW)
    sim.pins._pinned_blocks = 100
    sim.engine.pool.used += 100
    admission = sim.controller.admission
    assert isinstance(admission, ProgressTtlAdmission)
    assert admission._native()[0] == 100 * 16


def test_the_study_writes_one_verdict_file_per_scheduler(tmp_path):
    out = tmp_path / "composition"
    argv = ["bench", "composition", "--workload", "swe", "--load", "1", "--rate", "0.1"]
    names = ["llmd-fairness-pinned", "agentinfer"]
    argv += [
        "--programs",
        "6",
        "--seeds",
        "0-1",
        "--schedulers",
        ",".join(names),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    for name in names:
        text = (tmp_path / f"composition_{name}_swe_1.md").read_text()
        assert f"--against {PAIRS[name][0]}" in text
        assert f"`{PAIRS[name][1]}` seed by seed" in text
        record = provenance.read(text)
        assert record is not None
        assert record["command"] == "cachettl bench composition " + " ".join(argv[2:])


def test_a_request_agentinfer_holds_does_not_keep_its_programs_pin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim = Simulation([], get_scheduling_policy("cachettl-agentinfer"), HW)
    admission = sim.controller.admission
    assert isinstance(admission, ProgressTtlAdmission)
    monkeypatch.setattr(sim.engine, "waiting_programs", lambda: {"a": 1, "b": 1})
    monkeypatch.setattr(admission, "held", lambda program: program == "b")
    assert set(sim.waiting_programs()) == {"a"}
    # The pin of the held program expires; the admissible one's is kept while it waits.
    for program in ("a", "b"):
        sim.pins.pin(program, 1, 0.0, 1.0)
    assert {p.program_id for p in sim.controller.expire(2.0)} == {"b"}
