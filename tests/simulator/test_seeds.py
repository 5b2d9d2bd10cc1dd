"""``cachettl bench seeds``: the paired statistics, seed lists, the command and its errors."""

from __future__ import annotations

import json
import math

import pytest

from controlplane.cli import main
from simulator.metrics import summarise
from simulator.sim import simulate
from simulator.studies.seeds import paired, parse_seeds
from simulator.workloads import generate


def test_a_consistent_small_gain_is_better_and_one_outlier_alone_is_not() -> None:
    theirs = [100.0 + 7.0 * (i % 5) for i in range(16)]
    steady = paired([t - 1.0 - 0.1 * (i % 3) for i, t in enumerate(theirs)], theirs)
    assert (steady.wins, steady.ties, steady.losses) == (16, 0, 0)
    assert steady.sign_p == pytest.approx(2 * 0.5**16)
    assert steady.low <= steady.mean_diff <= steady.high < 0.0
    assert steady.verdict == "better"
    # One seed 50 s better, the other fifteen 0.5 s worse: the mean gains, the seeds do not.
    outlier = paired([theirs[0] - 50.0, *(t + 0.5 for t in theirs[1:])], theirs)
    assert (outlier.wins, outlier.losses) == (1, 15)
    assert outlier.mean_diff < 0.0
    assert outlier.verdict == "no difference"
    worse = paired([t + 2.0 + 0.3 * (i % 4) for i, t in enumerate(theirs)], theirs)
    assert worse.verdict == "worse"
    assert worse.median_ratio > 1.0


def test_ties_count_apart_and_leave_the_sign_test() -> None:
    result = paired([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 4.0, 6.0])
    assert (result.wins, result.ties, result.losses) == (3, 1, 0)
    assert result.sign_p == pytest.approx(0.25)  # 3 of 3 untied: 2 × 0.5³
    assert result.mean_diff == pytest.approx(-1.0)
    same = paired([5.0, 5.0, 5.0], [5.0, 5.0, 5.0])
    assert (same.ties, same.sign_p, same.low, same.high) == (3, 1.0, 0.0, 0.0)
    assert math.isnan(paired([1.0, 2.0], [0.0, 0.0]).median_ratio)  # no ratio to a 0
    with pytest.raises(ValueError, match="same seeds on both sides, got 2 and 1"):
        paired([1.0, 2.0], [1.0])


def test_seed_lists() -> None:
    assert parse_seeds("20-23") == [20, 21, 22, 23]
    assert parse_seeds("3, 1,7-8") == [3, 1, 7, 8]
    for bad, why in [("1,x", "integers or ranges"), ("4", "at least two"), ("1-3,2", "distinct")]:
        with pytest.raises(ValueError, match=why):
            parse_seeds(bad)


def test_bench_seeds_runs_every_policy_on_each_seeds_trace(tmp_path, capsys) -> None:
    out = tmp_path / "seeds_0.2"  # the dot stays in the files' names
    args = ["bench", "seeds", "--workload", "swe", "--programs", "12", "--seeds", "0-2"]
    args += ["--rate", "0.2", "--policy", "cachettl", "--against", "vllm,continuum-preview"]
    assert main([*args, "--out", str(out)]) == 0
    data = json.loads((tmp_path / "seeds_0.2.json").read_text())
    assert data["seeds"] == [0, 1, 2]
    assert data["load"] is None
    # The seed's figures are those of `cachettl simulate --rate 0.2 --seed N` on the trace.
    for k, seed in enumerate(data["seeds"]):
        trace = generate("swe", 12, rate=0.2, seed=seed)
        for spec in ("cachettl", "vllm"):
            expected = summarise(simulate(trace, spec), {})
            assert data["runs"][spec][k][0] == pytest.approx(expected.mean_jct_s)
            assert data["runs"][spec][k][2] == pytest.approx(expected.first_turn_wait_p90_s)
    rows = {(r["rival"], r["metric"]) for r in data["comparisons"]}
    metrics = ("mean JCT", "P99 JCT", "first-turn wait P90")
    assert rows == {(r, m) for r in ("vllm", "continuum-preview") for m in metrics}
    for row in data["comparisons"]:
        assert row["wins"] + row["ties"] + row["losses"] == 3
    text = (tmp_path / "seeds_0.2.md").read_text()
    for line in ("| vllm | mean JCT |", "| 2 | ", "| mean | "):
        assert line in text
    assert "--rate 0.2 --policy cachettl --against vllm,continuum-preview" in data["command"]
    assert "vllm mean JCT:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "cachettl,vllm"], "--policy names one policy"),
        (["--against", "cachettl,vllm"], "--against names the compared policy 'cachettl'"),
        (["--load", "-1"], "--load must be positive, got -1.0"),
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--seeds", "5"], "at least two distinct seeds"),
        (["--against", "vllm,nope"], "unknown policy 'nope'"),
    ],
)
def test_bench_seeds_refuses_bad_input_before_any_run(extra, message, capsys) -> None:
    assert main(["bench", "seeds", *extra]) == 2
    assert message in capsys.readouterr().err


def test_load_and_rate_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "seeds", "--load", "1", "--rate", "0.1"])
    assert "not allowed with argument" in capsys.readouterr().err
