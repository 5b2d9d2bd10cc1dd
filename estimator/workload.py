"""Workload-level statistics: the memory factor η, remaining turns, and queueing delay T."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from estimator._checks import check_count, check_duration
from estimator.base import Estimator

__all__ = ["MemoryFactor", "QueueDelay", "RemainingTurns"]


def _check_window(window: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    return window


def _pair_sums(n: int) -> tuple[int, int, int, int]:
    """Σk, Σk², Σk(N−k) and the pair count over k = 1 … N−1 (exact integers)."""
    m = n - 1
    s1 = m * n // 2
    s2 = m * n * (2 * m + 1) // 6
    return s1, s2, n * s1 - s2, m


def _replace_latest(window: deque[int], total_turns: int, corrected: int) -> bool:
    """Replace the last ``total_turns`` in ``window`` with ``corrected`` (>= 1); False if
    the window holds none."""
    if check_count("corrected", corrected) < 1:
        raise ValueError(f"corrected must be >= 1, got {corrected!r}")
    for i in range(len(window) - 1, -1, -1):
        if window[i] == total_turns:
            window[i] = corrected
            return True
    return False


class MemoryFactor(Estimator):
    """η = −Corr(k, N−k) over the (k, N−k) pairs of the last ``window`` completed programs.

    A program of N turns contributes k = 1 … N−1. Fixed-length programs give 1, memoryless
    (geometric) lengths about 0; undefined (fewer than two distinct lengths, …) gives 0.
    Sums are exact integers, so adding and removing programs never drifts.

    >>> eta = MemoryFactor()
    >>> eta.get()
    0.0
    >>> for n in [10, 10, 10]:
    ...     eta.update(n)
    >>> eta.get()
    1.0
    >>> eta.update(30)
    >>> round(eta.get(), 3)
    0.225
    """

    def __init__(self, window: int = 256) -> None:
        self.window = _check_window(window)
        self._programs: deque[int] = deque()
        self._sums = [0, 0, 0, 0]  # Σk, Σk², Σk(N−k), pairs; Σ(N−k) = Σk, Σ(N−k)² = Σk²

    def update(self, total_turns: int) -> None:
        """Learn one completed program of ``total_turns`` turns (>= 1)."""
        if check_count("total_turns", total_turns) < 1:
            raise ValueError(f"total_turns must be >= 1, got {total_turns!r}")
        if len(self._programs) == self.window:
            self._add(self._programs.popleft(), -1)
        self._programs.append(total_turns)
        self._add(total_turns, 1)

    def revise(self, total_turns: int, corrected: int) -> bool:
        """Correct the latest program learned as ``total_turns`` to ``corrected`` turns
        (another engine saw more of it), in its place; False if none is in the window."""
        if not _replace_latest(self._programs, total_turns, corrected):
            return False
        self._add(total_turns, -1)
        self._add(corrected, 1)
        return True

    def _add(self, n: int, sign: int) -> None:
        for i, value in enumerate(_pair_sums(n)):
            self._sums[i] += sign * value

    def get(self) -> float:
        """The current η in [−1, 1]; 0.0 when undefined."""
        s1, s2, cross, count = self._sums
        if count < 2:
            return 0.0
        # k and N−k have the same mean and variance over the pairs (the pair set is
        # symmetric), so Corr = (E[k(N−k)] − E[k]²) / Var(k).
        var_num = count * s2 - s1 * s1
        if var_num <= 0:
            return 0.0
        return -float(count * cross - s1 * s1) / float(var_num)

    @property
    def n_programs(self) -> int:
        """Completed programs in the window."""
        return len(self._programs)


class RemainingTurns(Estimator):
    """E[N − k | N > k]: a program's expected remaining turns after k, from recent programs.

    Falls back to ``prior_turns`` (the mean length guess) when no recent program ran
    longer than k.

    >>> rt = RemainingTurns()
    >>> for n in [4, 6, 8]:
    ...     rt.update(n)
    >>> rt.expected_remaining(2)
    4.0
    >>> rt.expected_remaining(7)
    1.0
    """

    def __init__(self, window: int = 256, prior_turns: float = 1.0) -> None:
        self.window = _check_window(window)
        self.prior_turns = prior_turns
        self._programs: deque[int] = deque(maxlen=window)
        self._sorted: np.ndarray | None = None

    def update(self, total_turns: int) -> None:
        """Learn one completed program of ``total_turns`` turns (>= 1)."""
        if check_count("total_turns", total_turns) < 1:
            raise ValueError(f"total_turns must be >= 1, got {total_turns!r}")
        self._programs.append(total_turns)
        self._sorted = None

    def revise(self, total_turns: int, corrected: int) -> bool:
        """As :meth:`MemoryFactor.revise`: the latest ``total_turns`` becomes ``corrected``."""
        if not _replace_latest(self._programs, total_turns, corrected):
            return False
        self._sorted = None
        return True

    def expected_remaining(self, turns_served: int) -> float:
        """Expected turns still to come after ``turns_served`` (>= 0) turns."""
        k = check_count("turns_served", turns_served)
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._programs, dtype=np.int64))
        longer = self._sorted[np.searchsorted(self._sorted, k, side="right") :]
        if longer.size == 0:
            return float(self.prior_turns)
        return float(longer.mean() - k)

    @property
    def n_programs(self) -> int:
        """Completed programs in the window."""
        return len(self._programs)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_sorted"] = None  # a cache
        return state


class QueueDelay(Estimator):
    """T: sliding-window mean of the admission delay of returning, released requests.

    >>> t = QueueDelay(window=2)
    >>> t.get()
    0.0
    >>> for d in [1.0, 2.0, 4.0]:
    ...     t.update(d)
    >>> t.get()
    3.0
    """

    def __init__(self, window: int = 256) -> None:
        self.window = _check_window(window)
        self._delays: deque[float] = deque(maxlen=window)

    def update(self, delay_s: float) -> None:
        """Learn one admission delay in seconds (finite, >= 0)."""
        delay = check_duration("delay_s", delay_s)
        self._delays.append(delay)

    def get(self) -> float:
        """The mean delay; 0.0 before any update."""
        return math.fsum(self._delays) / len(self._delays) if self._delays else 0.0

    @property
    def n_samples(self) -> int:
        """Delays in the window."""
        return len(self._delays)
