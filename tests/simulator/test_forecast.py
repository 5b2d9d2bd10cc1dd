"""The forecast (simulator/forecast.py, ``cachettl forecast``): both arms on the same
replicas, programs rebuilt from a real store as the engines reported them, and the
command's answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.cli import main
from controlplane.records import MissReason, PinOutcome, Tenant, ToolCall, TurnCache
from controlplane.storage import create_store
from simulator.forecast import Interval, arrival_rate, forecast
from simulator.studies.forecasting import programs_from_store
from simulator.trace import write_trace
from simulator.workloads import generate


def test_the_same_policy_on_both_arms_forecasts_no_change() -> None:
    """Both arms run on each replica's same programs: vLLM against vLLM is exactly 1 on
    every figure, so any other ratio is the policy's own."""
    programs = generate("bfcl", 12, rate=0.5, seed=3)
    same = forecast(programs, policy="vllm", replicas=3)
    assert same.mean_jct_ratio == Interval(1.0, 1.0, 1.0)
    assert same.prefill_tokens_ratio == Interval(1.0, 1.0, 1.0)
    assert same.hit_rate_stock == same.hit_rate_hook
    hook = forecast(programs, replicas=3)
    ratio = hook.mean_jct_ratio
    assert ratio.low <= ratio.high
    assert ratio.point > 0
    assert hook.mean_jct_stock_s == same.mean_jct_stock_s  # replica 0 is the record itself


def test_a_record_needs_two_arrival_times() -> None:
    programs = generate("bfcl", 2, rate=0.5, seed=1)
    with pytest.raises(ValueError, match="at least two programs arriving at different times"):
        arrival_rate(programs[:1])
    with pytest.raises(ValueError, match="replicas must be at least 2"):
        forecast(programs, replicas=1)


def test_programs_rebuilt_from_a_real_store(tmp_path: Path) -> None:
    """Two programs' reports in a real SQLite store become two programs: their tools in
    turn order with the measured durations, sizes from the reusable tokens the engine
    reported (else the default), a last turn without a tool; calls outside the window
    or without a finish time are left out."""
    store = create_store(f"sqlite:///{tmp_path / 'cp.sqlite3'}")
    try:
        tenant: Tenant = store.create_tenant("acme", False, "h" * 64, 0.0)

        def call(
            eid: str, program: str, turn: int, at: float | None, reusable: int | None
        ) -> ToolCall:
            cache = TurnCache(MissReason.HIT, reusable_tokens=reusable)
            return ToolCall(
                eid,
                program,
                "bash",
                f"cmd{turn}",
                2.0 + turn,
                at,
                turn,
                1.0,
                PinOutcome.HIT,
                0.0,
                cache,
            )

        store.append_tool_calls(
            tenant,
            [
                call("a1", "a", 1, 1_000.0 + 9, 3_000),
                call("a0", "a", 0, 1_000.0 + 2, 1_200),
                call("b0", "b", 0, 1_000.0 + 5, None),
                call("c0", "c", 0, None, 500),  # no finish time
                call("d0", "d", 0, 5_000.0, 500),  # after the window
            ],
        )
        programs, measured = programs_from_store(store, "acme", until=2_000.0, turn_tokens=800)
        with pytest.raises(ValueError, match="tenant 'nobody' has no tool calls"):
            programs_from_store(store, "nobody")
    finally:
        store.close()
    assert [p.program_id for p in programs] == ["a", "b"]
    a, b = programs
    assert (a.arrival_s, b.arrival_s) == (0.0, 3.0)
    assert [(t.tool, t.tool_args, t.tool_duration_s) for t in a.turns] == [
        ("bash", "cmd0", 2.0),
        ("bash", "cmd1", 3.0),
        (None, None, 0.0),
    ]
    assert [t.input_tokens + t.output_tokens for t in a.turns] == [1_200, 1_800, 800]
    assert [t.output_tokens for t in a.turns] == [200, 200, 200]
    assert [t.input_tokens + t.output_tokens for t in b.turns] == [800, 800]
    assert measured == 2


def test_the_command_forecasts_from_a_trace_and_names_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "record.jsonl"
    write_trace(generate("bfcl", 10, rate=0.5, seed=2), trace)
    assert main(["forecast", "--trace", str(trace), "--replicas", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["programs"] == 10
    assert out["replicas"] == 2
    assert set(out["mean_jct_ratio"]) == {"point", "low", "high"}
    assert main(["forecast", "--db", f"sqlite:///{tmp_path / 'x.sqlite3'}"]) == 2
    assert "--db needs --tenant" in capsys.readouterr().err
