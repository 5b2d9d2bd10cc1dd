"""``cachettl bench frontier``: points, the swept curve, covered peers, the files."""

from __future__ import annotations

import json

from controlplane.cli import main
from simulator.studies.frontier import FAIR_END, MIN_VERDICT_SEEDS, covered, covered_within_noise


def test_a_point_is_covered_only_by_a_curve_point_at_or_below_it_on_both_axes() -> None:
    curve = [(0.5, 120.0), (3.0, 80.0)]
    assert covered((3.0, 80.0), curve)  # equal counts
    assert covered((1.0, 150.0), curve)
    assert not covered((1.0, 100.0), curve)  # lower wait only at a higher JCT
    assert not covered((0.1, 500.0), curve)


def test_within_noise_a_point_is_covered_unless_a_verdict_says_worse_on_either_axis() -> None:
    peer = [(100.0 + k, 0.0, 2.0 + k % 3) for k in range(16)]
    slower = [(m + 1.0, 0.0, w) for m, _, w in peer]  # 16 of 16 seeds lose on mean JCT
    assert not covered_within_noise(peer, slower)
    mixed = [(m + (1.0 if k % 2 else -1.0), 0.0, w) for k, (m, _, w) in enumerate(peer)]
    assert covered_within_noise(peer, mixed)  # 8 wins, 8 losses: no difference
    later = [(m - 5.0, 0.0, w + 0.5) for m, _, w in peer]  # faster, but every wait longer
    assert not covered_within_noise(peer, later)


def test_bench_frontier_calls_verdicts_only_over_enough_seeds(tmp_path) -> None:
    out = tmp_path / "front"
    args = ["bench", "frontier", "--workloads", "swe", "--programs", "12", "--loads", "1"]
    args += ["--policy", "vllm", "--values", "inf", "--fair-end", ""]
    assert main([*args, "--seeds", "0", "--out", str(out)]) == 0
    assert f"fewer than {MIN_VERDICT_SEEDS} seeds: no verdict" in out.with_suffix(".md").read_text()
    seeds = ",".join(str(k) for k in range(MIN_VERDICT_SEEDS))
    assert main([*args, "--seeds", seeds, "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["panels"]["swe 1×"]["per_seed"]["vllm"]) == MIN_VERDICT_SEEDS
    row = next(r for r in out.with_suffix(".md").read_text().splitlines() if r.startswith("| vllm"))
    assert row.rstrip(" |").split("|")[-1].strip().startswith(("yes: `cachettl", "**no**"))


def test_bench_frontier_command(tmp_path, capsys) -> None:
    out = tmp_path / "front"
    code = main(
        [
            "bench", "frontier", "--workloads", "swe", "--programs", "12", "--seeds", "0",
            "--loads", "1", "--policy", "vllm,thunderagent", "--values", "0,inf",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.with_suffix(".json").read_text())
    results = data["panels"]["swe 1×"]["results"]
    curve = ["cachettl(first_turn_head_start_s=0)", "cachettl(first_turn_head_start_s=inf)"]
    assert set(results) == {"vllm", "thunderagent", *curve, f"cachettl({FAIR_END})"}
    text = out.with_suffix(".md").read_text()
    assert "| thunderagent |" in text
    assert out.with_suffix(".png").stat().st_size > 1000
    assert main(["bench", "frontier", "--knob", "nope"]) == 2
    assert "--knob must be a rule" in capsys.readouterr().err
    assert main(["bench", "frontier", "--values", "x"]) == 2
    assert main(["bench", "frontier", "--fair-end", "first_turn_over_pins"]) == 2
    assert "expected key=value, got 'first_turn_over_pins'" in capsys.readouterr().err
    assert main(["bench", "frontier", "--fair-end", "nope=1"]) == 2
    assert "has no parameter 'nope'" in capsys.readouterr().err


def test_bench_frontier_without_a_fair_end(tmp_path) -> None:
    out = tmp_path / "front"
    args = ["bench", "frontier", "--workloads", "swe", "--programs", "12", "--seeds", "0"]
    args += ["--loads", "1", "--policy", "vllm", "--values", "inf", "--fair-end", ""]
    assert main([*args, "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())["panels"]["swe 1×"]["results"]
    assert set(results) == {"vllm", "cachettl(first_turn_head_start_s=inf)"}
    assert "--fair-end ''" in json.loads(out.with_suffix(".json").read_text())["command"]
