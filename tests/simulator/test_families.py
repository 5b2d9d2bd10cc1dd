"""The generalisation families: each is a valid, seeded trace that changes what it says."""

import math
import statistics
from pathlib import Path

import pytest

from controlplane.cli import main
from simulator.families import (
    FAMILIES,
    HELD_OUT_SEEDS,
    THINK_MEDIAN_S,
    TUNING_SEEDS,
    generate_family,
    parse_family,
)
from simulator.studies.study import WORKLOADS
from simulator.trace import Program, read_trace
from simulator.workloads import generate


def _durations(programs: list[Program], start: int = 0, stop: int | None = None) -> list[float]:
    return [t.tool_duration_s for p in programs[start:stop] for t in p.turns if t.tool]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_is_seeded_and_registered(name: str) -> None:
    a, b = generate(name, 30, seed=3), generate(name, 30, seed=3)
    assert a == b
    assert a != generate(name, 30, seed=4)
    assert all(p.turns[-1].tool is None for p in a)
    assert all(t.tool_duration_s >= 0 for p in a for t in p.turns)
    assert name in WORKLOADS


def test_held_out_seeds_are_not_tuning_seeds() -> None:
    assert len(HELD_OUT_SEEDS) >= 16
    assert not set(HELD_OUT_SEEDS) & set(TUNING_SEEDS)


def test_step_multiplies_every_duration_after_the_point() -> None:
    one = generate_family("step(factor=1,at=0.5)", 40, seed=2)
    six = generate_family("step(factor=6,at=0.5)", 40, seed=2)
    assert _durations(one, 0, 20) == _durations(six, 0, 20)
    for x, y in zip(_durations(one, 20), _durations(six, 20), strict=True):
        assert y == pytest.approx(6 * x)


def test_drift_ends_at_the_factor() -> None:
    one = generate_family("drift(factor=1)", 20, seed=1)
    eight = generate_family("drift(factor=8)", 20, seed=1)
    first = _durations(eight, 0, 1)[0] / _durations(one, 0, 1)[0]
    last = _durations(eight, 19)[0] / _durations(one, 19)[0]
    assert first == pytest.approx(1.0)
    assert last == pytest.approx(8.0)


def test_new_tool_appears_only_after_its_point() -> None:
    programs = generate_family("new-tool(at=0.5,share=0.5)", 40, seed=5)
    args = [[t.tool_args or "" for t in p.turns if t.tool] for p in programs]
    assert not any("docker build" in a for row in args[:20] for a in row)
    assert sum("docker build" in a for row in args[20:] for a in row) > 20


def test_rare_has_a_long_tail_of_signatures() -> None:
    programs = generate_family("rare", 200, seed=1)
    kinds = {t.tool_args for p in programs for t in p.turns if "task_" in (t.tool_args or "")}
    assert len(kinds) > 100


def test_think_time_follows_tracelab_median() -> None:
    base = generate_family("think-time(share=0)", 400, seed=1)
    think = generate_family("think-time(share=1)", 400, seed=1)
    gaps = [y - x for x, y in zip(_durations(base), _durations(think), strict=True)]
    assert statistics.median(gaps) == pytest.approx(THINK_MEDIAN_S, rel=0.15)


def test_pareto_is_heavy_tailed() -> None:
    d = sorted(_durations(generate_family("pareto(alpha=1.1)", 300, seed=1)))
    assert d[-1] > 100 * statistics.median(d)
    assert all(math.isfinite(x) for x in d)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "unknown family 'nope'"),
        ("step(speed=2)", "family step: unknown parameter 'speed'"),
        ("step(factor=x)", "family step: factor must be a number"),
        ("step(at=2)", "family step: at must be in [0, 1]"),
        ("rare(kinds=0.5)", "family rare: kinds must be an integer >= 1"),
        ("pareto(alpha=-1)", "family pareto: alpha must be a finite number >= 0"),
    ],
)
def test_bad_family_names_the_parameter(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_family(text)


def test_trace_generate_accepts_a_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    args = ["trace", "generate", "--workload", "step(factor=4)", "--programs", "5"]
    assert main([*args, "--out", str(out)]) == 0
    assert len(read_trace(out)) == 5
    assert main(["trace", "generate", "--workload", "stepp", "--out", str(out)]) == 2
    assert "unknown workload 'stepp'" in capsys.readouterr().err


def test_studies_take_a_family_with_its_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    from simulator.studies.study import Study

    study = Study(6, [3])
    assert study.base("step(factor=0.125)", 3) == generate_family("step(factor=0.125)", 6, 3)
    assert study.base("step(factor=0.125)", 3) != study.base("step(factor=8)", 3)
    args = ["bench", "seeds", "--workload", "step(factr=2)", "--seeds", "0-1"]
    assert main(args) == 2
    assert "family step: unknown parameter 'factr'" in capsys.readouterr().err
