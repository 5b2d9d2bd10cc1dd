"""``cachettl bench cluster --real --real-unbounded``: a third arm of stock engines whose KV
pools never evict, sized from the trace, and the hook's distance to it in the report (the
bench runs engines and routers for minutes, so it is a command; these check its report)."""

from __future__ import annotations

from dataclasses import asdict

from enginehook.tools.bench import BenchConfig, make_trace, unbounded_blocks
from enginehook.tools.clusterbench import (
    RealClusterConfig,
    compared,
    markdown,
    program_scheduling_config,
    unbounded_pool,
)


def _run(jct: float, wait: float, found: float) -> dict[str, float]:
    return {
        "mean_jct_s": jct,
        "first_turn_wait_p90_s": wait,
        "prefix_hit_share": 0.5,
        "returning_hit_share": found,
        "load_1m": 3.0,
    }


def test_each_unbounded_engine_holds_the_whole_trace() -> None:
    trace = BenchConfig(programs=48, blocks=240)
    assert unbounded_pool(trace) == unbounded_blocks(make_trace(trace, 1.0), 32)
    assert RealClusterConfig().unbounded is False  # two more engines: asked for, not default
    # program scheduling behind the unbounded arm counts its own pool
    settings = program_scheduling_config(trace, blocks=unbounded_pool(trace))
    assert settings["token_capacity_per_target"] == unbounded_pool(trace) * 32


def test_the_report_gives_the_hook_distance_to_the_unbounded_arm() -> None:
    stock = [_run(20.0, 4.0, 0.3), _run(22.0, 4.0, 0.3)]
    hook = [_run(12.0, 2.0, 0.9), _run(13.0, 2.0, 0.9)]
    bound = [_run(10.0, 2.0, 1.0), _run(12.0, 4.0, 1.0)]
    figures = compared(stock, hook, bound)
    assert [d["mean_jct_gap_closed"] for d in figures["distances"]] == [0.8, 0.9]
    assert figures["distances"][1]["first_turn_wait_p90_gap_closed"] is None  # no gap
    assert figures["median_distance"]["first_turn_wait_p90_gap_closed"] == 1.0  # the known one
    assert figures["median_distance"]["mean_jct_over_bound"] == (1.2 + 13 / 12) / 2
    config = RealClusterConfig(runs=2, unbounded=True)
    report = {
        "config": asdict(config),
        "load_start": [1.0, 1.0, 1.0],
        "unbounded_blocks": unbounded_pool(config.trace),
        "policies": {"cache_aware": figures},
    }
    text = markdown(report)
    assert f"2 stock engines of {unbounded_pool(config.trace)} blocks" in text
    found = "30% / 90% / 100%"
    assert f"| cache_aware | 0 | 10.00 | 1.20 | 80% | 2.00 | 1.00 | 100% | {found} |" in text
    assert f"| cache_aware | 1 | 12.00 | 1.08 | 90% | 4.00 | 0.50 | - | {found} |" in text
    assert "stock / hook / unbounded by run: cache_aware 3.0, 3.0, 3.0;" in text


def test_without_the_arm_the_report_is_the_pair() -> None:
    figures = compared([_run(20.0, 4.0, 0.3)], [_run(12.0, 2.0, 0.9)])
    assert "unbounded" not in figures
    assert "distances" not in figures
    report = {"config": asdict(RealClusterConfig(runs=1)), "load_start": [1.0, 1.0, 1.0]}
    text = markdown({**report, "policies": {"cache_aware": figures}})
    assert "unbounded" not in text
    assert "stock / hook by run: cache_aware 3.0, 3.0." in text
