"""η, remaining turns, T and the cost model."""

from __future__ import annotations

import numpy as np
import pytest

from estimator import (
    PROFILES,
    CostModel,
    MemoryFactor,
    Models,
    QueueDelay,
    RemainingTurns,
    get_profile,
)


def _pairs_eta(lengths: list[int]) -> float:
    ks = [k for n in lengths for k in range(1, n)]
    rest = [n - k for n in lengths for k in range(1, n)]
    return float(-np.corrcoef(ks, rest)[0, 1])


def test_eta_matches_numpy_and_windows() -> None:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 40, size=600)]
    eta = MemoryFactor(window=256)
    for n in lengths:
        eta.update(n)
    assert eta.get() == pytest.approx(_pairs_eta(lengths[-256:]), abs=1e-12)
    assert eta.n_programs == 256


def test_eta_extremes() -> None:
    fixed = MemoryFactor()
    for _ in range(50):
        fixed.update(12)
    assert fixed.get() == 1.0
    rng = np.random.default_rng(1)
    geometric = MemoryFactor(window=5000)
    for n in rng.geometric(0.1, size=5000):
        geometric.update(int(n))
    assert abs(geometric.get()) < 0.05
    single = MemoryFactor()
    single.update(1)  # no pairs
    assert single.get() == 0.0


def test_remaining_turns_is_conditional_mean() -> None:
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 30, size=256)
    rt = RemainingTurns(window=256)
    for n in lengths:
        rt.update(int(n))
    for k in (0, 5, 20):
        longer = lengths[lengths > k]
        assert rt.expected_remaining(k) == pytest.approx(longer.mean() - k)
    assert rt.expected_remaining(1000) == rt.prior_turns


def test_a_revised_length_is_as_if_learned_so_and_kept_in_its_place() -> None:
    """A program's length corrected later (another engine saw more of it) gives what
    learning the corrected length in its place gives, also once the window moves on."""
    lengths = [3, 8, 5, 3, 9, 2]
    corrected = [3, 8, 5, 6, 9, 2]  # the last 3 was 6
    eta, rt = MemoryFactor(window=4), RemainingTurns(window=4)
    want_eta, want_rt = MemoryFactor(window=4), RemainingTurns(window=4)
    for n, m in zip(lengths, corrected, strict=True):
        eta.update(n)
        rt.update(n)
        want_eta.update(m)
        want_rt.update(m)
        if n == 3 and eta.n_programs == 4:
            assert eta.revise(3, 6)
            assert rt.revise(3, 6)
    assert eta.get() == want_eta.get()
    for k in (0, 2, 5):
        assert rt.expected_remaining(k) == want_rt.expected_remaining(k)
    for n in (4, 4, 4, 4):  # the corrected program leaves the window like any other
        for a in (eta, rt, want_eta, want_rt):
            a.update(n)
    assert eta.get() == want_eta.get() == 1.0
    assert not eta.revise(6, 7)
    assert not rt.revise(6, 7)
    with pytest.raises(ValueError, match="corrected"):
        eta.revise(4, 0)


