"""Compact duration models: a window summarised by K of its samples, with a bounded error.

A window of n sorted samples s₁ ≤ … ≤ sₙ is summarised by the K samples of rank
rᵢ = ⌈i·n/K⌉ (i = 1..K), each standing for the rᵢ − rᵢ₋₁ samples up to it; a window of
at most K samples is sent whole. The summary's CDF is H(x) = r_j / n with
j = #{points ≤ x}, and since a point is ≤ x exactly when i ≤ K·F(x) (F the window's
empirical CDF), j = ⌊K·F(x)⌋ and

    F(x) − 1/K < H(x) ≤ F(x)   for every x.

**The decision bound.** Let G be any CDF with sup |G − F| ≤ ε, τ* the exact optimiser
of F(τ)·B − τ over {0} ∪ samples (``estimator.ttl``) and τ_c the optimiser of G(τ)·B − τ
over {0} ∪ G's points (both under the same cap). Then

    F(τ_c)·B − τ_c ≥ G(τ_c)·B − τ_c − ε·B ≥ G(τ*)·B − τ* − ε·B ≥ F(τ*)·B − τ* − 2ε·B,

the middle step because τ* is a candidate for G too (G is flat on the gap between
its points, so its best lies at one of them: a τ* between two points scores no more
than the point below it). For H alone the error is one-sided (H ≤ F), which sharpens
the bound to ε·B with ε = 1/K: the objective at the compact decision is within B/K of
the optimum. A control plane that resends a model only when sup |H_sent − F_now| passes
δ (δ ≥ 1/K; measured before the wire's rounding below) keeps every engine within
2δ·B (``tests/estimator/test_sketch.py`` checks both bounds against the raw-duration
decision on random distributions).

**On the wire** the points travel as steps on the grid x₀·(1 + r)^k (x₀ = 1 µs,
r = 2⁻¹⁰), each rounded *up* (:func:`encode_points`): the first point's k, then each
point's increase of k, a byte or two each instead of eight. Rounding up keeps the summary
below F, and the optimum τ* rounded up is a candidate costing at most r·τ* ≤ r·B more
(τ* ≤ B, or it would not pay), so the bounds become (1/K + r)·B and (2δ + r)·B, plus
1 µs (under a
TTL cap c, an optimum within a factor 1 + r below c can be rounded past it and lost).

:class:`SketchModel` is a :class:`~estimator.durations.DurationModel` built from such a
summary: it reports the window's true sample count (so the hierarchy backs off exactly
as on the raw window), answers ``best_ttl``/``cdf``/``quantile`` from the K points and
their ranks, and turns into an ordinary window (the points repeated by their weights,
the CDF H) the first time it learns a sample.

>>> points = sketch_points(np.arange(1.0, 1001.0), 4)
>>> points.tolist()
[250.0, 500.0, 750.0, 1000.0]
>>> model = SketchModel.of(points, count=1000)
>>> model.n_samples, model.cdf(600.0), model.quantile(0.5)
(1000, 0.5, 500.0)
>>> model.best_ttl(benefit_s=2000.0)
(1000.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from estimator.durations import DurationModel
from estimator.ttl import FloatArray

__all__ = [
    "DEFAULT_POINTS",
    "GRID_BASE_S",
    "GRID_RATIO",
    "SketchModel",
    "cdf_distance",
    "decode_points",
    "encode_points",
    "sketch_points",
    "sketch_ranks",
]

#: Points a compact model is sent with (CDF error below 1/128).
DEFAULT_POINTS = 128
#: The wire grid of points: x₀ = GRID_BASE_S, x₀·(1 + GRID_RATIO)^k.
GRID_BASE_S = 1e-6
GRID_RATIO = 2.0**-10
_LOG_STEP = math.log1p(GRID_RATIO)

IntArray = npt.NDArray[np.int64]


def sketch_ranks(count: int, points: int) -> IntArray:
    """The ranks rᵢ = ⌈i·n/K⌉ (1-based) of a window of ``count`` samples summarised by
    ``points`` points; ``1..count`` when the window is no longer than that.

    >>> sketch_ranks(10, 4).tolist(), sketch_ranks(3, 4).tolist()
    ([3, 5, 8, 10], [1, 2, 3])
    """
    if count <= points:
        return np.arange(1, count + 1, dtype=np.int64)
    i = np.arange(1, points + 1, dtype=np.int64)
    return -((-i * count) // points)  # integer ceiling, exact for any n


def sketch_points(sorted_samples: FloatArray, points: int = DEFAULT_POINTS) -> FloatArray:
    """The summary of a sorted window: its samples of rank ⌈i·n/K⌉ (all of them when
    n ≤ K). ``points`` must be at least 1.

    >>> sketch_points(np.array([0.1, 0.2, 0.3]), 8).tolist()
    [0.1, 0.2, 0.3]
    """
    if points < 1:
        raise ValueError(f"points must be >= 1, got {points!r}")
    n = int(sorted_samples.shape[0])
    if n <= points:
        return np.array(sorted_samples, dtype=np.float64)
    picked: FloatArray = sorted_samples[sketch_ranks(n, points) - 1]
    return picked


def encode_points(points: FloatArray) -> list[int]:
    """Ascending durations as grid steps, each point rounded up to the grid: the first
    point's k, then each increase of k (see the module docstring).

    >>> encode_points(np.array([0.0, 1e-6, 1.0, 1.0, 2.0]))
    [0, 0, 14154, 0, 711]
    >>> decode_points([0, 0, 14154, 0, 711]).round(6).tolist()
    [1e-06, 1e-06, 1.00001, 1.00001, 2.001721]
    """
    ratio = np.maximum(points, GRID_BASE_S) / GRID_BASE_S
    k = np.ceil(np.log(ratio) / _LOG_STEP - 1e-9).astype(np.int64)
    k = np.maximum.accumulate(np.maximum(k, 0))  # ascending in, ascending out
    # Never below the point: the float grid value may fall a hair short of x.
    short = GRID_BASE_S * np.exp(k * _LOG_STEP) < points
    k = k + short
    return np.diff(k, prepend=0).tolist()  # type: ignore[no-any-return]


def decode_points(steps: Sequence[int]) -> FloatArray:
    """The points of :func:`encode_points`' steps (ascending)."""
    k = np.cumsum(np.asarray(steps, dtype=np.int64))
    values: FloatArray = GRID_BASE_S * np.exp(k * _LOG_STEP)
    return values


