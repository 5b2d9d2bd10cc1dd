"""Engine behaviour on small, hand-made traces."""

import pytest

from estimator import get_profile
from simulator.engine import EngineConfig
from simulator.kv import BlockPool, CpuTier
from simulator.loop import ARRIVAL, STEP_END, STEP_START, Event, EventLoop
from simulator.policies import get_scheduling_policy
from simulator.sim import Simulation, simulate
from simulator.steptime import StepTimer
from simulator.trace import Program, Turn
from simulator.workloads import generate

HW = "llama3.1-8b-h100"


def _program(pid: str, arrival: float, turns: list[Turn]) -> Program:
    return Program(pid, arrival, tuple(turns))


class _Note(Event):
    def __init__(
        self, time: float, rank: int, log: list[str], text: str, follow: tuple[Event, ...] = ()
    ) -> None:
        super().__init__(time, rank)
        self.log, self.text, self.follow = log, text, follow

    def handle(self, loop: EventLoop) -> list[Event]:
        self.log.append(self.text)
        return list(self.follow)


def test_same_time_order_is_rank_then_scheduling_order():
    log: list[str] = []
    loop = EventLoop()
    loop.schedule(_Note(2.0, STEP_START, log, "start"))
    loop.schedule(_Note(2.0, ARRIVAL, log, "arrival-a"))
    loop.schedule(_Note(2.0, STEP_END, log, "end", (_Note(2.0, ARRIVAL, log, "arrival-c"),)))
    loop.schedule(_Note(2.0, ARRIVAL, log, "arrival-b"))
    loop.schedule(_Note(1.0, STEP_START, log, "early"))
    loop.run()
    assert log == ["early", "end", "arrival-a", "arrival-b", "arrival-c", "start"]
    with pytest.raises(ValueError, match="before now"):
        loop.schedule(_Note(1.0, ARRIVAL, log, "late"))


def test_block_pool_lru_evicts_oldest_program_tail_first():
    pool = BlockPool(20)
    assert pool.allocate(8)
    assert pool.allocate(8)
    pool.release("old", held=8, cached=8)
    pool.release("new", held=8, cached=8)
    assert pool.allocate(4 + 3)  # 4 empty, then 3 from the oldest program's tail
    assert (pool.cached_prefix("old"), pool.cached_prefix("new")) == (5, 8)
    assert pool.take_prefix("new", 6) == 6  # the 2 blocks beyond the hit stay in the queue
    assert pool.free == 20 - 7 - 6
    assert pool.cached_prefix("new") == 0
    assert pool.used == 13
    assert not pool.allocate(100)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_cpu_tier_drops_least_recent():
    tier = CpuTier(100)
    tier.store("a", 40)
    tier.store("b", 40)
    tier.store("a", 50)
    tier.store("c", 30)
    assert (tier.tokens("a"), tier.tokens("b"), tier.tokens("c")) == (50, 0, 30)


def test_single_turn_time_matches_step_model():
    timer = StepTimer(get_profile(HW))
    program = _program("p", 0.0, [Turn(5000, 3)])
    result = simulate([program], "vllm", HW)
    # chunks of 2048, 2048, 904 tokens (the last yields token 1), then 2 decode steps
    expected = (
        timer.step([(2048, 0)], 0, 2048)
        + timer.step([(2048, 2048)], 0, 4096)
        + timer.step([(904, 4096)], 0, 5000)
        + timer.step([], 1, 5001)
        + timer.step([], 1, 5002)
    )
    assert result.programs[0].jct_s == pytest.approx(expected, rel=1e-9)


