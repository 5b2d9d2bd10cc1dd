"""The exact TTL optimiser: τ* = argmax over {0} ∪ samples of F(τ)·B − τ.

F is the empirical CDF of past tool durations (F(τ) = share of samples ≤ τ) and B the
benefit of a pin that is hit, in seconds (Continuum, arXiv 2511.02230). Between two
sample points F is flat while −τ falls, so the maximum lies at 0 or at a sample:
searching those candidates is exact. On a sorted array the search is one vectorised pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from estimator._checks import check_finite, check_non_negative

__all__ = ["best_ttl_mixture", "best_ttl_sorted", "mixture_cdf", "optimal_ttl"]

FloatArray = npt.NDArray[np.float64]


def optimal_ttl(
    samples: Iterable[float] | FloatArray, benefit_s: float, cap_s: float | None = None
) -> float:
    """Return the TTL in {0} ∪ samples that maximises ``F(τ)·benefit_s − τ``.

    Ties go to the smaller τ; no τ above ``cap_s`` is chosen; empty samples give 0.0.
    O(n log n) for the sort, then one linear pass.

    >>> optimal_ttl([0.1, 0.2, 0.3, 5.0, 60.0], benefit_s=2.0)
    0.3
    >>> optimal_ttl([0.1, 0.2, 0.3, 5.0, 60.0], benefit_s=2.0, cap_s=0.25)
    0.2
    >>> optimal_ttl([], benefit_s=2.0)
    0.0
    """
    check_finite("benefit_s", benefit_s)
    if cap_s is not None:
        check_non_negative("cap_s", cap_s)
    values = np.asarray(samples, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"samples must be one-dimensional, got shape {values.shape}")
    if values.size and not (np.isfinite(values).all() and (values >= 0).all()):
        index = int(np.flatnonzero(~(np.isfinite(values) & (values >= 0)))[0])
        raise ValueError(f"samples[{index}] must be finite and >= 0, got {float(values[index])}")
    ttl, _ = best_ttl_sorted(np.sort(values), benefit_s, cap_s)
    return ttl


def best_ttl_sorted(
    sorted_samples: FloatArray,
    benefit_s: float,
    cap_s: float | None = None,
    ranks: FloatArray | None = None,
) -> tuple[float, float]:
    """Search a sorted sample array; return ``(τ*, F(τ*))``. No input checks (hot path).

    ``ranks`` may pass a cached ``arange(1, n + 1) / n`` for the array's length.

    >>> best_ttl_sorted(np.array([1.0, 1.0, 2.0, 9.0]), benefit_s=6.0)
    (2.0, 0.75)
    """
    n = sorted_samples.shape[0]
    if n == 0:
        return 0.0, 0.0
    if ranks is None:
        ranks = np.arange(1, n + 1, dtype=np.float64) / n
    limit = n
    if cap_s is not None and cap_s < sorted_samples[-1]:
        limit = int(np.searchsorted(sorted_samples, cap_s, side="right"))
    # F at a value is the rank of its *last* occurrence; earlier copies score lower, so
    # the maximum over positions equals the maximum over distinct values, and argmax's
    # first-hit rule gives the smaller τ on ties between distinct values.
    zeros = int(np.searchsorted(sorted_samples, 0.0, side="right"))
    f_zero = zeros / n
    best_value = f_zero * benefit_s
    if limit == 0:
        return 0.0, f_zero
    scores = ranks[:limit] * benefit_s - sorted_samples[:limit]
    i = int(np.argmax(scores))
    if scores[i] > best_value and sorted_samples[i] > 0.0:
        return float(sorted_samples[i]), float(ranks[i])
    return 0.0, f_zero


def best_ttl_mixture(
    parts: Sequence[tuple[float, FloatArray]],
    benefit_s: float,
    cap_s: float | None = None,
    exp_weight: float = 0.0,
    exp_mean_s: float = 1.0,
) -> tuple[float, float]:
    """``(τ*, F(τ*))`` for a mixture CDF F = Σ wᵢ·Fᵢ + w_e·(1 − e^(−τ/μ)): each Fᵢ the
    empirical CDF of a sorted, non-empty sample array, plus an optional exponential part.
    No input checks (hot path); the weights should sum to 1.

    Exact: between two sample points every Fᵢ is flat, so F·B − τ is concave there (the
    exponential part) or falling (none), and its maximum lies at a sample, at the one
    stationary point τₑ = μ·ln(w_e·B/μ) of the exponential part, at the cap, or at 0.

    >>> a, b = np.array([0.1, 0.2]), np.array([5.0, 6.0, 7.0])
    >>> best_ttl_mixture([(1.0, a)], benefit_s=3.0) == best_ttl_sorted(a, 3.0)
    True
    >>> best_ttl_mixture([(0.5, a), (0.5, b)], benefit_s=3.0)
    (0.2, 0.5)
    >>> best_ttl_mixture([(0.5, a), (0.5, b)], benefit_s=30.0)
    (7.0, 1.0)
    >>> tau, f = best_ttl_mixture([(0.5, b)], benefit_s=8.0, exp_weight=0.5)
    >>> round(tau, 4), round(f, 4)   # ln(0.5 · 8): the exponential part alone pays
    (1.3863, 0.375)
    """
    if not parts and exp_weight <= 0.0:
        return 0.0, 0.0
    # The largest array is scored at its own points through its ranks (no sort, no merge:
    # it may hold thousands of samples); every other candidate is few and searched for.
    big = max(range(len(parts)), key=lambda i: parts[i][1].shape[0]) if parts else -1
    others = [part for i, part in enumerate(parts) if i != big]
    extra = [0.0]
    if exp_weight > 0.0 and exp_weight * benefit_s > exp_mean_s:
        extra.append(exp_mean_s * math.log(exp_weight * benefit_s / exp_mean_s))
        if cap_s is not None:
            extra.append(cap_s)
    few = np.sort(np.concatenate([np.asarray(extra), *(array for _, array in others)]))
    few = few[(few > 0.0) | (np.arange(few.shape[0]) == 0)]  # one 0, then positive points
    if cap_s is not None:
        few = few[: int(np.searchsorted(few, cap_s, side="right"))]

    f_few = _mixture_cdf(few, parts, exp_weight, exp_mean_s)
    scores = f_few * benefit_s - few
    i = int(np.argmax(scores))  # the first maximum: ties go to the smaller τ
    best = (float(scores[i]), float(few[i]), float(f_few[i]))
    if big >= 0:
        own = _best_at_own_points(parts[big], others, benefit_s, cap_s, exp_weight, exp_mean_s)
        if own is not None and (own[0] > best[0] or (own[0] == best[0] and own[1] < best[1])):
            best = own
    return best[1], best[2]


def mixture_cdf(
    point_s: float,
    parts: Sequence[tuple[float, FloatArray]],
    exp_weight: float = 0.0,
    exp_mean_s: float = 1.0,
) -> float:
    """The mixture CDF of :func:`best_ttl_mixture` at one point.

    >>> mixture_cdf(0.15, [(0.5, np.array([0.1, 0.2])), (0.5, np.array([5.0]))])
    0.25
    """
    return float(_mixture_cdf(np.array([point_s]), parts, exp_weight, exp_mean_s)[0])


def _mixture_cdf(
    points: FloatArray,
    parts: Sequence[tuple[float, FloatArray]],
    exp_weight: float,
    exp_mean_s: float,
) -> FloatArray:
    """F = Σ wᵢ·Fᵢ + w_e·(1 − e^(−τ/μ)) at ``points``."""
    total = np.zeros(points.shape[0], dtype=np.float64)
    for weight, array in parts:
        total += weight * np.searchsorted(array, points, side="right") / array.shape[0]
    if exp_weight > 0.0:
        total -= exp_weight * np.expm1(-points / exp_mean_s)
    return total


def _best_at_own_points(
    part: tuple[float, FloatArray],
    others: Sequence[tuple[float, FloatArray]],
    benefit_s: float,
    cap_s: float | None,
    exp_weight: float,
    exp_mean_s: float,
) -> tuple[float, float, float] | None:
    """``(score, τ, F(τ))`` at the best of one part's own sample points (its ranks give its
    own CDF there, no sort or merge), or ``None`` when the cap leaves none."""
    weight, array = part
    n = array.shape[0]
    limit = n if cap_s is None else int(np.searchsorted(array, cap_s, side="right"))
    if not limit:
        return None
    points = array[:limit]
    # F at a value is the rank of its last copy; earlier copies score lower.
    f_own = (
        _mixture_cdf(points, others, exp_weight, exp_mean_s) + weight * np.arange(1, limit + 1) / n
    )
    scores = f_own * benefit_s - points
    j = int(np.argmax(scores))
    return float(scores[j]), float(points[j]), float(f_own[j])


def exponential_ttl(benefit_s: float, mean_s: float = 1.0) -> float:
    """Cold-start TTL for durations ~ Exp(mean): ``mean·ln(B/mean)`` if B > mean, else 0.

    Maximises ``(1 − e^{−τ/μ})·B − τ``: the derivative ``(B/μ)e^{−τ/μ} − 1`` vanishes at
    τ = μ·ln(B/μ) (the cold-start rule of Continuum, arXiv 2511.02230).

    >>> round(exponential_ttl(math.e), 6)
    1.0
    >>> exponential_ttl(0.5)
    0.0
    """
    if benefit_s <= mean_s:
        return 0.0
    return mean_s * math.log(benefit_s / mean_s)
