"""``cachettl bench vllm``'s third engine, stock vLLM whose KV pool never evicts: its pool is
computed from the trace, and the report gives the hook's distance to it (the bench runs
engines for minutes, so it is a command; these tests check its arithmetic and report)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from enginehook.tools.bench import (
    BenchConfig,
    BenchResult,
    compare,
    context_blocks,
    distance,
    make_trace,
    markdown,
    reachable_prefix,
    unbounded_blocks,
    write,
)


def test_the_unbounded_pool_holds_every_program_of_the_trace_at_once() -> None:
    config = BenchConfig()
    trace = make_trace(config, 0.1)
    blocks = unbounded_blocks(trace, config.block_size)
    for program in trace:
        tokens = sum(t.input_tokens + t.output_tokens for t in program.turns)
        # every block of its full context, and a partial block per turn recomputed
        assert context_blocks(program, 32) == math.ceil(tokens / 32) + len(program.turns)
    needed = sum(context_blocks(p, 32) for p in trace)
    assert blocks >= needed * 1.1 + 64
    assert blocks > 5 * config.blocks  # far beyond the contended pool the other two share
    # compression changes when turns come, not what they hold
    assert blocks == unbounded_blocks(make_trace(config, 1.0), 32)


def test_a_returning_turn_can_find_the_previous_context_in_full_blocks() -> None:
    # the previous turn's last generated token has no KV; a partial block is not cached
    assert reachable_prefix(97, 32) == 96
    assert reachable_prefix(96, 32) == 64
    assert reachable_prefix(20, 32) == 0


def test_distance_to_the_bound() -> None:
    stock = {"mean_jct_s": 20.0, "first_turn_wait_p90_s": 4.0}
    hook = {"mean_jct_s": 12.0, "first_turn_wait_p90_s": 1.0}
    bound = {"mean_jct_s": 10.0, "first_turn_wait_p90_s": 2.0}
    d = distance(stock, hook, bound)
    assert d["mean_jct_over_bound"] == 1.2
    assert d["mean_jct_gap_closed"] == 0.8  # (20 - 12) / (20 - 10)
    assert d["first_turn_wait_p90_over_bound"] == 0.5
    assert d["first_turn_wait_p90_gap_closed"] == 1.5  # beyond the bound: more than all
    at_bound = distance(bound, hook, bound)
    assert at_bound["mean_jct_gap_closed"] is None  # no gap to close


def _result(jct: float, wait: float, reachable: int, cached: int) -> BenchResult:
    return BenchResult(
        jct_s=[jct, jct],
        first_wait_s=[wait, wait],
        prompt_tokens=1000,
        cached_tokens=cached,
        returning_reachable=reachable,
        returning_cached=cached,
    )


def test_the_report_carries_the_third_engine_and_the_distance(tmp_path: Path) -> None:
    config = BenchConfig(programs=4, regimes={"saturated": 0.1})
    results = {
        "stock": {"saturated": _result(20.0, 4.0, 800, 200)},
        "cachettl": {"saturated": _result(12.0, 1.0, 800, 700)},
        "unbounded": {"saturated": _result(10.0, 2.0, 800, 800)},
    }
    report = compare(config, results)
    assert report["unbounded"]["mean_jct_s"] == 10.0
    assert report["distance"]["mean_jct_gap_closed"] == 0.8
    assert report["regimes"]["saturated"]["unbounded"]["returning_hit_share"] == 1.0
    assert report["config"]["unbounded_blocks"] == unbounded_blocks(make_trace(config, 1.0), 32)
    text = markdown(report, "cachettl bench vllm --programs 4")
    assert "| saturated | unbounded | 10.00 | 10.00 | 2.000 | 80.0% | 100.0% |" in text
    assert "| saturated | 0.60 | 0.60 | 0.25 | 1.20 | 80% | 0.50 | 150% |" in text
    json_path, md_path = write(report, str(tmp_path / "out"), "cachettl bench vllm")
    assert json.loads(json_path.read_text())["distance"]["mean_jct_over_bound"] == 1.2
    assert md_path.read_text() == markdown(report, "cachettl bench vllm")


def test_without_the_third_engine_the_report_is_the_pair() -> None:
    config = BenchConfig(programs=4, regimes={"saturated": 0.1}, unbounded=False)
    results = {
        "stock": {"saturated": _result(20.0, 4.0, 800, 200)},
        "cachettl": {"saturated": _result(12.0, 1.0, 800, 700)},
    }
    report = compare(config, results)
    assert "unbounded" not in report
    assert "distance" not in report
    assert "| saturated | 0.60 | 0.60 | 0.25 | - | - | - | - |" in markdown(report)