def _cdf(points: FloatArray, ranks: IntArray, count: int, at: FloatArray) -> FloatArray:
    """H at ``at`` for points with cumulative ``ranks`` over ``count`` samples."""
    j = np.searchsorted(points, at, side="right")
    cum = np.concatenate(([0], ranks))
    values: FloatArray = cum[j] / count
    return values


def cdf_distance(
    points: FloatArray, count: int, sorted_samples: FloatArray, sent_points: int | None = None
) -> float:
    """sup |H − F| between a summary (``points`` of a window of ``count`` samples, sent
    with ``sent_points`` points at most; default: as many as it has) and the window
    ``sorted_samples`` of now. Both are step functions, so the supremum is reached at one
    of their jump points. A summary of nothing against an empty window is 0.

    >>> window = np.arange(1.0, 101.0)
    >>> cdf_distance(sketch_points(window, 10), 100, window) < 1 / 10
    True
    >>> cdf_distance(sketch_points(window, 10), 100, window + 50.0)
    0.5
    """
    n = int(sorted_samples.shape[0])
    if count == 0 or n == 0:
        return 0.0 if count == n else 1.0
    ranks = sketch_ranks(count, sent_points or max(1, int(points.shape[0])))
    at = np.concatenate((points, sorted_samples))
    h = _cdf(points, ranks, count, at)
    f = np.searchsorted(sorted_samples, at, side="right") / n
    return float(np.max(np.abs(h - f)))


