"""What a simulated engine publishes as ``/metrics`` (pins counted in the KV usage or not, by
the rule ``pins_in_kv_usage``) and how vllm-router's program scheduling admits by it: with
pins counted as used, a paused program's returning turn waits in the router while its engine
runs nothing; with pins counted as free it is admitted at once. Real simulator runs."""

from __future__ import annotations

import pytest

from simulator.cluster import Cluster, get_router, simulate_cluster
from simulator.cluster.engines import ClusterEngine
from simulator.cluster.progsched import ProgramScheduling
from simulator.engine import EngineConfig
from simulator.studies.cluster import split_specs
from simulator.trace import Program, Turn

SMALL = EngineConfig(kv_tokens=64_000)
#: Pins every turn for 2 s (tools shorter than that), with the rule under test.
PIN_2S = "continuum-preview(pins_in_kv_usage={})"


def _one_program(gap: float = 1.5) -> list[Program]:
    """40,000 prompt tokens (about 0.63 of the pool), a 1.5 s tool call, a short turn."""
    return [Program("a", 0.0, (Turn(40_000, 8, "bash", "ls", gap), Turn(16, 8)))]


def _after_first_turn(
    retention: str, router: str = "program-scheduling", gap: float = 1.5
) -> Cluster:
    """One engine, run until the first turn is done and pinned and the tool call runs."""
    cluster = Cluster(_one_program(gap), router, retention, 1, config=SMALL)
    cluster.run(until=0.0)
    engine = cluster.all[0]
    at = 0.0
    while engine.pin_of("a") is None:
        at += 0.05
        assert at < 10.0, "the first turn never finished"
        cluster.resume(until=at)
    return cluster


@pytest.mark.parametrize("counted", [True, False])
def test_an_idle_engine_publishes_its_pins_as_used_only_under_the_rule(counted: bool) -> None:
    cluster = _after_first_turn(PIN_2S.format(str(counted).lower()))
    engine = cluster.all[0]
    pool = engine.engine.pool
    assert engine.pins.pinned_blocks > 0
    assert pool.used == engine.pins.pinned_blocks  # the pin is all the KV in use
    metrics = engine.metrics()
    assert (metrics.running, metrics.waiting) == (0, 0)
    expected = engine.pins.pinned_blocks / pool.num_blocks if counted else 0.0
    assert metrics.kv_usage == pytest.approx(expected)
    assert metrics.kv_usage > 0.6 if counted else metrics.kv_usage == 0.0


def test_a_stock_engine_publishes_what_its_requests_hold() -> None:
    cluster = Cluster(_one_program(), "program-scheduling", "vllm", 1, config=SMALL)
    cluster.run(until=0.3)  # the first turn is prefilling
    engine = cluster.all[0]
    metrics = engine.metrics()
    assert metrics.running == 1
    assert metrics.kv_usage == pytest.approx(
        engine.engine.pool.used / engine.engine.pool.num_blocks
    )
    assert metrics.kv_usage > 0.0


def test_an_idle_engine_expires_overdue_pins_before_it_publishes() -> None:
    # no scrapes, and the tool call outlasts the 2 s pin
    cluster = _after_first_turn(PIN_2S.format("true"), router="round_robin", gap=3.0)
    engine = cluster.all[0]
    pin = engine.pin_of("a")
    assert pin is not None
    later = pin.expires_at + 0.1
    cluster.call_at(later, lambda now: None)
    cluster.resume(until=later)
    # an idle engine steps no more, so the overdue pin is still in its table...
    assert cluster.loop.now == later
    assert engine.pins.pinned_blocks > 0
    # ...but the hook's idle wake-up would have expired it: what /metrics says
    assert engine.metrics().kv_usage == 0.0
    assert engine.pin_of("a") is None


def _held_then_admitted(counted: bool) -> tuple[float, float, bool]:
    """(when the second turn arrived, when the engine got it, whether the engine ran
    nothing and held the pin while the router held the turn)."""
    cluster = _after_first_turn(PIN_2S.format(str(counted).lower()))
    engine: ClusterEngine = cluster.all[0]
    router = cluster.router
    assert isinstance(router, ProgramScheduling)
    finished = engine.pin_of("a")
    assert finished is not None
    arrival = finished.pinned_at + 1.5
    idle_while_held = True
    at = arrival + 1e-6
    admitted = None
    while admitted is None:
        cluster.resume(until=at)
        if engine.queued_tokens() > 0 or engine.inflight() > 0:
            admitted = at
        elif router.held() and not (engine.inflight() == 0 and engine.pin_of("a") is not None):
            idle_while_held = False
        at += 0.01
        assert at < 400.0
    result = cluster.resume()
    assert len(result.programs) == 1
    return arrival, admitted, idle_while_held and admitted > arrival + 0.02


def test_the_old_signal_holds_the_returning_turn_while_its_engine_runs_nothing() -> None:
    arrival, admitted, held_on_idle = _held_then_admitted(counted=True)
    assert held_on_idle  # held while the engine ran nothing and held the turn's own pin
    assert admitted - arrival > 0.3  # until the pin expired and a scrape saw it
    assert admitted - arrival < 3.5  # the 2 s pin, plus up to a scrape interval


def test_the_new_signal_admits_the_returning_turn_at_once() -> None:
    arrival, admitted, _ = _held_then_admitted(counted=False)
    assert admitted - arrival < 0.02


def test_the_old_signal_costs_the_program_the_hold_and_the_new_one_nothing() -> None:
    old = simulate_cluster(
        _one_program(), "program-scheduling", PIN_2S.format("true"), 1, config=SMALL
    )
    new = simulate_cluster(
        _one_program(), "program-scheduling", PIN_2S.format("false"), 1, config=SMALL
    )
    stock = simulate_cluster(_one_program(), "program-scheduling", "vllm", 1, config=SMALL)
    jct = {k: r.figures()["mean_jct_s"] for k, r in (("old", old), ("new", new), ("vllm", stock))}
    assert jct["old"] > jct["new"] + 0.3
    assert jct["new"] <= jct["vllm"] + 1e-9  # the pin hits; stock hits its LRU cache too


def test_by_count_reads_no_kv_usage_and_does_not_hold_the_turn() -> None:
    old = simulate_cluster(
        _one_program(), "program-scheduling-by-count", PIN_2S.format("true"), 1, config=SMALL
    )
    new = simulate_cluster(
        _one_program(), "program-scheduling-by-count", PIN_2S.format("false"), 1, config=SMALL
    )
    assert old.figures()["mean_jct_s"] == pytest.approx(new.figures()["mean_jct_s"])
    by_count = get_router("program-scheduling-by-count")
    assert isinstance(by_count, ProgramScheduling)
    assert by_count.capacity_share == 0.0


def test_router_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="metrics_interval_s must be > 0"):
        get_router("program-scheduling(metrics_interval_s=0)")


def test_bench_lists_split_outside_parentheses() -> None:
    assert split_specs("a+b(x=1,y=2), c+d ,,e(z=3)") == ["a+b(x=1,y=2)", "c+d", "e(z=3)"]
