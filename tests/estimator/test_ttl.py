"""optimal_ttl: exact agreement with brute force, ties, cap, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator import DurationModel, exponential_ttl, optimal_ttl
from estimator.ttl import best_ttl_mixture, best_ttl_sorted


def brute_force(samples: list[float], benefit: float, cap: float | None) -> float:
    """Score every candidate in {0} ∪ samples directly from the definition."""
    n = len(samples)
    if n == 0:
        return 0.0
    best_tau, best_value = 0.0, sum(1 for s in samples if s <= 0.0) / n * benefit
    for tau in sorted(set(samples)):
        if cap is not None and tau > cap:
            break
        value = sum(1 for s in samples if s <= tau) / n * benefit - tau
        if value > best_value:
            best_tau, best_value = tau, value
    return best_tau


durations = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)
# Coarse grids force duplicates and exact ties between candidates.
coarse = st.integers(min_value=0, max_value=40).map(lambda i: i / 4)


@settings(max_examples=400, deadline=None)
@given(
    samples=st.lists(st.one_of(durations, coarse), max_size=60),
    benefit=st.one_of(st.floats(min_value=-10, max_value=1e4), st.integers(0, 20).map(float)),
    cap=st.one_of(st.none(), st.floats(min_value=0, max_value=1e4), coarse),
)
def test_matches_brute_force(samples: list[float], benefit: float, cap: float | None) -> None:
    assert optimal_ttl(samples, benefit, cap) == brute_force(samples, benefit, cap)


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(coarse, min_size=1, max_size=80), benefit=st.integers(0, 12))
def test_sorted_window_agrees_with_function(samples: list[float], benefit: int) -> None:
    model = DurationModel(window=len(samples), forget_on_drift=False)
    for x in samples:
        model.update(x)
    tau, probability = model.best_ttl(float(benefit))
    assert tau == optimal_ttl(samples, float(benefit))
    assert probability == pytest.approx(model.cdf(tau) if tau > 0 else model.cdf(0.0))


def test_ties_go_to_the_smaller_ttl() -> None:
    # τ = 1: 0.5·4 − 1 = 1; τ = 2: 0.75·4 − 2 = 1.
    assert optimal_ttl([1.0, 1.0, 2.0, 9.0], 4.0) == 1.0
    # Not pinning ties with τ = 1 (0.5·2 − 1 = 0): 0 wins.
    assert optimal_ttl([1.0, 5.0], 2.0) == 0.0


def test_cap_and_empty() -> None:
    assert optimal_ttl([], 100.0) == 0.0
    assert optimal_ttl([0.5, 1.0, 50.0], 1000.0) == 50.0
    assert optimal_ttl([0.5, 1.0, 50.0], 1000.0, cap_s=10.0) == 1.0
    assert optimal_ttl([0.5, 1.0, 50.0], 1000.0, cap_s=0.1) == 0.0


def test_large_input_is_fast_enough_to_be_n_log_n() -> None:
    rng = np.random.default_rng(1)
    samples = rng.exponential(1.0, size=200_000)
    tau = optimal_ttl(samples, 5.0)
    # Exp(1) with B = 5: the continuous optimum is ln 5.
    assert tau == pytest.approx(math.log(5.0), abs=0.05)


@pytest.mark.parametrize(
    ("samples", "benefit", "cap", "message"),
    [
        ([1.0, float("nan")], 1.0, None, r"samples\[1\] must be finite and >= 0, got nan"),
        ([1.0, -0.5], 1.0, None, r"samples\[1\] must be finite and >= 0, got -0.5"),
        ([float("inf")], 1.0, None, r"samples\[0\] must be finite"),
        ([1.0], float("nan"), None, "benefit_s must be finite"),
        ([1.0], 1.0, -1.0, "cap_s must be >= 0"),
    ],
)
def test_bad_input(samples: list[float], benefit: float, cap: float | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        optimal_ttl(samples, benefit, cap)


@pytest.mark.parametrize("benefit", [1.5, 2.0, 5.0, 30.0])
def test_exponential_rule_maximises_the_exponential_objective(benefit: float) -> None:
    tau = exponential_ttl(benefit)
    grid = np.linspace(0, 10, 100_001)
    values = (1 - np.exp(-grid)) * benefit - grid
    assert tau == pytest.approx(grid[int(np.argmax(values))], abs=1e-3)
    assert exponential_ttl(0.99) == 0.0


def mixture_brute_force(
    parts: list[tuple[float, list[float]]], exp_weight: float, benefit: float, cap: float | None
) -> float:
    """The best objective value over 0, every sample, and a dense grid (no cleverness)."""

    def value(tau: float) -> float:
        f = sum(w * sum(1 for s in xs if s <= tau) / len(xs) for w, xs in parts)
        return (f + exp_weight * (1.0 - math.exp(-tau))) * benefit - tau

    top = max([0.0, *(s for _, xs in parts for s in xs), 60.0])
    grid = [top * i / 4000 for i in range(4001)] + [s for _, xs in parts for s in xs]
    return max(value(t) for t in grid if cap is None or t <= cap)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.lists(st.one_of(coarse, durations.map(lambda d: d / 100)), min_size=1, max_size=15),
        min_size=1,
        max_size=3,
    ),
    exp_share=st.sampled_from([0.0, 0.0, 0.3, 0.7]),
    benefit=st.one_of(st.floats(min_value=0, max_value=200), st.integers(0, 20).map(float)),
    cap=st.one_of(st.none(), coarse),
)
def test_mixture_search_is_exact(
    parts: list[list[float]], exp_share: float, benefit: float, cap: float | None
) -> None:
    weight = (1.0 - exp_share) / len(parts)
    weighted = [(weight, sorted(xs)) for xs in parts]
    arrays = [(w, np.array(xs)) for w, xs in weighted]
    tau, f = best_ttl_mixture(arrays, benefit, cap, exp_weight=exp_share)
    assert cap is None or tau <= cap
    expected_f = sum(w * sum(1 for s in xs if s <= tau) / len(xs) for w, xs in weighted)
    expected_f += exp_share * (1.0 - math.exp(-tau))
    assert f == pytest.approx(expected_f, abs=1e-12)
    best = mixture_brute_force(weighted, exp_share, benefit, cap)
    assert f * benefit - tau >= best - 1e-9 * max(1.0, benefit)


def test_one_part_mixture_is_the_plain_search() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        xs = np.sort(rng.lognormal(0, 1.5, rng.integers(1, 200)))
        benefit = float(rng.uniform(0, 20))
        assert best_ttl_mixture([(1.0, xs)], benefit, 3.0) == best_ttl_sorted(xs, benefit, 3.0)
