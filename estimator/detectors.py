"""Change detectors a duration model may run on its log-durations besides ADWIN: River's
KSWIN and Page-Hinkley, and a robust two-sided CUSUM (``estimator.durations``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from river import drift

from estimator.ttl import FloatArray

__all__ = ["LOG_FLOOR_S", "RIVER_KEEP", "Cusum", "river_detector"]

#: Durations below this are logged as this (log of 0 is undefined); 1 µs.
LOG_FLOOR_S = 1e-6
#: Newest samples River's detectors keep on a detection (KSWIN's statistic window).
RIVER_KEEP = {"kswin": 30, "page-hinkley": 10}


def river_detector(name: str) -> Any:
    if name == "kswin":
        return drift.KSWIN(seed=0)
    if name == "page-hinkley":
        return drift.PageHinkley()
    return None


class Cusum:
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
