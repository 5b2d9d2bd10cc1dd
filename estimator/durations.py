"""Online model of one tool's call durations.

An exact empirical CDF over a bounded window of recent samples (kept sorted, so the TTL
search is one vectorised pass), a streaming summary (River ``sketch.Histogram`` of
log-durations) and drift detection (River ``drift.ADWIN`` on log-durations). When ADWIN
flags a change, the samples older than its shrunken window — the old regime — leave the
exact window and the summary is rebuilt from what remains.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from river import drift, sketch

from estimator._checks import check_count, check_duration, check_non_negative, check_positive
from estimator.base import Estimator
from estimator.ttl import FloatArray, best_ttl_mixture, best_ttl_sorted

__all__ = ["DETECTORS", "DurationModel"]

#: Change detectors a model may run on its log-durations.
DETECTORS = ("adwin", "adwin-fast", "kswin", "page-hinkley", "cusum")
#: New samples a drift prior needs before its shift is estimated and the model trusted.
MIN_SHIFT_SAMPLES = 5
#: Newest samples River's detectors keep on a detection (KSWIN's statistic window).
_RIVER_KEEP = {"kswin": 30, "page-hinkley": 10}

#: Durations below this are logged as this (log of 0 is undefined); 1 µs.
LOG_FLOOR_S = 1e-6
#: Samples a new model has room for; the buffers double as samples arrive, up to the
#: window (so a key seen once costs about 1 KiB, not ``16 × window`` bytes).
INITIAL_CAPACITY = 16


def _river_detector(name: str) -> Any:
    if name == "kswin":
        return drift.KSWIN(seed=0)
    if name == "page-hinkley":
        return drift.PageHinkley()
    return None


class _Cusum:
    """Two-sided CUSUM of log-durations standardised by the window's median and MAD
    (robust to the heavy tails and mixtures log-durations have): S⁺ and S⁻ grow by
    ``|z| − k`` per sample and signal at ``h``. The change point is where the signalling
    sum last stood at 0, so what came after it is the new regime.
    """

    K = 0.5
    H = 8.0
    #: Scores are clipped to ±CLIP (Huber's robust CUSUM), so one outlier of a heavy
    #: tail cannot signal alone: a signal needs at least ⌈H / (CLIP − K)⌉ = 4 samples.
    CLIP = 3.0
    #: Samples the window needs before the reference is trusted.
    MIN_REFERENCE = 10

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.up = self.down = 0.0
        self.run_up = self.run_down = 0

    def update(self, log_x: float, window: FloatArray) -> int | None:
        """Samples to keep if a change is signalled at this sample, else None."""
        if window.shape[0] < self.MIN_REFERENCE:
            return None
        logs = np.log(np.maximum(window, LOG_FLOOR_S))
        median = float(np.median(logs))
        mad = 1.4826 * float(np.median(np.abs(logs - median)))
        z = min(self.CLIP, max(-self.CLIP, (log_x - median) / max(mad, 0.05)))
        self.up = max(0.0, self.up + z - self.K)
        self.down = max(0.0, self.down - z - self.K)
        self.run_up = self.run_up + 1 if self.up > 0 else 0
        self.run_down = self.run_down + 1 if self.down > 0 else 0
        if self.up > self.H:
            return self.run_up
        if self.down > self.H:
            return self.run_down
        return None


class DurationModel(Estimator):
    """Durations of one key (a tool, or a tool invocation), learned one sample at a time.

    Parameters
    ----------
    window
        How many recent samples the exact CDF keeps.
    forget_on_drift
        Drop the pre-drift regime when ADWIN detects a change of the log-duration mean.
    drift_delta
        ADWIN's confidence parameter (smaller: fewer, surer detections).
    summary_bins
        Bins of the streaming log-duration histogram.
    detector
        What detects a change of regime on log-durations (one of :data:`DETECTORS`):
        ``adwin`` (the default; forgets what precedes ADWIN's shrunken window, checked
        every 32 samples), ``adwin-fast`` (the same, checked at every sample),
        ``kswin`` / ``page-hinkley`` (River's; keep the last 30 / 10 samples on a
        detection) or ``cusum`` (a two-sided CUSUM on log-durations standardised by the
        window's median and MAD; keeps the samples since the CUSUM last stood at 0).
    drift_prior
        α > 0: on a detected change the forgotten regime is kept as a prior, shifted by
        the change of the mean log-duration the new samples show; the CDF is the mixture
        (n·F_new + α·F_old shifted)/(n + α), and the model counts as holding n + α
        samples once it holds :data:`MIN_SHIFT_SAMPLES` new ones (0: off, the default).

    >>> model = DurationModel(window=4)
    >>> for d in [0.5, 0.1, 2.0, 0.3, 0.2]:
    ...     model.update(d)
    >>> model.n_samples, model.n_seen
    (4, 5)
    >>> model.cdf(0.3), model.quantile(0.5)
    (0.75, 0.2)
    >>> model.best_ttl(benefit_s=3.0)
    (0.3, 0.75)
    """

    def __init__(
        self,
        window: int = 2000,
        forget_on_drift: bool = True,
        drift_delta: float = 0.002,
        summary_bins: int = 64,
        detector: str = "adwin",
        drift_prior: float = 0.0,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        check_positive("drift_delta", drift_delta)
        if check_count("summary_bins", summary_bins) < 2:
            raise ValueError(f"summary_bins must be >= 2, got {summary_bins!r}")
        self.window = window
        self.forget_on_drift = forget_on_drift
        self.drift_delta = drift_delta
        self.summary_bins = summary_bins
        if detector not in DETECTORS:
            raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {detector!r}")
        self.detector = detector
        self.drift_prior = check_non_negative("drift_prior", drift_prior)
        self._old_logs: FloatArray | None = None  # the forgotten regime (sorted logs)
        self._shifted: tuple[int, FloatArray] = (-1, np.empty(0, dtype=np.float64))
        self._other: Any = _river_detector(detector)
        self._cusum = _Cusum() if detector == "cusum" else None
        capacity = min(window, INITIAL_CAPACITY)
        self._sorted = np.zeros(capacity, dtype=np.float64)
        # Arrival order, oldest at _head; _head is 0 until the window is full (it moves only
        # in _replace_oldest), so a buffer shorter than the window is filled from index 0.
        self._ring = np.zeros(capacity, dtype=np.float64)
        self._head = 0
        self._n = 0
        self._seen = 0
        self._drift_epoch = 0
        self._adwin = drift.ADWIN(delta=drift_delta, clock=1 if detector == "adwin-fast" else 32)
        self._summary = sketch.Histogram(max_bins=summary_bins)
        self._ranks: FloatArray = np.empty(0, dtype=np.float64)

    # -- learning ---------------------------------------------------------------------

    def update(self, duration_s: float) -> None:
        """Learn one duration in seconds (finite, >= 0)."""
        x = check_duration("duration_s", duration_s)
        log_x = math.log(max(x, LOG_FLOOR_S))
        if self._n == self.window:
            self._replace_oldest(x)
        else:
            self._insert(x)
        self._seen += 1
        self._summary.update(log_x)
        if self.detector not in ("adwin", "adwin-fast"):
            self._detect_other(log_x)
            return
        self._adwin.update(log_x)
        if self._adwin.drift_detected:
            self._drift_epoch += 1
            self._remember_regime()
        # ADWIN's window only shrinks when it cuts off an older regime (at its first
        # detection, and again as it trims buckets that straddled the change).
        if self.forget_on_drift and self._adwin.width < self._n:
            self._keep_newest(int(self._adwin.width))

    def _detect_other(self, log_x: float) -> None:
        if self._cusum is not None:
            keep = self._cusum.update(log_x, self._sorted[: self._n])
        else:
            self._other.update(log_x)
            keep = _RIVER_KEEP[self.detector] if self._other.drift_detected else None
        if keep is None:
            return
        self._drift_epoch += 1
        self._remember_regime()
        if self.forget_on_drift and keep < self._n:
            self._keep_newest(keep)
            if self._cusum is not None:
                self._cusum.reset()

    def _remember_regime(self) -> None:
        """With a drift prior, keep the window (the regime being left) as the prior,
        unless the prior in place rests on more samples: a change detected soon after
        another leaves the better-estimated shape, shifted anew."""
        if self.drift_prior <= 0 or not self.forget_on_drift or self._n < MIN_SHIFT_SAMPLES:
            return
        if self._old_logs is not None and self._old_logs.shape[0] >= self._n:
            return
        self._old_logs = np.log(np.maximum(self._sorted[: self._n], LOG_FLOOR_S))

    def _prior(self) -> FloatArray | None:
        """The old regime shifted to the new samples' mean log-duration (sorted), or None
        while there are too few new samples or no prior."""
        old = self._old_logs
        if old is None or self._n < MIN_SHIFT_SAMPLES:
            return None
        if self._shifted[0] != self._seen:
            new = np.log(np.maximum(self._sorted[: self._n], LOG_FLOOR_S))
            self._shifted = (self._seen, np.exp(old + (float(new.mean()) - float(old.mean()))))
        return self._shifted[1]

    @property
    def trusted_samples(self) -> float:
        """Samples the model's CDF rests on: n, plus α while a drift prior stands in."""
        return self._n + (self.drift_prior if self._prior() is not None else 0.0)

    def _grow(self) -> None:
        """Double the buffers (up to the window); only called while not full, _head = 0."""
        capacity = min(self.window, 2 * self._sorted.shape[0])
        for name in ("_sorted", "_ring"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=np.float64)
            new[: self._n] = old[: self._n]
            setattr(self, name, new)

    def _insert(self, x: float) -> None:
        if self._n == self._sorted.shape[0]:
            self._grow()
        n, buf = self._n, self._sorted
        i = int(buf[:n].searchsorted(x, "right"))
        buf[i + 1 : n + 1] = buf[i:n]
        buf[i] = x
        self._ring[(self._head + n) % self._ring.shape[0]] = x
        self._n = n + 1

    def _replace_oldest(self, x: float) -> None:
        # One memmove over the span between the leaving and the arriving value.
        buf = self._sorted
        j = int(buf.searchsorted(self._ring[self._head], "left"))
        p = int(buf.searchsorted(x, "right"))
        if p > j:
            buf[j : p - 1] = buf[j + 1 : p]
            buf[p - 1] = x
        else:
            buf[p + 1 : j + 1] = buf[p:j]
            buf[p] = x
        self._ring[self._head] = x
        self._head = (self._head + 1) % self.window

    def _keep_newest(self, keep: int) -> None:
        keep = max(0, min(keep, self._n))
        newest = self._arrival_order()[self._n - keep :]
        self._ring[:keep] = newest
        self._head = 0
        self._n = keep
        self._sorted[:keep] = np.sort(newest)
        self._summary = sketch.Histogram(max_bins=self.summary_bins)
        for value in newest:
            self._summary.update(math.log(max(float(value), LOG_FLOOR_S)))

    def _arrival_order(self) -> FloatArray:
        idx = (self._head + np.arange(self._n)) % self._ring.shape[0]
        ordered: FloatArray = self._ring[idx]
        return ordered

    # -- asking -----------------------------------------------------------------------

    @property
    def n_samples(self) -> int:
        """Samples in the exact window (what the CDF is computed over)."""
        return self._n

    @property
    def n_seen(self) -> int:
        """Samples learned since creation, including forgotten ones."""
        return self._seen

    @property
    def drift_epoch(self) -> int:
        """How many distribution changes ADWIN has detected."""
        return self._drift_epoch

    def sorted_samples(self) -> FloatArray:
        """The window's samples in ascending order (a read-only view)."""
        view = self._sorted[: self._n]
        view.flags.writeable = False
        return view

    def recent_samples(self) -> FloatArray:
        """The window's samples in arrival order, oldest first (a copy)."""
        return self._arrival_order()

    def cdf(self, duration_s: float) -> float:
        """Share of window samples ≤ ``duration_s`` (mixed with the shifted old regime
        while a drift prior stands); 0.0 before any update."""
        if self._n == 0:
            return 0.0
        count = int(np.searchsorted(self._sorted[: self._n], duration_s, side="right"))
        prior = self._prior()
        if prior is None:
            return count / self._n
        old = int(np.searchsorted(prior, duration_s, side="right")) / int(prior.shape[0])
        return (count + self.drift_prior * old) / (self._n + self.drift_prior)

    def quantile(self, q: float) -> float:
        """Empirical quantile (inverse CDF: smallest sample with F ≥ q); 0.0 when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        if self._n == 0:
            return 0.0
        index = max(0, math.ceil(q * self._n) - 1)
        return float(self._sorted[index])

    def mean(self) -> float:
        """Mean of the window; 0.0 when empty."""
        return float(self._sorted[: self._n].mean()) if self._n else 0.0

    def summary_cdf(self, duration_s: float) -> float:
        """CDF of the streaming summary (all samples since the last forgetting)."""
        if self._summary.n == 0:
            return 0.0
        return float(self._summary.cdf(math.log(max(duration_s, LOG_FLOOR_S))))

    def summary_bins_s(self) -> list[tuple[float, float, int]]:
        """The summary's bins as ``(left_s, right_s, count)`` in seconds."""
        return [(math.exp(b.left), math.exp(b.right), int(b.count)) for b in self._summary]

    def best_ttl(self, benefit_s: float, cap_s: float | None = None) -> tuple[float, float]:
        """``(τ*, F(τ*))`` over the window: the exact optimiser of ``estimator.ttl`` (over
        the mixture with the shifted old regime while a drift prior stands)."""
        n = self._n
        prior = self._prior()
        if prior is not None:
            a = self.drift_prior
            parts = [(n / (n + a), self._sorted[:n]), (a / (n + a), prior)]
            return best_ttl_mixture(parts, benefit_s, cap_s)
        if self._ranks.shape[0] != n:
            self._ranks = np.arange(1, n + 1, dtype=np.float64) / n
        return best_ttl_sorted(self._sorted[:n], benefit_s, cap_s, self._ranks)

    def __getstate__(self) -> dict[str, Any]:
        # Only the live samples, in arrival order: compact and free of buffer garbage.
        state = dict(self.__dict__)
        state["_ring"] = self._arrival_order()
        state["_head"] = 0
        del state["_sorted"], state["_ranks"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        live = self._ring
        capacity = min(self.window, max(self._n, INITIAL_CAPACITY))
        self._ring = np.zeros(capacity, dtype=np.float64)
        self._ring[: self._n] = live
        self._sorted = np.zeros(capacity, dtype=np.float64)
        self._sorted[: self._n] = np.sort(live)
        self._ranks = np.empty(0, dtype=np.float64)

    def __repr__(self) -> str:
        return f"{super().__repr__()} n_samples={self._n} drift_epoch={self._drift_epoch}"
