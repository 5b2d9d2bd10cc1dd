"""Cost model: how long it takes to rebuild a request's KV cache (PrefillReload).

Prefill time is a quadratic in context tokens (attention is quadratic, everything else
linear), fitted with scikit-learn to a profile table of ``(tokens, seconds)`` points and
refined online: observed timings join the profile points and the curve is refitted every
``refit_every`` observations. A profile is a roofline of some other machine, so once
``min_observed`` timings are in, the curve is also scaled by the median ratio of the
observed timings to it: an engine several times slower (or faster) than its profile is
priced as measured after a handful of prefills, whatever token counts they had. Reload
time is KV bytes over the offload bandwidth.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
from sklearn.linear_model import LinearRegression

from estimator._checks import check_count, check_duration, check_positive
from estimator.base import Estimator
from estimator.profiles import HardwareProfile

__all__ = ["CostModel"]


class CostModel(Estimator):
    """Prefill and reload time of a context, learned from a profile and observed timings.

    Parameters
    ----------
    prefill_points
        ``(tokens, seconds)`` profile points (at least two distinct token counts).
    kv_bytes_per_token
        KV-cache bytes of one token.
    offload_bandwidth_bps
        Effective host↔device bandwidth for reloads, bytes/s; None when there is no CPU tier.
    observed_window
        How many observed timings are kept for refitting.
    refit_every
        Refit after this many new observations.
    min_observed
        Observed timings before the curve is scaled to them (the first refit comes then).

    >>> model = CostModel([(1000, 0.1), (2000, 0.25), (4000, 0.7)], kv_bytes_per_token=131072,
    ...                   offload_bandwidth_bps=50e9)
    >>> round(model.prefill_s(3000), 3)
    0.45
    >>> round(model.reload_s(3000), 5)
    0.00786
    >>> model.prefill_reload_s(3000, offload=True) == model.reload_s(3000)
    True
    """

    def __init__(
        self,
        prefill_points: Sequence[tuple[float, float]],
        kv_bytes_per_token: int,
        offload_bandwidth_bps: float | None = None,
        observed_window: int = 512,
        refit_every: int = 32,
        min_observed: int = 8,
    ) -> None:
        points = [(float(t), float(s)) for t, s in prefill_points]
        for i, (tokens, seconds) in enumerate(points):
            check_duration(f"prefill_points[{i}] tokens", tokens)
            check_duration(f"prefill_points[{i}] seconds", seconds)
        if len({t for t, _ in points}) < 2:
            raise ValueError("prefill_points must hold at least two distinct token counts")
        check_positive("kv_bytes_per_token", kv_bytes_per_token)
        if offload_bandwidth_bps is not None:
            check_positive("offload_bandwidth_bps", offload_bandwidth_bps)
        if check_count("refit_every", refit_every) < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every!r}")
        if check_count("min_observed", min_observed) < 1:
            raise ValueError(f"min_observed must be >= 1, got {min_observed!r}")
        self.prefill_points = points
        self.kv_bytes_per_token = kv_bytes_per_token
        self.offload_bandwidth_bps = offload_bandwidth_bps
        self.observed_window = observed_window
        self.refit_every = refit_every
        self.min_observed = min_observed
        self._observed: deque[tuple[float, float]] = deque(maxlen=observed_window)
        self._since_fit = 0
        self._coef = (0.0, 0.0, 0.0)  # c0 + c1·t + c2·t²
        self._fit()

    @classmethod
    def from_profile(cls, profile: HardwareProfile, **kwargs: int) -> CostModel:
        """A cost model seeded with a hardware profile's roofline table."""
        return cls(
            profile.prefill_table(),
            kv_bytes_per_token=profile.kv_bytes_per_token,
            offload_bandwidth_bps=profile.offload_bandwidth_bps,
            **kwargs,
        )

    def _fit(self) -> None:
        data = np.array(self.prefill_points + list(self._observed), dtype=np.float64)
        tokens, seconds = data[:, 0], data[:, 1]
        scale = max(float(tokens.max()), 1.0)  # condition the design matrix
        x = np.column_stack([tokens / scale, (tokens / scale) ** 2])
        # Relative error matters at every size: weight points by 1/seconds².
        weights = 1.0 / np.maximum(seconds, 1e-6) ** 2
        fit = LinearRegression(positive=True).fit(x, seconds, sample_weight=weights)
        c1, c2 = (float(c) for c in fit.coef_)
        coef = (max(float(fit.intercept_), 0.0), c1 / scale, c2 / scale**2)
        self._coef, self._since_fit = coef, 0
        if len(self._observed) >= self.min_observed:
            seen = np.array(self._observed, dtype=np.float64)
            predicted = np.array([self.prefill_s(t) for t in seen[:, 0]])
            ratio = float(np.median(seen[:, 1] / np.maximum(predicted, 1e-9)))
            self._coef = (coef[0] * ratio, coef[1] * ratio, coef[2] * ratio)

    def update(self, tokens: int, seconds: float) -> None:
        """Learn one observed prefill of ``tokens`` tokens that took ``seconds``."""
        tokens = check_count("tokens", tokens)
        seconds = check_duration("seconds", seconds)
        self._observed.append((float(tokens), seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every or len(self._observed) == self.min_observed:
            self._fit()

    def prefill_s(self, tokens: float) -> float:
        """Predicted prefill time of a ``tokens``-token context."""
        t = check_duration("tokens", tokens)
        c0, c1, c2 = self._coef
        return c0 + c1 * t + c2 * t * t

    def reload_s(self, tokens: float) -> float:
        """Time to reload ``tokens`` of KV from the CPU tier; inf without one."""
        t = check_duration("tokens", tokens)
        if self.offload_bandwidth_bps is None:
            return float("inf")
        return t * self.kv_bytes_per_token / self.offload_bandwidth_bps

    def prefill_reload_s(
        self, tokens: float, offload: bool = False, offloaded_tokens: float | None = None
    ) -> float:
        """PrefillReload(r): reload when a CPU tier holds the KV, else prefill.

        ``offloaded_tokens``: how much of the context the tier holds (default: all of it);
        the rest is recomputed on top of the reloaded prefix, so the miss costs
        reload(held) + prefill(tokens) − prefill(held). Without a reload bandwidth the
        tier cannot be priced and a miss is a full prefill.

        >>> model = CostModel([(1000, 0.1), (2000, 0.2), (4000, 0.45)], 131072,
        ...                   offload_bandwidth_bps=50e9)
        >>> part = model.prefill_reload_s(4000, offload=True, offloaded_tokens=3000)
        >>> model.reload_s(4000) < part < model.prefill_s(4000)
        True
        >>> model.prefill_reload_s(4000, offload=True, offloaded_tokens=0) == model.prefill_s(4000)
        True
        """
        if not offload or self.offload_bandwidth_bps is None:
            return self.prefill_s(tokens)
        held = tokens if offloaded_tokens is None else min(max(offloaded_tokens, 0.0), tokens)
        if held <= 0:
            return self.prefill_s(tokens)
        if held >= tokens:
            return self.reload_s(tokens)
        recompute = max(0.0, self.prefill_s(tokens) - self.prefill_s(held))
        return self.reload_s(held) + recompute

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(c0, c1, c2)`` of ``c0 + c1·t + c2·t²`` seconds."""
        return self._coef
