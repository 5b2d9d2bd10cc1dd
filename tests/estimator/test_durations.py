"""Duration models: exact window, drift forgetting, and bad input."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from estimator import DurationModel


def test_window_keeps_the_most_recent_samples_sorted() -> None:
    rng = np.random.default_rng(0)
    data = rng.lognormal(0, 2, size=5000).round(2)  # many duplicates
    model = DurationModel(window=300, forget_on_drift=False)
    for x in data:
        model.update(float(x))
    assert model.n_samples == 300
    assert model.n_seen == 5000
    np.testing.assert_array_equal(model.sorted_samples(), np.sort(data[-300:]))
    np.testing.assert_array_equal(model.recent_samples(), data[-300:])


def test_cdf_and_quantiles_match_numpy() -> None:
    rng = np.random.default_rng(1)
    data = rng.exponential(2.0, size=1000)
    model = DurationModel(window=1000, forget_on_drift=False)
    for x in data:
        model.update(float(x))
    for q in (0.1, 0.5, 0.9, 0.99):
        assert model.quantile(q) == np.quantile(data, q, method="inverted_cdf")
        assert model.cdf(model.quantile(q)) >= q
    assert model.cdf(-1.0) == 0.0
    assert model.cdf(1e9) == 1.0


def test_forgets_the_old_regime_after_a_fivefold_shift() -> None:
    rng = np.random.default_rng(2)
    model = DurationModel(window=2000)
    for x in rng.lognormal(np.log(1.0), 0.3, size=1500):
        model.update(float(x))
    assert model.drift_epoch == 0
    median_before = model.quantile(0.5)
    after = 0
    while model.quantile(0.5) < 3.0 and after < 2000:
        model.update(float(rng.lognormal(np.log(5.0), 0.3)))
        after += 1
    assert model.drift_epoch >= 1
    # A window that only appended would need ~1,000 new samples for its median to move.
    assert after <= 300, after
    assert median_before == pytest.approx(1.0, rel=0.1)
    # ADWIN cuts at bucket granularity, so a few old samples may survive the cut; the old
    # regime is a vanishing share soon after, where a plain window would still be ~70 % old.
    for x in rng.lognormal(np.log(5.0), 0.3, size=200):
        model.update(float(x))
    assert model.cdf(2.0) < 0.05


def test_without_forgetting_the_window_averages_across_regimes() -> None:
    rng = np.random.default_rng(2)
    model = DurationModel(window=2000, forget_on_drift=False)
    for x in rng.lognormal(0.0, 0.3, size=1500):
        model.update(float(x))
    for x in rng.lognormal(np.log(5.0), 0.3, size=300):
        model.update(float(x))
    assert model.drift_epoch >= 1  # still detected and reported
    assert model.quantile(0.5) < 2.0


def test_summary_tracks_the_window_distribution() -> None:
    rng = np.random.default_rng(3)
    model = DurationModel(window=5000, forget_on_drift=False)
    for x in rng.lognormal(0.0, 1.0, size=5000):
        model.update(float(x))
    for x in (0.2, 1.0, 4.0):
        assert model.summary_cdf(x) == pytest.approx(model.cdf(x), abs=0.03)
    bins = model.summary_bins_s()
    assert sum(count for _, _, count in bins) == 5000
    assert all(left <= right for left, right, _ in bins)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "duration_s must be finite"),
        (float("inf"), "duration_s must be finite"),
        (-0.1, "duration_s must be >= 0, got -0.1"),
        ("abc", "duration_s must be a number"),
    ],
)
def test_bad_durations_change_nothing(value: object, message: str) -> None:
    model = DurationModel(window=10)
    model.update(1.0)
    with pytest.raises(ValueError, match=message):
        model.update(value)  # type: ignore[arg-type]
    assert (model.n_samples, model.n_seen) == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "window must be a positive integer"),
        ({"drift_delta": 0.0}, "drift_delta must be > 0"),
        ({"summary_bins": 1}, "summary_bins must be >= 2"),
    ],
)
def test_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DurationModel(**kwargs)  # type: ignore[arg-type]


def test_quantile_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\], got 1.5"):
        DurationModel().quantile(1.5)


def _step(model: DurationModel, n_old: int, n_new: int, factor: float) -> None:
    rng = random.Random(7)
    for _ in range(n_old):
        model.update(math.exp(rng.gauss(0.0, 0.5)))
    for _ in range(n_new):
        model.update(factor * math.exp(rng.gauss(0.0, 0.5)))


def test_cusum_forgets_the_old_regime_within_a_few_samples() -> None:
    model = DurationModel(detector="cusum")
    _step(model, 300, 8, 6.0)
    assert model.drift_epoch == 1
    assert model.n_samples <= 8
    assert model.quantile(0.0) > 1.0  # only post-change samples (median 6 s) remain


def test_drift_prior_is_the_old_shape_shifted_to_the_new_samples() -> None:
    plain = DurationModel(detector="cusum")
    prior = DurationModel(detector="cusum", drift_prior=30.0)
    _step(plain, 300, 10, 6.0)
    _step(prior, 300, 10, 6.0)
    assert plain.trusted_samples == plain.n_samples
    assert prior.trusted_samples == prior.n_samples + 30.0
    # The shifted prior puts the median near 6 s, as the new regime's is.
    median = next(x / 100 for x in range(100, 2000) if prior.cdf(x / 100) >= 0.5)
    assert 4.5 < median < 8.0


def test_defaults_run_no_other_detector_and_no_prior() -> None:
    model = DurationModel()
    _step(model, 100, 50, 6.0)
    assert model.trusted_samples == model.n_samples
    with pytest.raises(ValueError, match="detector must be one of"):
        DurationModel(detector="magic")
    with pytest.raises(ValueError, match="drift_prior"):
        DurationModel(drift_prior=-1.0)


def test_one_outlier_of_a_heavy_tail_does_not_signal_a_change() -> None:
    model = DurationModel(detector="cusum")
    rng = random.Random(3)
    for _ in range(300):
        model.update(math.exp(rng.gauss(0.0, 0.5)))
    model.update(1e4)  # 18 MADs above the median: one sample, clipped to 3
    assert model.drift_epoch == 0
    for _ in range(4):  # a shift sustained over 4 samples does
        model.update(1e4)
    assert model.drift_epoch == 1


def test_a_change_detected_soon_after_another_keeps_the_better_prior() -> None:
    model = DurationModel(detector="cusum", drift_prior=100.0)
    _step(model, 300, 20, 6.0)
    assert model.drift_epoch == 1
    assert model.n_samples <= 20
    rng = random.Random(5)
    for _ in range(10):  # a second change while the window holds only a few samples
        model.update(60.0 * math.exp(rng.gauss(0.0, 0.5)))
    assert model.drift_epoch == 2
    # The prior is still the 300-sample shape, shifted to the newest samples (~60 s).
    assert model._old_logs is not None
    assert model._old_logs.shape[0] >= 300  # not the ~20 samples the window held
    median = next(x / 10 for x in range(10, 2000) if model.cdf(x / 10) >= 0.5)
    assert 40.0 < median < 90.0
    assert model.trusted_samples == model.n_samples + 100.0


def test_a_fast_detector_runs_on_invocations_and_adwin_on_the_pooled_levels() -> None:
    from estimator.hierarchy import DurationHierarchy, Level

    h = DurationHierarchy(min_samples=2, detector="cusum", drift_prior=100.0)
    for d in (1.0, 2.0, 3.0):
        h.update("bash", "pytest -x", d)
    invocation = h.model(Level.INVOCATION, "bash", "pytest -x")
    tool = h.model(Level.TOOL, "bash", "pytest -x")
    tenant = h.model(Level.TENANT, "bash", "pytest -x")
    assert invocation is not None
    assert tool is not None
    assert tenant is not None
    assert (invocation.detector, invocation.drift_prior) == ("cusum", 100.0)
    # The pooled levels mix signatures whose shares follow the workload's phase.
    assert (tool.detector, tool.drift_prior) == ("adwin", 0.0)
    assert (tenant.detector, tenant.drift_prior) == ("adwin", 0.0)