class SketchModel(DurationModel):
    """A duration model that holds a summary (see the module docstring) until it learns.

    Build one with :meth:`of`; the constructor takes :class:`DurationModel`'s parameters
    (so ``clone`` gives an empty, ordinary model with the same ones).
    """

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._points: FloatArray | None = None
        self._cum: IntArray = np.empty(0, dtype=np.int64)
        self._count = 0
        self._fractions: FloatArray = np.empty(0, dtype=np.float64)

    @classmethod
    def of(
        cls,
        points: Sequence[float] | FloatArray,
        count: int,
        seen: int | None = None,
        drift_epoch: int = 0,
        **params: Any,
    ) -> SketchModel:
        """The model of a summary: ``points`` (ascending) of a window of ``count``
        samples (``count`` ≥ the number of points; equal: the window itself), ``seen``
        samples learned in all (default ``count``)."""
        array = np.asarray(points, dtype=np.float64)
        if array.ndim != 1 or (array.size and not np.isfinite(array).all()):
            raise ValueError("points must be a one-dimensional array of finite durations")
        if array.size and (array[0] < 0 or (np.diff(array) < 0).any()):
            raise ValueError("points must be ascending durations >= 0")
        if count < array.size or (count and not array.size):
            raise ValueError(f"count must be >= the {array.size} points (and > 0 with points)")
        params.setdefault("window", max(count, 1))
        params.setdefault("forget_on_drift", False)
        model = cls(**params)
        model._points = array
        model._cum = sketch_ranks(count, int(array.size))
        model._count = count
        model._fractions = model._cum / max(count, 1)
        model._seen = count if seen is None else seen
        model._drift_epoch = drift_epoch
        return model

    @property
    def summarized(self) -> bool:
        """Whether the model still holds its summary (it has learned nothing since)."""
        return self._points is not None

    def _materialize(self) -> None:
        """Become an ordinary window holding the summary's CDF: each point repeated by
        its weight (rᵢ − rᵢ₋₁), in ascending order."""
        if self._points is None:
            return
        values = self._expanded()
        self._points = None
        seen, epoch = self._seen, self._drift_epoch
        self.window = max(self.window, int(values.shape[0]), 1)
        state = self.__getstate__()
        state.update(_ring=values, _n=int(values.shape[0]), _head=0)
        self.__setstate__(state)
        self._seen, self._drift_epoch = seen, epoch

    def _expanded(self) -> FloatArray:
        assert self._points is not None
        weights = np.diff(np.concatenate(([0], self._cum)))
        values: FloatArray = np.repeat(self._points, weights)
        return values

    def update(self, duration_s: float) -> None:
        self._materialize()
        super().update(duration_s)

    @property
    def n_samples(self) -> int:
        return self._count if self._points is not None else super().n_samples

    @property
    def trusted_samples(self) -> float:
        return float(self._count) if self._points is not None else super().trusted_samples

    def sorted_samples(self) -> FloatArray:
        if self._points is None:
            return super().sorted_samples()
        values = self._expanded()
        values.flags.writeable = False
        return values

    def recent_samples(self) -> FloatArray:
        return self._expanded() if self._points is not None else super().recent_samples()

    def cdf(self, duration_s: float) -> float:
        if self._points is None:
            return super().cdf(duration_s)
        if self._count == 0:
            return 0.0
        at = np.array([duration_s], dtype=np.float64)
        return float(_cdf(self._points, self._cum, self._count, at)[0])

    def quantile(self, q: float) -> float:
        if self._points is None:
            return super().quantile(q)
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        if self._count == 0:
            return 0.0
        rank = max(1, math.ceil(q * self._count))
        return float(self._points[int(np.searchsorted(self._cum, rank, side="left"))])

    def mean(self) -> float:
        if self._points is None:
            return super().mean()
        if self._count == 0:
            return 0.0
        weights = np.diff(np.concatenate(([0], self._cum)))
        return float(np.dot(self._points, weights) / self._count)

    def best_ttl(self, benefit_s: float, cap_s: float | None = None) -> tuple[float, float]:
        """``(τ_c, H(τ_c))``: the exact search of ``estimator.ttl`` on the summary's CDF
        (candidates 0 and the points; ties to the smaller τ; nothing above the cap)."""
        points = self._points
        if points is None:
            return super().best_ttl(benefit_s, cap_s)
        if not points.shape[0]:
            return 0.0, 0.0
        limit = points.shape[0]
        if cap_s is not None and cap_s < points[-1]:
            limit = int(np.searchsorted(points, cap_s, side="right"))
        zeros = int(np.searchsorted(points, 0.0, side="right"))
        f_zero = float(self._fractions[zeros - 1]) if zeros else 0.0
        if limit == 0:
            return 0.0, f_zero
        scores = self._fractions[:limit] * benefit_s - points[:limit]
        i = int(np.argmax(scores))  # a value's F is its last copy's; earlier copies lose
        if scores[i] > f_zero * benefit_s and points[i] > 0.0:
            return float(points[i]), float(self._fractions[i])
        return 0.0, f_zero

    def __repr__(self) -> str:
        if self._points is None:
            return super().__repr__()
        return f"SketchModel(points={self._points.shape[0]}, n_samples={self._count})"
