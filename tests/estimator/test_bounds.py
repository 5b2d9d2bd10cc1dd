"""Memory bounds of the estimator: per model and per tenant."""

from __future__ import annotations

import pickle
import random
import tracemalloc

import pytest

from estimator.durations import DurationModel
from estimator.hierarchy import DurationHierarchy, Level, NameLimitError


def _bytes_per(make: object, n: int = 500) -> float:
    assert callable(make)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = [make(i) for i in range(n)]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(kept) == n
    return sum(s.size_diff for s in after.compare_to(before, "filename")) / n


def _one_sample(_: int) -> DurationModel:
    model = DurationModel()  # window 2000: its buffers once took 32 KiB from the start
    model.update(1.0)
    return model


def test_a_model_seen_once_costs_about_a_kilobyte() -> None:
    assert _bytes_per(_one_sample) < 4096  # 33 KB before


def test_a_new_name_costs_a_few_kilobytes() -> None:
    h = DurationHierarchy()
    # Warm up the tenant's own models, then count only what each new tool name adds.
    h.update("warm", "x", 1.0, tenant="acme")
    assert _bytes_per(lambda i: h.update(f"tool-{i}", f"cmd{i}", 1.0, tenant="acme")) < 8192


@pytest.mark.parametrize("window", [1, 5, 16, 17, 100])
def test_growing_buffers_keep_the_window_exact(window: int) -> None:
    rng = random.Random(window)
    model = DurationModel(window=window, forget_on_drift=False)
    seen: list[float] = []
    for _ in range(300):
        seen.append(rng.expovariate(1.0))
        model.update(seen[-1])
        assert list(model.sorted_samples()) == sorted(seen[-window:])
        assert list(model.recent_samples()) == seen[-window:]
    again = pickle.loads(pickle.dumps(model))
    assert list(again.sorted_samples()) == sorted(seen[-window:])
    again.update(0.5)
    assert again.n_samples == min(window, 301)


def test_name_bounds_per_tenant() -> None:
    h = DurationHierarchy(min_samples=0, max_tools=2, max_signatures=3)
    h.update("bash", "ls", 1.0, tenant="a")
    h.update("bash", "pytest", 1.0, tenant="a")
    h.update("fetch", '{"cmd": "curl x"}', 1.0, tenant="a")  # names a command
    assert h.name_counts("a") == (2, 3)
    with pytest.raises(NameLimitError, match="3 distinct signatures"):
        h.update("bash", "make", 1.0, tenant="a")
    with pytest.raises(NameLimitError, match="2 distinct tool names") as error:
        h.update("grep", None, 1.0, tenant="a")
    assert (error.value.what, error.value.limit) == ("tool names", 2)
    assert h.tenant_samples("a") == 3  # nothing of the refused calls was learned
    h.update("bash", "ls -la", 2.0, tenant="a")  # known names still learn
    h.update("grep", "make", 1.0, tenant="b")  # other tenants have their own bounds
    assert h.model(Level.INVOCATION, "bash", "ls", "a").n_samples == 2  # type: ignore[union-attr]
    restored = pickle.loads(pickle.dumps(h))
    assert restored.name_counts("a") == (2, 3)
    assert restored.clone().max_tools == 2
