"""The 2026 peers: ThunderAgent, llm-d program-aware fairness, SGLang session cache."""

from enginehook.core.host import FinishedTurn
from enginehook.core.pins import Pin
from enginehook.core.registries import VICTIMS
from estimator import RequestFacts
from simulator.engine import EngineConfig, Request
from simulator.policies import POLICIES, get_scheduling_policy
from simulator.sim import Simulation
from simulator.trace import Program, Turn

HW = "llama3.1-8b-h100"


def _request(pid: str, arrival: float, preempted: bool = False) -> Request:
    r = Request(f"{pid}#x", pid, 1, arrival, arrival, 100, 10)
    r.preempted = preempted
    return r


def _finish(sim: Simulation, pid: str, context: int, output: int) -> None:
    turn = FinishedTurn(pid, "bash", "ls", context_tokens=context, output_tokens=output)
    sim.controller.finished(turn, 1.0, lambda: (0, 0))


def test_peers_are_registered():
    assert {"thunderagent", "llmd-fairness", "sglang-session"} <= set(POLICIES)


def test_llmd_fairness_serves_the_least_weighted_tokens_first_then_the_oldest():
    sim = Simulation([], get_scheduling_policy("llmd-fairness"), HW)
    heavy, light, fresh, old = (_request(p, t) for p, t in (("h", 1), ("l", 2), ("f", 4), ("o", 3)))
    for r in (heavy, light, fresh, old):
        sim.controller.arrived(r.program_id, r.arrival, r.arrival)
    _finish(sim, "h", 10_000, 100)  # 10,000 + 100 (prompt 9,900 + 2 × 100)
    _finish(sim, "l", 2_000, 500)  # 2,500: more output, still less service
    assert sim.controller.attained_tokens("h") == 10_100
    order = sorted([heavy, light, fresh, old], key=sim._key)
    assert [r.program_id for r in order] == ["o", "f", "l", "h"]
    preempted = _request("h", 9.0, preempted=True)
    assert sorted([fresh, preempted], key=sim._key)[0] is preempted


def test_pinned_las_puts_pins_first_then_least_attained_service():
    sim = Simulation([], get_scheduling_policy("cachettl(ordering=pinned-las)"), HW)
    pinned, served, new = _request("p", 1.0), _request("s", 0.5), _request("n", 3.0)
    for r in (pinned, served, new):
        sim.controller.arrived(r.program_id, r.arrival, r.arrival)
    _finish(sim, "p", 5_000, 10)
    _finish(sim, "s", 1_000, 10)
    sim.pins.pin("p", 1, 0.0, 60.0, handle=1)
    order = sorted([served, new, pinned], key=sim._key)
    assert [r.program_id for r in order] == ["p", "n", "s"]


def test_least_recent_victims_go_oldest_pin_first():
    pins: list[Pin[int]] = [
        Pin("a", 4, 5.0, 1e9, 1e9),
        Pin("b", 4, 1.0, 1e9, 1e9),
        Pin("c", 4, 3.0, 1e9, 1e9),
    ]
    chosen = VICTIMS["least-recent"](pins, 6, 10.0, ())
    assert [p.program_id for p in chosen] == ["b", "c"]


def test_sglang_session_keeps_a_session_until_it_closes_or_memory_is_needed():
    policy = get_scheduling_policy("sglang-session")
    policy.bind(HW, False)
    facts = RequestFacts(tool="bash", tool_args="pytest", context_tokens=1_000)
    turn = FinishedTurn("p", "bash", "pytest", context_tokens=1_000)
    assert policy.decide(facts, turn).ttl_s > 86_400  # no TTL: only close or pressure end it
    # Two programs whose contexts cannot both stay: the older session is evicted for
    # the newer one's next turn, never the other way round, and nothing is left pinned.
    a = Program("a", 0.0, (Turn(900, 10, "bash", "ls", 30.0), Turn(10, 2)))
    b = Program("b", 1.0, (Turn(900, 10, "bash", "ls", 1.0), Turn(10, 2)))
    sim = Simulation([a, b], policy, HW, EngineConfig(kv_tokens=100 * 16))
    result = sim.run()
    assert result.pins == {"pressure": 1, "hit": 1}  # a's pin goes for b; b's pays
    assert sim.pins.pinned_blocks == 0


def test_thunderagent_holds_a_program_that_does_not_fit_until_memory_frees():
    # The pool holds one context at a time: b's first turn waits while a runs its tool
    # (a's KV counts as in use), then goes once a ends; nothing is ever pinned.
    a = Program("a", 0.0, (Turn(900, 10, "bash", "ls", 3.0), Turn(10, 2)))
    b = Program("b", 0.5, (Turn(900, 10),))
    sim = Simulation(
        [a, b], get_scheduling_policy("thunderagent"), HW, EngineConfig(kv_tokens=1_600)
    )
    result = sim.run()
    by_id = {r.program_id: r for r in result.programs}
    assert by_id["b"].first_turn_wait_s > 3.0
    assert by_id["a"].finish_s < by_id["b"].finish_s
    assert result.pins == {}
    assert sim.controller.admission is not None
    assert sim.controller.admission.pauses == 1
    assert sim.controller.admission.resumes == 1


def test_a_head_start_puts_new_programs_first_turns_ahead_of_returning_turns():
    def order(spec: str) -> list[str]:
        sim = Simulation([], get_scheduling_policy(spec), HW)
        old, new, pinned = _request("old", 1.0), _request("new", 50.0), _request("pin", 2.0)
        old.program_arrival = 0.0
        sim.controller.arrived("old", 0.0, 0.0)
        sim.controller.arrived("pin", 0.5, 0.5)
        sim.controller.arrived("new", 50.0, 50.0)
        _finish(sim, "old", 1_000, 10)  # old and pin have been served: returning turns
        _finish(sim, "pin", 1_000, 10)
        sim.pins.pin("pin", 1, 0.0, 60.0, handle=1)
        preempted = _request("pre", 60.0, preempted=True)
        sim.controller.arrived("pre", 60.0, 60.0)
        queue = [old, new, pinned, preempted]
        return [r.program_id for r in sorted(queue, key=sim._key)]

    # The head start alone (new programs not over pins): pinned programs stay first.
    head = "cachettl(first_turn_over_pins=0,first_turn_head_start_s={})"
    assert order(head.format(0)) == ["pre", "pin", "old", "new"]
    assert order(head.format(30)) == ["pre", "pin", "old", "new"]
    assert order(head.format(60)) == ["pre", "pin", "new", "old"]
    assert order(head.format("inf")) == ["pre", "pin", "new", "old"]
    # The default: a new program's first turn goes ahead of the pinned one too.
    assert order("cachettl") == ["pre", "new", "pin", "old"]