def test_queue_delay_window_mean() -> None:
    t = QueueDelay(window=3)
    assert t.get() == 0.0
    for d in (1.0, 2.0, 3.0, 10.0):
        t.update(d)
    assert t.get() == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: MemoryFactor().update(0), "total_turns must be >= 1, got 0"),
        (lambda: MemoryFactor().update(2.5), "total_turns must be an integer"),  # type: ignore[arg-type]
        (lambda: RemainingTurns().expected_remaining(-1), "turns_served must be >= 0"),
        (lambda: QueueDelay().update(float("nan")), "delay_s must be finite"),
        (lambda: QueueDelay(window=0), "window must be a positive integer"),
        (lambda: CostModel([(1, 1.0), (2, 2.0)], 0), "kv_bytes_per_token must be > 0"),
        (
            lambda: CostModel([(1, 1.0), (2, 2.0)], 10, offload_bandwidth_bps=-5.0),
            "offload_bandwidth_bps must be > 0, got -5.0",
        ),
        (lambda: CostModel([(1, 1.0), (1, 2.0)], 10), "at least two distinct token counts"),
        (lambda: CostModel([(1, -1.0), (2, 2.0)], 10), r"prefill_points\[0\] seconds must be >= 0"),
    ],
)
def test_bad_input(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_program_end_rejected_updates_nothing() -> None:
    models = Models.for_profile()
    with pytest.raises(ValueError, match="total_turns"):
        models.record_program_end(-3)
    stats = models.workload()
    assert stats.eta.n_programs == 0
    assert stats.remaining.n_programs == 0


def test_cost_model_fits_the_profile_and_learns_online() -> None:
    profile = get_profile("llama3.1-8b-h100")
    model = CostModel.from_profile(profile, refit_every=16)
    for tokens in (1000, 8000, 32000, 100_000):
        assert model.prefill_s(tokens) == pytest.approx(profile.prefill_s(tokens), rel=0.05)
    # Observed timings 2x slower than the roofline pull the curve up.
    for _ in range(4):
        for tokens in (2000, 8000, 16000, 32000):
            model.update(tokens, 2 * profile.prefill_s(tokens))
    assert model.prefill_s(16000) > 1.4 * profile.prefill_s(16000)
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        model.update(100, -1.0)
    assert model.reload_s(10_000) == pytest.approx(10_000 * 131072 / 50e9)
    assert CostModel([(1, 1.0), (2, 2.0)], 10).reload_s(5) == float("inf")


def test_cost_model_prices_an_engine_far_from_its_profile_as_measured() -> None:
    """A CPU engine 12x slower than the GPU roofline it starts from, timed on a narrow band
    of prompt sizes with noise: after ``min_observed`` prefills the curve is at the
    measured level there, and before that it is the profile's."""
    profile = get_profile("llama3.1-8b-h100")
    model = CostModel.from_profile(profile)
    rng = np.random.default_rng(0)
    for i in range(model.min_observed):
        tokens = int(rng.integers(400, 1200))
        if i == model.min_observed - 1:
            assert model.prefill_s(800) == pytest.approx(profile.prefill_s(800), rel=0.05)
        model.update(tokens, 12 * profile.prefill_s(tokens) * float(rng.uniform(0.8, 1.25)))
    assert model.prefill_s(800) == pytest.approx(12 * profile.prefill_s(800), rel=0.25)
    with pytest.raises(ValueError, match="min_observed must be >= 1"):
        CostModel([(1, 1.0), (2, 2.0)], 10, min_observed=0)


def test_profiles_are_consistent() -> None:
    assert set(PROFILES) == {"llama3.1-8b-h100", "llama3.1-8b-a100", "llama3.1-70b-h100-tp4"}
    h100, a100 = get_profile("llama3.1-8b-h100"), get_profile("llama3.1-8b-a100")
    assert a100.prefill_s(8000) > 3 * h100.prefill_s(8000)
    assert h100.kv_bytes_per_token == 128 * 1024
    assert get_profile("llama3.1-70b-h100-tp4").kv_bytes_per_token == 320 * 1024
    assert h100.kv_pool_tokens > 300_000
    with pytest.raises(ValueError, match=r"valid: llama3\.1-70b-h100-tp4, llama3\.1-8b-a100"):
        get_profile("gpt")


def test_prefill_reload_with_a_partial_tier_and_without_a_bandwidth() -> None:
    points = [(1000, 0.1), (2000, 0.2), (4000, 0.45)]
    tier = CostModel(points, 131072, offload_bandwidth_bps=50e9)
    full = tier.prefill_reload_s(4000, offload=True)
    part = tier.prefill_reload_s(4000, offload=True, offloaded_tokens=3000)
    assert full == tier.reload_s(4000)
    expected = tier.reload_s(3000) + tier.prefill_s(4000) - tier.prefill_s(3000)
    assert part == pytest.approx(expected)
    assert full < part < tier.prefill_s(4000)
    assert tier.prefill_reload_s(4000, offload=True, offloaded_tokens=9000) == full
    no_bandwidth = CostModel(points, 131072)
    assert no_bandwidth.reload_s(4000) == float("inf")
    assert no_bandwidth.prefill_reload_s(4000, offload=True) == no_bandwidth.prefill_s(4000)
