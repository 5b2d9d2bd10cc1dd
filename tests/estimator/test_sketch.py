"""Compact models decide within the stated bound of the raw-duration decision."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator import DurationHierarchy, Level, RequestFacts, get_policy
from estimator.sketch import (
    GRID_BASE_S,
    GRID_RATIO,
    SketchModel,
    cdf_distance,
    decode_points,
    encode_points,
    sketch_points,
)
from estimator.ttl import best_ttl_sorted


def _objective(samples: np.ndarray, tau: float, benefit: float) -> float:
    """F(τ)·B − τ on the raw window."""
    return float(np.searchsorted(samples, tau, side="right") / samples.size * benefit - tau)


@st.composite
def windows(draw: st.DrawFn) -> np.ndarray:
    """Sorted windows from mixtures of log-normals, with ties and exact zeros at times."""
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 2000))
    rng = np.random.default_rng(seed)
    parts = draw(st.integers(1, 3))
    centers = rng.normal(0.0, 2.0, parts)
    which = rng.integers(0, parts, n)
    values = np.exp(rng.normal(centers[which], rng.uniform(0.05, 1.5, parts)[which]))
    if draw(st.booleans()):
        values = np.round(values, 1)  # ties, and zeros
    return np.sort(values)


@settings(max_examples=400, deadline=None)
@given(
    window=windows(),
    points=st.sampled_from([4, 16, 64, 128]),
    benefit=st.floats(0.01, 200.0),
    cap=st.one_of(st.none(), st.floats(0.0, 50.0)),
)
def test_compact_decision_within_b_over_k_of_the_optimum(window, points, benefit, cap):
    raw_tau, _ = best_ttl_sorted(window, benefit, cap)
    model = SketchModel.of(sketch_points(window, points), count=window.size)
    tau, f = model.best_ttl(benefit, cap)
    if cap is not None:
        assert tau <= cap
    assert f == pytest.approx(
        np.searchsorted(window, tau, side="right") / window.size, abs=1 / points
    )
    loss = _objective(window, raw_tau, benefit) - _objective(window, tau, benefit)
    if window.size <= points:
        assert (tau, loss) == (raw_tau, 0.0)  # sent whole: the same decision
    assert -1e-9 <= loss < benefit / points + 1e-9


@settings(max_examples=200, deadline=None)
@given(window=windows(), later=windows(), benefit=st.floats(0.01, 200.0))
def test_a_stale_summary_decides_within_twice_its_distance(window, later, benefit):
    """An engine holds the summary of ``window`` while the server's window is now
    ``later``: the loss on ``later`` is at most 2·sup|H − F|·B."""
    points = sketch_points(window, 64)
    distance = cdf_distance(points, window.size, later)
    tau, _ = SketchModel.of(points, count=window.size).best_ttl(benefit)
    raw_tau, _ = best_ttl_sorted(later, benefit)
    loss = _objective(later, raw_tau, benefit) - _objective(later, tau, benefit)
    assert loss <= 2 * distance * benefit + 1e-9


@settings(max_examples=200, deadline=None)
@given(window=windows(), points=st.sampled_from([4, 16, 128]))
def test_summary_cdf_is_below_and_within_1_over_k(window, points):
    model = SketchModel.of(sketch_points(window, points), count=window.size)
    probes = np.concatenate((window, window + 1e-9, [0.0, window[-1] * 2]))
    for x in probes[:: max(1, probes.size // 200)]:
        f = np.searchsorted(window, x, side="right") / window.size
        h = model.cdf(float(x))
        assert f - 1 / points < h <= f + 1e-12
    assert cdf_distance(sketch_points(window, points), window.size, window) < 1 / points


def _raw_hierarchy(rng: np.random.Generator) -> DurationHierarchy:
    raw = DurationHierarchy(min_samples=50)
    for _ in range(3000):
        tool = ("bash", "grep", "edit")[rng.integers(0, 3)]
        args = ("ls", "pytest -x", "git status")[rng.integers(0, 3)] if tool == "bash" else None
        scale = {"bash": 0.5, "grep": 0.05, "edit": 3.0}[tool]
        raw.update(tool, args, float(rng.lognormal(np.log(scale), 1.0)), tenant="t")
    return raw


def test_engine_hierarchy_of_compact_models_decides_like_the_raw_one():
    """Every level sent as a 128-point summary: the back-off picks the same level (true
    sample counts) and each continuum decision is within B/128 of the raw optimum."""
    rng = np.random.default_rng(7)
    raw = _raw_hierarchy(rng)
    compact = DurationHierarchy(min_samples=50)
    for level, tool, sig in [
        (Level.TENANT, "", ""),
        (Level.TOOL, "bash", ""),
        (Level.TOOL, "grep", ""),
        (Level.TOOL, "edit", ""),
    ]:
        model = raw.model(level, tool, None, "t")
        assert model is not None
        compact.install(
            level,
            SketchModel.of(
                sketch_points(model.sorted_samples(), 128), count=model.n_samples, seen=model.n_seen
            ),
            tool=tool,
            signature=sig,
            tenant="t",
        )
    policy = get_policy("continuum")
    models_raw = policy.new_models(min_samples=50)
    models_raw.durations = raw
    models_compact = policy.new_models(min_samples=50)
    models_compact.durations = compact
    for tool in ("bash", "grep", "edit"):
        for benefit in (0.05, 0.5, 2.0, 10.0, 80.0):
            facts = RequestFacts(tool=tool, tenant="t", reload_cost_s=benefit, queue_delay_s=0.0)
            a, b = policy.decide(facts, models_raw), policy.decide(facts, models_compact)
            assert a.basis == b.basis
            tool_model = raw.model(Level.TOOL, tool, None, "t")
            assert tool_model is not None
            window = tool_model.sorted_samples()
            loss = _objective(window, a.ttl_s, benefit) - _objective(window, b.ttl_s, benefit)
            assert -1e-9 <= loss < benefit / 128 + 1e-9


def test_a_summary_learns_as_a_window_of_its_cdf_and_pickles():
    window = np.sort(np.random.default_rng(1).lognormal(0, 1, 1000))
    model = SketchModel.of(sketch_points(window, 16), count=1000, seen=1500, drift_epoch=2)
    assert model.summarized
    assert model.n_samples == 1000
    assert model.n_seen == 1500
    h = model.cdf(1.0)
    copy = pickle.loads(pickle.dumps(model))
    assert copy.cdf(1.0) == h
    assert copy.n_samples == 1000
    model.update(1.0)
    assert not model.summarized
    assert model.n_samples == 1000  # a full window: the oldest left, one came
    assert model.n_seen == 1501
    assert model.drift_epoch == 2
    assert abs(model.cdf(1.0) - h) <= 1 / 1000 + 1e-12


def test_bad_summaries_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="ascending"):
        SketchModel.of([2.0, 1.0], count=2)
    with pytest.raises(ValueError, match="count must be"):
        SketchModel.of([1.0, 2.0], count=1)
    with pytest.raises(ValueError, match="points must be >= 1"):
        sketch_points(np.array([1.0]), 0)


@settings(max_examples=300, deadline=None)
@given(
    window=windows(),
    points=st.sampled_from([16, 128]),
    benefit=st.floats(0.01, 200.0),
)
def test_points_on_the_wire_grid_decide_within_1_over_k_plus_r(window, points, benefit):
    exact = sketch_points(window, points)
    wire = decode_points(encode_points(exact))
    assert (np.diff(wire) >= 0).all()
    assert (wire >= exact).all()
    assert (wire <= np.maximum(exact, GRID_BASE_S) * (1 + GRID_RATIO) * (1 + 1e-12)).all()
    raw_tau, _ = best_ttl_sorted(window, benefit)
    tau, _ = SketchModel.of(wire, count=window.size).best_ttl(benefit)
    loss = _objective(window, raw_tau, benefit) - _objective(window, tau, benefit)
    assert loss < (1 / points + GRID_RATIO) * benefit + GRID_BASE_S + 1e-9


def test_a_summary_learning_locally_keeps_the_window_it_was_given():
    window = np.sort(np.random.default_rng(2).lognormal(0, 1, 400))
    model = SketchModel.of(sketch_points(window, 16), count=400, window=2000)
    model.update(0.5)
    assert model.n_samples == 401  # grows towards 2,000, does not slide at 400
