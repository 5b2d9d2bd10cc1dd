"""The sorted window is brought up to date when read: whenever it is read, it is the
window's samples sorted, and a model read after every sample decides as one read rarely."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from estimator.durations import RESORT_AFTER, DurationModel


def _stream(seed: int, n: int) -> list[float]:
    rng = np.random.default_rng(seed)
    first = rng.lognormal(0.0, 1.0, n // 2)
    second = rng.lognormal(np.log(8.0), 0.5, n - n // 2)  # a change of regime
    values = np.concatenate((first, second))
    values[::97] = 0.0  # zeros, and repeats of one value
    values[5::89] = 1.5
    return [float(v) for v in values]


@pytest.mark.parametrize("detector", ["adwin", "adwin-fast", "cusum", "kswin"])
@pytest.mark.parametrize("drift_prior", [0.0, 20.0])
def test_reads_at_any_moment_see_the_window_sorted(detector: str, drift_prior: float) -> None:
    eager = DurationModel(window=300, detector=detector, drift_prior=drift_prior)
    lazy = DurationModel(window=300, detector=detector, drift_prior=drift_prior)
    rng = np.random.default_rng(7)
    gaps = 0
    for i, x in enumerate(_stream(1, 2500)):
        eager.update(x)
        lazy.update(x)
        window = np.sort(eager.recent_samples())
        assert np.array_equal(eager.sorted_samples(), window)  # read after every sample
        gaps += 1
        if rng.random() < 0.05 or i % 500 == 499:  # read after 1 to ~60 samples
            assert np.array_equal(lazy.sorted_samples(), window), (i, gaps)
            for benefit in (0.5, 3.0, 40.0):
                assert lazy.best_ttl(benefit) == eager.best_ttl(benefit)
                assert lazy.best_ttl(benefit, cap_s=2.0) == eager.best_ttl(benefit, cap_s=2.0)
            for q in (0.0, 0.5, 0.99, 1.0):
                assert lazy.quantile(q) == eager.quantile(q)
            assert lazy.cdf(1.5) == eager.cdf(1.5)
            assert lazy.mean() == eager.mean()
            assert lazy.trusted_samples == eager.trusted_samples
            gaps = 0
    assert (lazy.n_samples, lazy.n_seen, lazy.drift_epoch) == (
        eager.n_samples,
        eager.n_seen,
        eager.drift_epoch,
    )
    assert eager.drift_epoch >= 1  # the stream did change regime


@pytest.mark.parametrize("learned", [1, RESORT_AFTER, RESORT_AFTER + 1, 40])
def test_a_pickle_holds_what_was_learned_since_the_last_read(learned: int) -> None:
    model = DurationModel(window=20)
    values = _stream(2, 60)
    for x in values[:30]:
        model.update(x)
    model.sorted_samples()
    for x in values[30 : 30 + learned]:
        model.update(x)
    copy = pickle.loads(pickle.dumps(model))
    assert np.array_equal(copy.sorted_samples(), np.sort(model.recent_samples()))
    assert np.array_equal(copy.recent_samples(), model.recent_samples())
    assert copy.best_ttl(3.0) == model.best_ttl(3.0)


def test_a_pickle_of_the_earlier_layout_still_loads() -> None:
    """Snapshots written when each model carried a streaming histogram and its ring."""
    model = DurationModel(window=50)
    for x in _stream(3, 80):
        model.update(x)
    state = model.__getstate__()
    state["_ring"] = state.pop("_live")
    state["_summary"] = object()  # what the earlier layout held; dropped on load
    old = DurationModel.__new__(DurationModel)
    old.__setstate__(state)
    assert "_summary" not in vars(old)
    assert np.array_equal(old.sorted_samples(), model.sorted_samples())
    assert old.best_ttl(3.0) == model.best_ttl(3.0)
    old.update(2.0)
    model.update(2.0)
    assert np.array_equal(old.sorted_samples(), model.sorted_samples())


def test_a_new_pickle_has_no_ring_for_a_reader_of_the_earlier_layout() -> None:
    """A reader that would feed a histogram at each sample fails to load it (and replays
    the log) instead of loading a model it cannot learn into."""
    model = DurationModel(window=10)
    model.update(1.0)
    state = model.__getstate__()
    assert "_ring" not in state
    assert "_summary" not in state
    assert list(state["_live"]) == [1.0]
