"""Online model of one tool's call durations.

An exact empirical CDF over a bounded window of recent samples and drift detection (River
``drift.ADWIN`` on log-durations). When ADWIN flags a change, the samples older than its
shrunken window — the old regime — leave the exact window.

Learning a sample costs a write to the arrival-order ring and the detector's update; the
sorted copy the CDF and the TTL search read is brought up to date when it is next read
(up to :data:`RESORT_AFTER` pending samples are placed one by one, more by one sort), so a
model learned many times between two reads pays one sort, not one shift per sample. Both
give the same sorted window, hence the same decisions. A read may thus write: readers in
several threads take the lock learning takes (the control plane's model lock, the engine
link's own), as they must for reads beside learning anyway. A streaming histogram of the
window's log-durations (River ``sketch.Histogram``) is built only when asked for
(:meth:`DurationModel.summary_cdf`); no decision reads it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from river import drift

from estimator._checks import check_count, check_duration, check_non_negative, check_positive
from estimator.base import Estimator
from estimator.detectors import LOG_FLOOR_S, RIVER_KEEP, Cusum, river_detector
from estimator.ttl import FloatArray, best_ttl_mixture, best_ttl_sorted

__all__ = ["DETECTORS", "DurationModel"]

#: Change detectors a model may run on its log-durations.
DETECTORS = ("adwin", "adwin-fast", "kswin", "page-hinkley", "cusum")
#: New samples a drift prior needs before its shift is estimated and the model trusted.
MIN_SHIFT_SAMPLES = 5

#: Samples a new model has room for; the buffers double as samples arrive, up to the
#: window (so a key seen once costs about 1 KiB, not ``16 × window`` bytes).
INITIAL_CAPACITY = 16
#: Samples learned since the sorted window was last read past which it is re-sorted whole
#: rather than shifted once per sample (one shift ~1 µs, a sort of 2,000 ~7 µs).
RESORT_AFTER = 8
_LOG_FLOOR = math.log(LOG_FLOOR_S)


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
        Bins of the log-duration histogram :meth:`summary_cdf` builds from the window.
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
        self._other: Any = river_detector(detector)
        self._cusum = Cusum() if detector == "cusum" else None
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
        self._ranks: FloatArray = np.empty(0, dtype=np.float64)
        # The sorted window lags the ring by the samples learned since it was last read:
        # ``_pending`` lists them as (value that left or None, value that arrived), None
        # once there are more than RESORT_AFTER (then the window is sorted anew).
        self._pending: list[tuple[float | None, float]] | None = []
        self._sorted_n = 0  # samples the sorted buffer holds
        self._histogram: tuple[int, Any] = (-1, None)  # (n_seen it was built at, histogram)

    # -- learning ---------------------------------------------------------------------

    def update(self, duration_s: float) -> None:
        """Learn one duration in seconds (finite, >= 0)."""
        if type(duration_s) is float and 0.0 <= duration_s < math.inf:  # the usual case
            x = duration_s
        else:
            x = check_duration("duration_s", duration_s)
        log_x = math.log(x) if x > LOG_FLOOR_S else _LOG_FLOOR
        n = self._n
        if n == self.window:  # full: the oldest sample leaves
            head = self._head
            self._note(float(self._ring[head]), x)
            self._ring[head] = x
            self._head = (head + 1) % n
        else:  # _head is 0 until the window is full
            if n == self._ring.shape[0]:
                self._grow()
            self._ring[n] = x
            self._n = n + 1
            self._note(None, x)
        self._seen += 1
        if self.detector not in ("adwin", "adwin-fast"):
            self._detect_other(log_x)
            return
        adwin = self._adwin
        adwin.update(log_x)
        if adwin.drift_detected:
            self._drift_epoch += 1
            self._remember_regime()
        # ADWIN's window only shrinks when it cuts off an older regime (at its first
        # detection, and again as it trims buckets that straddled the change).
        if self.forget_on_drift and adwin.width < self._n:
            self._keep_newest(int(adwin.width))

    def _note(self, leaving: float | None, x: float) -> None:
        """Record a sample the sorted window does not hold yet."""
        pending = self._pending
        if pending is not None:
            if len(pending) < RESORT_AFTER:
                pending.append((leaving, x))
            else:
                self._pending = None

    def _detect_other(self, log_x: float) -> None:
        if self._cusum is not None:
            keep = self._cusum.update(log_x, self._window())
        else:
            self._other.update(log_x)
            keep = RIVER_KEEP[self.detector] if self._other.drift_detected else None
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
        self._old_logs = np.log(np.maximum(self._window(), LOG_FLOOR_S))

    def _prior(self) -> FloatArray | None:
        """The old regime shifted to the new samples' mean log-duration (sorted), or None
        while there are too few new samples or no prior."""
        old = self._old_logs
        if old is None or self._n < MIN_SHIFT_SAMPLES:
            return None
        if self._shifted[0] != self._seen:
            new = np.log(np.maximum(self._window(), LOG_FLOOR_S))
            self._shifted = (self._seen, np.exp(old + (float(new.mean()) - float(old.mean()))))
        return self._shifted[1]

    @property
    def trusted_samples(self) -> float:
        """Samples the model's CDF rests on: n, plus α while a drift prior stands in."""
        return self._n + (self.drift_prior if self._prior() is not None else 0.0)

    def _grow(self) -> None:
        """Double the ring (up to the window); only called while not full, _head = 0."""
        capacity = min(self.window, 2 * self._ring.shape[0])
        ring = np.zeros(capacity, dtype=np.float64)
        ring[: self._n] = self._ring[: self._n]
        self._ring = ring

    def _window(self) -> FloatArray:
        """The window's samples in ascending order, brought up to date (a view)."""
        pending = self._pending
        if pending is None:
            self._resort()
        elif pending:
            self._place(pending)
        return self._sorted[: self._n]

    def _resort(self) -> None:
        if self._sorted.shape[0] < self._n:
            self._sorted = np.zeros(self._ring.shape[0], dtype=np.float64)
        live = self._ring if self._n == self._ring.shape[0] else self._ring[: self._n]
        self._sorted[: self._n] = np.sort(live)
        self._sorted_n = self._n
        self._pending = []

    def _place(self, pending: list[tuple[float | None, float]]) -> None:
        """Apply the pending samples to the sorted window one at a time, in order."""
        if self._sorted.shape[0] < self._sorted_n + len(pending):
            grown = np.zeros(self._ring.shape[0], dtype=np.float64)
            grown[: self._sorted_n] = self._sorted[: self._sorted_n]
            self._sorted = grown
        buf, m = self._sorted, self._sorted_n
        for leaving, x in pending:
            if leaving is None:  # one more sample: shift the larger ones up
                i = int(buf[:m].searchsorted(x, "right"))
                buf[i + 1 : m + 1] = buf[i:m]
                buf[i] = x
                m += 1
                continue
            # One memmove over the span between the leaving and the arriving value.
            j = int(buf[:m].searchsorted(leaving, "left"))
            p = int(buf[:m].searchsorted(x, "right"))
            if p > j:
                buf[j : p - 1] = buf[j + 1 : p]
                buf[p - 1] = x
            else:
                buf[p + 1 : j + 1] = buf[p:j]
                buf[p] = x
        self._sorted_n = m
        self._pending = []

    def _keep_newest(self, keep: int) -> None:
        keep = max(0, min(keep, self._n))
        newest = self._arrival_order()[self._n - keep :]
        self._ring[:keep] = newest
        self._head = 0
        self._n = keep
        self._pending = None  # sorted anew when next read

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
        view = self._window()
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
        count = int(np.searchsorted(self._window(), duration_s, side="right"))
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
        return float(self._window()[index])

    def mean(self) -> float:
        """Mean of the window; 0.0 when empty."""
        return float(self._window().mean()) if self._n else 0.0

    def summary_cdf(self, duration_s: float) -> float:
        """CDF of a streaming histogram of the window's log-durations (``summary_bins``
        bins, built from the window in arrival order when asked for)."""
        summary = self._summary()
        if summary.n == 0:
            return 0.0
        return float(summary.cdf(math.log(max(duration_s, LOG_FLOOR_S))))

    def summary_bins_s(self) -> list[tuple[float, float, int]]:
        """That histogram's bins as ``(left_s, right_s, count)`` in seconds."""
        return [(math.exp(b.left), math.exp(b.right), int(b.count)) for b in self._summary()]

    def _summary(self) -> Any:
        if self._histogram[0] != self._seen:
            from river import sketch

            summary = sketch.Histogram(max_bins=self.summary_bins)
            for value in self._arrival_order().tolist():
                summary.update(math.log(value) if value > LOG_FLOOR_S else _LOG_FLOOR)
            self._histogram = (self._seen, summary)
        return self._histogram[1]

    def best_ttl(self, benefit_s: float, cap_s: float | None = None) -> tuple[float, float]:
        """``(τ*, F(τ*))`` over the window: the exact optimiser of ``estimator.ttl`` (over
        the mixture with the shifted old regime while a drift prior stands)."""
        n = self._n
        prior = self._prior()
        if prior is not None:
            a = self.drift_prior
            parts = [(n / (n + a), self._window()), (a / (n + a), prior)]
            return best_ttl_mixture(parts, benefit_s, cap_s)
        if self._ranks.shape[0] != n:
            self._ranks = np.arange(1, n + 1, dtype=np.float64) / n
        return best_ttl_sorted(self._window(), benefit_s, cap_s, self._ranks)

    def __getstate__(self) -> dict[str, Any]:
        # Only the live samples, in arrival order: compact and free of buffer garbage.
        # They go under ``_live``: a reader that would still feed a streaming histogram at
        # each sample finds no ``_ring`` and replays the log instead of failing to learn.
        state = dict(self.__dict__)
        state["_live"] = self._arrival_order()
        state["_head"] = 0
        for name in ("_ring", "_sorted", "_ranks", "_pending", "_sorted_n", "_histogram"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        live = state.pop("_ring", None)  # pickles before ``_live``; SketchModel's windows
        if live is None:
            live = state["_live"]
        state.pop("_live", None)
        state.pop("_summary", None)  # the histogram older pickles carried
        self.__dict__.update(state)
        capacity = min(self.window, max(self._n, INITIAL_CAPACITY))
        self._ring = np.zeros(capacity, dtype=np.float64)
        self._ring[: self._n] = live
        self._sorted = np.zeros(capacity, dtype=np.float64)
        self._sorted[: self._n] = np.sort(live)
        self._sorted_n = self._n
        self._pending = []
        self._ranks = np.empty(0, dtype=np.float64)
        self._histogram = (-1, None)

    def __repr__(self) -> str:
        return f"{super().__repr__()} n_samples={self._n} drift_epoch={self._drift_epoch}"