def test_second_turn_hits_the_prefix_cache():
    program = _program("p", 0.0, [Turn(3200, 10, "ls", None, 0.5), Turn(100, 10)])
    result = simulate([program], "vllm", HW)
    assert result.prompt_tokens == 3200 + 3310
    assert result.hit_tokens == (3209 // 16) * 16  # full blocks of turn 1's context


def test_lru_eviction_and_pin_keep_the_cache():
    # 50 blocks. a runs a 1 s tool; b (long decode) and c arrive meanwhile. Under vllm, c's
    # allocation evicts a's cached prefix; a 2 s pin (continuum-preview) holds it, and c
    # waits for b instead of taking the pin (a new arrival may not release pins while
    # something runs).
    config = EngineConfig(kv_tokens=50 * 16)
    a = _program("a", 0.0, [Turn(300, 2, "ls", None, 1.0), Turn(20, 2)])
    b = _program("b", 0.2, [Turn(480, 10)])
    c = _program("c", 0.21, [Turn(240, 2)])
    full = (301 // 16) * 16
    vllm = simulate([a, b, c], "vllm", HW, config)
    assert vllm.hit_tokens < full
    pinned = simulate([a, b, c], "continuum-preview", HW, config)
    assert pinned.hit_tokens == full
    assert pinned.pins == {"hit": 1}
    assert pinned.pinned_block_seconds > 0


def test_preemption_recomputes_the_most_recent_request():
    config = EngineConfig(kv_tokens=64 * 16)
    programs = [_program(f"p{i}", 0.001 * i, [Turn(300, 200)]) for i in range(4)]
    sim = Simulation(programs, get_scheduling_policy("vllm"), HW, config)
    result = sim.run()
    assert result.preemptions > 0
    assert len(result.programs) == 4
    finish = {p.program_id: p.finish_s for p in result.programs}
    assert finish["p0"] < finish["p3"]  # the oldest is never the victim


def test_chunked_prefill_respects_token_budget():
    config = EngineConfig(max_num_batched_tokens=512)
    program = _program("p", 0.0, [Turn(2000, 1)])
    sim = Simulation([program], get_scheduling_policy("vllm"), HW, config)
    sim.run()
    assert sim._steps == 4  # 512 + 512 + 512 + 464


def test_max_num_seqs_limits_the_batch():
    config = EngineConfig(max_num_seqs=1)
    programs = [_program("a", 0.0, [Turn(100, 50)]), _program("b", 0.0, [Turn(100, 50)])]
    result = simulate(programs, "vllm", HW, config)
    a, b = sorted(result.programs, key=lambda p: p.finish_s)
    assert b.first_turn_wait_s >= a.jct_s - 1e-9


def test_runs_are_deterministic_and_finish_everything():
    programs = generate("swe", 40, rate=0.2, seed=4)
    config = EngineConfig(kv_tokens=200_000)
    for policy in ("vllm", "continuum", "cachettl", "autellix", "infercept"):
        first = simulate(programs, policy, HW, config)
        again = simulate(programs, policy, HW, config)
        assert [p.finish_s for p in first.programs] == [p.finish_s for p in again.programs]
        assert len(first.programs) == 40


def test_fast_forward_equals_step_by_step():
    # With a huge horizon the decode run folds into one event; the finish time must equal
    # the sum of single steps.
    timer = StepTimer(get_profile(HW))
    program = _program("p", 0.0, [Turn(100, 300)])
    result = simulate([program], "vllm", HW)
    expected = timer.step([(100, 0)], 0, 100)
    for j in range(299):
        expected += timer.step([], 1, 101 + j)
    assert result.programs[0].jct_s == pytest.approx(expected, rel=1e-9)
    assert result.steps == 300


def test_a_step_start_waits_for_an_arrival_at_its_time():
    # A step ends exactly when a turn arrives: the next step starts after the arrival (the
    # loop's same-time order), so the turn joins that step instead of waiting a step.
    timer = StepTimer(get_profile(HW))
    first_step = timer.step([(100, 0)], 0, 100)
    programs = [_program("a", 0.0, [Turn(100, 5)]), _program("b", first_step, [Turn(100, 5)])]
    result = simulate(programs, "vllm", HW)
    waits = {p.program_id: p.first_turn_wait_s for p in result.programs}
    assert waits == {"a": 0.0, "b": 0.0}


def test_engine_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_tokens must hold at least one block"):
        EngineConfig(kv_tokens=3)


@pytest.mark.parametrize(
    "policy",
    [
        "vllm",
        "autellix",
        "infercept",
        "continuum-preview",
        "continuum",
        "cachettl",
        "oracle",
        "static-ttl",
        "thunderagent",
        "llmd-fairness",
        "sglang-session",
        "cachettl(ordering=pinned-las)",
        "cachettl(admission=thunderagent)",
    ],
)
@pytest.mark.parametrize("cpu", [0, 100_000])
def test_every_block_comes_back(policy, cpu):
    # A small pool under heavy load: many preemptions and pressure releases; afterwards
    # no block may be missing or double-counted.
    programs = generate("swe", 25, rate=0.5, seed=7)
    config = EngineConfig(kv_tokens=160_000, cpu_tier_tokens=cpu)
    sim = Simulation(programs, get_scheduling_policy(policy), HW, config)
    result = sim.run()
    assert len(result.programs) == 25
    pool = sim.engine.pool
    assert pool.used == 0
    assert pool.free == pool.num_blocks
    assert sim.pins.pinned_blocks == 0
    assert not sim.engine.running
    assert not sim.engine.waiting


def test_cpu_tier_holds_the_latest_prefix_of_a_pinned_turn():
    # a's first turn is pinned (2 s, preview policy), the pin expires during a 5 s tool,
    # b then evicts a's GPU copy: a's return reloads its whole prefix from the CPU tier,
    # because the tier is written through when a turn finishes, pinned or not.
    config = EngineConfig(kv_tokens=50 * 16, cpu_tier_tokens=10_000)
    a = _program("a", 0.0, [Turn(300, 2, "ls", None, 5.0), Turn(20, 2)])
    b = _program("b", 3.0, [Turn(700, 2)])
    result = simulate([a, b], "continuum-preview", HW, config)
    assert result.pins == {"ttl": 1}
    assert result.hit_tokens == (301 // 16) * 16
    no_tier = simulate([a, b], "continuum-preview", HW, EngineConfig(kv_tokens=50 * 16))
    assert no_tier.hit_tokens < (301 // 16) * 16


def test_a_program_larger_than_the_pool_is_refused():
    program = _program("big", 0.0, [Turn(5000, 10)])
    sim = Simulation([program], get_scheduling_policy("vllm"), HW, EngineConfig(kv_tokens=1024))
    with pytest.raises(ValueError, match="needs 5010 tokens of KV; the pool holds 1024"):
        sim.run()


def test_duplicate_program_ids_are_refused():
    programs = [_program("x", 0.0, [Turn(100, 2)]), _program("x", 1.0, [Turn(100, 2)])]
    with pytest.raises(ValueError, match="program ids must be unique"):
        simulate(programs, "vllm", HW)


def test_admission_waits_until_the_whole_prompt_fits():
    # 40 blocks. a holds 21 and grows while it decodes; b's first chunk (16 blocks) would
    # fit in the 19 free ones, its whole prompt (25) would not. vLLM 0.32 (the default
    # scheduler_reserve_full_isl) keeps b waiting; checking only the first chunk admits it
    # and then preempts it when the blocks run out.
    a = _program("a", 0.0, [Turn(320, 100)])
    b = _program("b", 0.01, [Turn(400, 5)])
    gated = EngineConfig(kv_tokens=40 * 16, max_num_batched_tokens=256)
    chunk_only = EngineConfig(kv_tokens=40 * 16, max_num_batched_tokens=256, reserve_full_isl=False)
    waits = simulate([a, b], "vllm", HW, gated)
    eager = simulate([a, b], "vllm", HW, chunk_only)
    assert waits.preemptions == 0
    assert eager.preemptions > 0
    finish = {p.program_id: p.finish_s for p in waits.programs}
    assert finish["b"] > finish["a"]
