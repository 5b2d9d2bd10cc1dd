"""Back-off hierarchy, signatures, and the TTL policies' decisions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator import (
    POLICIES,
    CachettlPolicy,
    DurationHierarchy,
    Level,
    Models,
    RequestFacts,
    SignatureRegistry,
    get_policy,
    json_signature,
    optimal_ttl,
    shell_signature,
)
from estimator.hierarchy import MIN_CONTRADICTING_SAMPLES


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ("cd repo && pytest -x", "cd+pytest"),
        ("cat a.py | grep foo || echo none; ls", "cat+grep+echo+ls"),
        ("  python -c 'print(1)' ", "python"),
        ("echo 'a && b'", "echo+b'"),  # quotes do not protect operators from the split
        ("PYTHONPATH=. python x.py", "python"),
        ("/usr/bin/env bash -c true", "env"),
        ("", ""),
    ],
)
def test_shell_signature(args: str, expected: str) -> None:
    assert shell_signature("bash", args) == expected


def test_json_signature() -> None:
    assert json_signature("fetch_url", '{"url": "x", "timeout": 3}') == "fetch_url(timeout,url)"
    assert json_signature("fetch_url", "[1, 2]") == "fetch_url"


def test_registry_is_pluggable() -> None:
    registry = SignatureRegistry({"python": lambda tool, args: args.split()[0]})
    assert registry.signature("python", "import os") == "import"
    assert registry.signature("bash", "ls -la") == "ls"
    assert registry.signature("bash", None) == ""


def _fill(h: DurationHierarchy, tool: str, args: str | None, n: int, value: float, **kw: object):
    for _ in range(n):
        h.update(tool, args, value, **kw)  # type: ignore[arg-type]


def test_backoff_walks_invocation_tool_tenant_shared() -> None:
    h = DurationHierarchy(min_samples=100)
    for i in range(151):  # a stationary mix: 2 pytest calls for every ls
        args, value = ("ls", 0.1) if i % 3 == 2 else ("pytest -x", 9.0)
        h.update("bash", args, value, tenant="a", share=True)
    assert h.lookup("bash", "pytest tests", tenant="a").level is Level.INVOCATION
    # `ls` has only 50 samples: back off to the tool (151 samples).
    found = h.lookup("bash", "ls", tenant="a")
    assert found.level is Level.TOOL
    assert found.model is not None
    assert found.model.n_samples == 151
    # A new tool of the same tenant: all tools of the tenant.
    assert h.lookup("grep", "x", tenant="a").level is Level.TENANT
    # Another tenant with nothing: shared statistics of the tool, if asked for.
    assert h.lookup("bash", "ls", tenant="b").level is Level.SHARED
    assert h.lookup("bash", "ls", tenant="b", levels=(Level.TOOL, Level.TENANT)).level is None
    # A level needs *more than* K samples.
    h2 = DurationHierarchy(min_samples=100)
    _fill(h2, "bash", "ls", 100, 0.1)
    assert h2.lookup("bash", "ls").level is None


def test_tenants_are_isolated_and_sharing_is_opt_in() -> None:
    h = DurationHierarchy(min_samples=0)
    _fill(h, "bash", "ls", 5, 0.1, tenant="private")
    _fill(h, "bash", "ls", 5, 7.0, tenant="sharer", share=True)
    shared = h.model(Level.SHARED, "bash")
    assert shared is not None
    assert shared.n_samples == 5
    assert shared.quantile(0.5) == 7.0
    assert h.tools("private") == ["bash"]
    assert h.signatures_of("bash", "private") == ["ls"]
    assert h.tenants() == ["private", "sharer"]


def test_bad_event_leaves_every_level_untouched() -> None:
    h = DurationHierarchy()
    h.update("bash", "ls", 1.0, tenant="a", share=True)
    with pytest.raises(ValueError, match="duration_s must be >= 0"):
        h.update("bash", "ls", -1.0, tenant="a", share=True)
    with pytest.raises(ValueError, match="tool must be a non-empty string"):
        h.update("", "ls", 1.0, tenant="a")
    assert h.tenant_samples("a") == 1
    assert all(model.n_samples == 1 for _, model in h.items())


def _models(policy: str, min_samples: int = 100) -> Models:
    return get_policy(policy).new_models(min_samples=min_samples)


def test_continuum_equals_optimal_ttl_over_the_tool_window() -> None:
    rng = np.random.default_rng(0)
    models = _models("continuum")
    durations = rng.lognormal(-0.5, 1.2, size=400)
    for x in durations:
        models.record_tool_call("grep", "-r foo", float(x))
    for x in rng.lognormal(2, 1, size=50):
        models.record_tool_call("pytest", None, float(x))
    policy = get_policy("continuum")
    decision = policy.decide(
        RequestFacts(tool="grep", reload_cost_s=1.5, queue_delay_s=3.0), models
    )
    # η is 0 before any program ends: B = PrefillReload.
    assert decision.basis == "tool"
    assert decision.benefit_s == 1.5
    assert decision.ttl_s == optimal_ttl(durations, 1.5)
    # pytest has ≤ K samples: the CDF pooled over all tools.
    pooled = np.concatenate([durations, []])
    decision = policy.decide(RequestFacts(tool="pytest", reload_cost_s=1.5), models)
    assert decision.basis == "all-tools"
    all_samples = models.durations.model(Level.TENANT).recent_samples()  # type: ignore[union-attr]
    assert decision.ttl_s == optimal_ttl(all_samples, 1.5)
    assert len(all_samples) == len(pooled) + 50


def test_continuum_cold_start_is_log_of_benefit() -> None:
    models = _models("continuum")
    for n in (5, 5, 5):
        models.record_program_end(n)  # fixed length: η = 1
    models.record_queue_delay(2.0)
    facts = RequestFacts(tool="ls", reload_cost_s=1.0)
    decision = get_policy("continuum").decide(facts, models)
    assert decision.basis == "cold-start"
    assert decision.benefit_s == pytest.approx(3.0)  # T·η + PrefillReload
    assert decision.ttl_s == pytest.approx(math.log(3.0))
    assert decision.return_probability == pytest.approx(1 - 1 / 3)
    small = get_policy("continuum").decide(
        RequestFacts(tool="ls", reload_cost_s=0.5), _models("continuum")
    )
    assert (small.ttl_s, small.basis) == (0.0, "cold-start")


def test_benefit_uses_the_cost_model_when_not_overridden() -> None:
    models = _models("continuum")
    facts = RequestFacts(tool="ls", context_tokens=32_000)
    decision = get_policy("continuum").decide(facts, models)
    assert decision.benefit_s == pytest.approx(models.cost.prefill_s(32_000))
    offload = get_policy("continuum").decide(
        RequestFacts(tool="ls", context_tokens=32_000, offload=True), models
    )
    assert offload.benefit_s == pytest.approx(models.cost.reload_s(32_000))


def test_cachettl_separates_invocations_and_caps() -> None:
    models = _models("cachettl", min_samples=100)
    for _ in range(150):
        models.record_tool_call("bash", "ls -la", 0.05)
        models.record_tool_call("bash", "pytest -x", 40.0)
    policy = get_policy("cachettl", ttl_cap_s=30.0)
    ls = policy.decide(
        RequestFacts(tool="bash", tool_args="ls", reload_cost_s=2.0, queue_delay_s=0.0), models
    )
    assert (ls.ttl_s, ls.basis, ls.return_probability) == (0.05, "invocation", 1.0)
    pytest_facts = RequestFacts(
        tool="bash", tool_args="pytest", reload_cost_s=2.0, queue_delay_s=0.0
    )
    test = policy.decide(pytest_facts, models)
    assert (test.ttl_s, test.basis) == (0.0, "invocation")
    # The paper's policy sees one `bash` tool: half its calls return within 0.05 s.
    paper = get_policy("continuum").decide(
        RequestFacts(tool="bash", tool_args="ls", reload_cost_s=2.0, queue_delay_s=0.0), models
    )
    assert (paper.basis, paper.return_probability) == ("tool", 0.5)
    # The cap binds even where the optimum is larger.
    for _ in range(150):
        models.record_tool_call("bash", "make", 60.0)
    big = policy.decide(RequestFacts(tool="bash", tool_args="make", reload_cost_s=1000.0), models)
    assert big.ttl_s == 0.0  # 60 s > cap: the only capped candidate is 0
    cold = policy.decide(RequestFacts(tool="new", reload_cost_s=1e30), _models("cachettl"))
    assert cold.ttl_s == 30.0
    assert cold.basis == "cold-start"


def test_cachettl_slack_holds_a_multiple_of_the_optimum_with_its_own_return_chance() -> None:
    models = _models("cachettl", min_samples=10)
    durations = [0.05, 0.1, 0.2, 0.4] * 5  # the optimum at B = 2 s is 0.4 s, F = 1
    for d in durations:
        models.record_tool_call("grep", None, d)
    facts = RequestFacts(tool="grep", reload_cost_s=2.0, queue_delay_s=0.0)
    exact = get_policy("cachettl").decide(facts, models)
    assert (exact.ttl_s, exact.return_probability) == (optimal_ttl(durations, 2.0), 1.0)
    # B = 0.3 s: the optimum is 0.1 s (F = 0.5); twice that is 0.2 s, where F is 0.75.
    cheap = RequestFacts(tool="grep", reload_cost_s=0.3, queue_delay_s=0.0)
    wide = get_policy("cachettl", ttl_slack=2.0).decide(cheap, models)
    assert optimal_ttl(durations, 0.3) == 0.1
    assert wide.ttl_s == pytest.approx(0.2)
    assert wide.return_probability == 0.75
    assert wide.expected_benefit_s == pytest.approx(0.75 * 0.3 - 0.2)
    # The cap still binds; no pin stays no pin.
    capped = get_policy("cachettl", ttl_slack=2.0, ttl_cap_s=0.15).decide(cheap, models)
    assert capped.ttl_s == 0.15
    never = RequestFacts(tool="grep", reload_cost_s=0.01, queue_delay_s=0.0)
    assert get_policy("cachettl", ttl_slack=3.0).decide(never, models).ttl_s == 0.0
    # Cold start: Exp(1 s) gives ln(B); F is taken at the widened TTL.
    cold = get_policy("cachettl", ttl_slack=2.0).decide(
        RequestFacts(tool="new", reload_cost_s=3.0, queue_delay_s=0.0), _models("cachettl")
    )
    assert cold.ttl_s == pytest.approx(2 * math.log(3.0))
    assert cold.return_probability == pytest.approx(1 - math.exp(-2 * math.log(3.0)))
    for bad in (0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="ttl_slack must be"):
            get_policy("cachettl", ttl_slack=bad)


def test_cachettl_uses_shared_priors_only_for_sharing_tenants() -> None:
    models = _models("cachettl", min_samples=10)
    for _ in range(20):
        models.record_tool_call("fetch", None, 0.2, tenant="veteran", share=True)
    policy = get_policy("cachettl")
    newcomer = RequestFacts(tool="fetch", tenant="new", reload_cost_s=1.0, share=True)
    assert policy.decide(newcomer, models).basis == "shared"
    loner = RequestFacts(tool="fetch", tenant="new", reload_cost_s=1.0, share=False)
    assert policy.decide(loner, models).basis == "cold-start"


def test_registry_lists_names_and_fixed_policy() -> None:
    assert sorted(POLICIES) == ["cachettl", "continuum", "fixed", "none"]
    models = _models("continuum", min_samples=0)
    for _ in range(3):
        models.record_tool_call("slow", None, 10.0)
    fixed = get_policy("fixed", ttl_s=2.0)
    assert fixed.decide(RequestFacts(tool="slow"), models).ttl_s == 0.0  # mean > TTL: skipped
    assert fixed.decide(RequestFacts(tool="fast"), models).ttl_s == 2.0
    with pytest.raises(ValueError, match="unknown TTL policy 'x'; valid: cachettl, continuum"):
        get_policy("x")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tool": ""}, "tool must be a non-empty string"),
        ({"tool": "ls", "context_tokens": -1}, "context_tokens must be >= 0, got -1"),
        ({"tool": "ls", "reload_cost_s": float("nan")}, "reload_cost_s must be finite"),
        ({"tool": "ls", "queue_delay_s": -2.0}, "queue_delay_s must be >= 0"),
    ],
)
def test_bad_facts(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RequestFacts(**kwargs)  # type: ignore[arg-type]


def test_facts_are_keyword_only() -> None:
    """Thirteen fields of which many are ints or optional floats: a positional call could
    silently shift one into the next, so the constructor refuses positions."""
    with pytest.raises(TypeError, match="positional"):
        RequestFacts("bash", "ls")  # type: ignore[call-arg]
    facts = RequestFacts(tool="bash", waiting_tokens=3, free_tokens=4, offloaded_tokens=5)
    assert (facts.waiting_tokens, facts.free_tokens, facts.offloaded_tokens) == (3, 4, 5)


def test_load_aware_pressure_scales_the_cost_of_holding() -> None:
    models = _models("cachettl", min_samples=10)
    for i in range(40):
        models.record_tool_call("bash", "pytest", 1.0 if i % 2 else 8.0)
    base = {"tool": "bash", "tool_args": "pytest", "context_tokens": 10_000, "reload_cost_s": 6.0}
    paper = get_policy("cachettl").decide(RequestFacts(**base), models)  # type: ignore[arg-type]
    # λ = 1: 0.5·6 − 1 = 2 beats 1·6 − 8 = −2.
    assert paper.ttl_s == 1.0
    aware = CachettlPolicy(load_aware=True, load_floor=0.25)
    idle = RequestFacts(**base, waiting_tokens=0, free_tokens=500_000)  # type: ignore[arg-type]
    # λ = 0.25: 0.5·6 − 0.25 = 2.75 < 6 − 2 = 4: hold through the slow calls too.
    assert aware.pressure(idle) == 0.25
    decision = aware.decide(idle, models)
    assert decision.ttl_s == 8.0
    assert decision.expected_benefit_s == pytest.approx(6.0 - 0.25 * 8.0)
    busy = RequestFacts(**base, waiting_tokens=400_000, free_tokens=0)  # type: ignore[arg-type]
    assert aware.pressure(busy) == 1.0
    assert aware.decide(busy, models).ttl_s == 1.0
    with pytest.raises(ValueError, match=r"load_floor must be in \(0, 1\], got 0.0"):
        get_policy("cachettl", load_floor=0.0)


def test_per_program_eta_follows_progress() -> None:
    models = _models("cachettl")
    for _ in range(20):
        models.record_program_end(10)
    policy = get_policy("cachettl")  # per_program is the default
    early = RequestFacts(tool="ls", turns_served=1)
    late = RequestFacts(tool="ls", turns_served=9)
    assert policy.eta(early, models) == pytest.approx(0.1)
    assert policy.eta(late, models) == pytest.approx(0.9)
    global_eta = get_policy("cachettl", per_program=False)
    assert global_eta.eta(early, models) == 1.0  # the global η of fixed lengths


def test_signature_cache_is_bounded_and_follows_registration() -> None:
    from estimator.signatures import CACHE_SIZE

    registry = SignatureRegistry()
    for i in range(CACHE_SIZE + 10):
        assert registry.signature("bash", f"cmd{i} --flag") == f"cmd{i}"
    assert len(registry._cache) == CACHE_SIZE
    registry.register("bash", lambda tool, args: "custom")
    assert registry.signature("bash", "cmd1 --flag") == "custom"


def _bash_models(fast_samples: int) -> Models:
    models = get_policy("cachettl").new_models(min_samples=100)
    rng = np.random.default_rng(7)
    slow = [("pytest -x", float(d)) for d in rng.uniform(20.0, 40.0, 150)]
    calls = slow + [("cat setup.py", 0.05)] * fast_samples
    for i in rng.permutation(len(calls)):  # one stationary mix: no drift to forget
        models.record_tool_call("bash", *calls[i])
    tool = models.durations.model(Level.TOOL, "bash")
    assert tool is not None
    assert tool.n_samples == len(calls)
    return models


def test_blended_back_off_lets_a_few_own_samples_count() -> None:
    models = _bash_models(10)  # 10 fast calls: too few for the invocation level alone
    facts = RequestFacts(
        tool="bash", tool_args="cat README.md", reload_cost_s=0.5, queue_delay_s=0.0
    )
    # the plain back-off (no contradiction test): the tool decides
    paper = get_policy("cachettl", contradiction_alpha=0.0).decide(facts, models)
    assert (paper.ttl_s, paper.basis) == (0.0, "tool")  # bash is slow: no pin
    blended = get_policy("cachettl", prior_samples=20.0, contradiction_alpha=0.0).decide(
        facts, models
    )
    assert blended.ttl_s == 0.05
    # n/(n + α) of its own samples plus α/(n + α) of the tool's F(0.05 s) = 10/160
    assert blended.return_probability == pytest.approx(10 / 30 + 20 / 30 * 10 / 160)
    assert blended.basis == "invocation+tool"
    weak = get_policy("cachettl", prior_samples=1000.0, contradiction_alpha=0.0)
    assert weak.decide(facts, models).ttl_s == 0.0  # ten samples do not outweigh the tool
    # By default the ten samples, all 0.05 s against a tool of 20-40 s test runs, clearly
    # contradict the tool: the invocation decides alone.
    own = get_policy("cachettl").decide(facts, models)
    assert (own.ttl_s, own.basis, own.return_probability) == (0.05, "invocation", 1.0)


def _pytest_under_bash(pytest_samples: int, seed: int = 3) -> Models:
    """A tool whose calls take milliseconds (400 ``ls``/``cat``/``grep``, 20 ``find``) and
    one invocation, ``pytest``, of ``pytest_samples`` calls around 9 s."""
    models = get_policy("cachettl").new_models(min_samples=100)
    rng = np.random.default_rng(seed)
    words = ["ls", "cat", "grep"] * 134 + ["find"] * 20
    fast = rng.lognormal(-3.0, 0.5, 420)
    calls = [(f"{w} x", float(d)) for w, d in zip(words, fast, strict=False)]
    slow = rng.lognormal(math.log(9.0), 0.3, pytest_samples)
    calls += [("pytest -x", float(d)) for d in slow]
    for i in rng.permutation(len(calls)):
        models.record_tool_call("bash", *calls[i])
    return models


def test_an_invocation_whose_samples_contradict_its_tool_does_not_get_its_ttl() -> None:
    # The demo's case: pytest with 39 samples (p50 9 s), below K = 100, under bash whose
    # TTL is a fraction of a second. Its own samples decide: pinning for ~9 s pays when a
    # re-prefill costs 20 s; bash's TTL would miss almost every return.
    models = _pytest_under_bash(39)
    facts = RequestFacts(tool="bash", tool_args="pytest tests", reload_cost_s=20.0)
    plain = get_policy("cachettl", contradiction_alpha=0.0).decide(facts, models)
    assert plain.basis == "tool"
    assert plain.ttl_s < 1.0
    own = get_policy("cachettl").decide(facts, models)
    assert own.basis == "invocation"
    pytest_model = models.durations.model(Level.INVOCATION, "bash", "pytest tests")
    assert pytest_model is not None
    assert own.ttl_s >= pytest_model.quantile(0.5)
    # A thin invocation alike its tool (20 fast `find`s) keeps backing off to the tool.
    find = RequestFacts(tool="bash", tool_args="find .", reload_cost_s=20.0)
    assert get_policy("cachettl").decide(find, models).basis == "tool"


def test_too_few_samples_cannot_contradict_their_tool() -> None:
    models = _pytest_under_bash(MIN_CONTRADICTING_SAMPLES - 1)
    facts = RequestFacts(tool="bash", tool_args="pytest tests", reload_cost_s=20.0)
    assert get_policy("cachettl").decide(facts, models).basis == "tool"
    with pytest.raises(ValueError, match="contradiction_alpha must be < 1"):
        get_policy("cachettl", contradiction_alpha=1.0)


def test_blending_changes_nothing_once_a_level_has_enough_samples() -> None:
    models = _bash_models(101)
    facts = RequestFacts(
        tool="bash", tool_args="cat README.md", reload_cost_s=0.5, queue_delay_s=0.0
    )
    paper = get_policy("cachettl").decide(facts, models)
    blended = get_policy("cachettl", prior_samples=20.0).decide(facts, models)
    assert paper == blended
    assert paper.basis == "invocation"


def test_blending_with_the_cold_start_law() -> None:
    models = get_policy("cachettl").new_models(min_samples=100)
    for _ in range(5):
        models.record_tool_call("bash", "make", 3.0)
    facts = RequestFacts(tool="bash", tool_args="make all", reload_cost_s=10.0, queue_delay_s=0.0)
    cold = get_policy("cachettl").decide(facts, models)
    assert cold.basis == "cold-start"
    assert cold.ttl_s == pytest.approx(math.log(10.0))  # Exp(1 s): 2.30 s, misses 3 s
    blended = get_policy("cachettl", prior_samples=5.0).decide(facts, models)
    assert blended.basis == "invocation+tool+all-tools+cold-start"
    assert blended.ttl_s == 3.0
    assert blended.return_probability == pytest.approx(1 - (5 / 10) ** 3 * math.exp(-3.0))
    with pytest.raises(ValueError, match="prior_samples must be >= 0"):
        get_policy("cachettl", prior_samples=-1.0)
