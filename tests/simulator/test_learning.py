"""``bench learning``: the adaptation curve and the families' table, on small runs."""

from pathlib import Path

import pytest

from controlplane.cli import main
from simulator.studies.adaptation import TOLERANCE, Curve, adaptation


def test_samples_to_adapt_is_where_the_error_stays_within() -> None:
    assert Curve([0.5, 0.05, 0.3, 0.05, 0.02], [0.0] * 5).samples_to_adapt == 4
    assert Curve([0.05, 0.05], [1.0, 1.0]).samples_to_adapt == 1
    assert Curve([0.05, 0.5], [1.0, 0.0]).samples_to_adapt is None


def test_forgetting_with_a_shifted_prior_adapts_where_keeping_all_does_not() -> None:
    curves = adaptation(6.0, 600, 25, 3, ["no forgetting", "CUSUM + drift prior"])
    key = "pytest {t} -x -q"
    stale = curves["no forgetting"][key]
    fast = curves["CUSUM + drift prior"][key]
    assert stale.samples_to_adapt is None
    assert min(stale.errors) > 0.5  # the old regime's TTL, far from the new optimum
    assert fast.errors[-1] <= 2 * TOLERANCE
    assert set(curves) == {
        "no forgetting",
        "no forgetting + blend",
        "CUSUM + drift prior",
        "CUSUM + drift prior + blend",
    }


def test_bench_learning_writes_both_parts(tmp_path: Path) -> None:
    out = tmp_path / "learning"
    args = ["bench", "learning", "--families", "step", "--programs", "12", "--seeds", "0-1"]
    args += ["--replicates", "1", "--horizon", "5", "--pre", "200", "--loads", "1"]
    assert main([*args, "--learners", "cachettl (ADWIN)", "--out", str(out)]) == 0
    text = (tmp_path / "learning.md").read_text()
    assert "### step" in text
    assert "| cachettl (ADWIN) |" in text
    assert (tmp_path / "learning.json").exists()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--families", "nope", "--families: unknown family 'nope'"),
        ("--learners", "magic", "--learners: unknown learner 'magic'"),
        ("--factor", "-2", "--factor must be a positive number"),
        ("--horizon", "0", "--horizon must be >= 1"),
    ],
)
def test_bad_arguments_name_the_flag(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "learning", flag, value]) == 2
    assert message in capsys.readouterr().err


def test_cachettl_takes_the_detector_and_the_drift_prior() -> None:
    from simulator.engine import EngineConfig
    from simulator.policies.base import get_scheduling_policy
    from simulator.sim import Simulation
    from simulator.workloads import generate

    programs = generate("step(factor=6,at=0.5)", 20, rate=0.2, seed=1)
    detectors = []
    for spec in ("cachettl(detector=cusum,drift_prior=30)", "cachettl"):
        policy = get_scheduling_policy(spec)
        result = Simulation(programs, policy, "llama3.1-8b-h100", EngineConfig()).run()
        assert len(result.programs) == 20
        assert policy.models is not None
        durations = policy.models.durations
        detectors.append((durations.detector, durations.drift_prior))
    assert detectors == [("cusum", 30.0), ("adwin", 0.0)]


def test_the_floor_knows_the_change_and_only_estimates_its_scale() -> None:
    from simulator.studies.adaptation import FLOOR

    curves = adaptation(6.0, 600, 20, 3, [FLOOR, "no forgetting"])
    assert set(curves) == {FLOOR, "no forgetting", "no forgetting + blend"}  # no blend row
    key = "pytest {t} -x -q"
    floor, stale = curves[FLOOR][key], curves["no forgetting"][key]
    # From its first new samples the floor is near the new optimum (within the scale's
    # sampling error, σ = 0.6 / sqrt(k)); keeping all is far at every k.
    assert sorted(floor.errors[4:])[len(floor.errors[4:]) // 2] <= 2 * TOLERANCE
    assert max(floor.errors) < 0.5 < min(stale.errors)
