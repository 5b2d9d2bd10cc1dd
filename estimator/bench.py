"""Speed and memory of the estimator, printed (``cachettl bench estimator``).

Each figure is the median over ``repeat`` timed batches, with a baseline timed in the same
run so that the ratio, not the absolute time, carries over between machines.
"""

from __future__ import annotations

import gc
import json
import pickle
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from estimator.durations import DurationModel
from estimator.policies import RequestFacts, get_policy
from estimator.ttl import FloatArray, optimal_ttl

__all__ = ["run"]


def _median_us(call: Callable[[], object], repeat: int, number: int) -> float:
    """Median time of one call, in µs, over ``repeat`` batches of ``number`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in range(number):
            call()
        times.append((time.perf_counter_ns() - start) / number / 1e3)
    return statistics.median(times)


def _brute_force_ttl(samples: FloatArray, benefit_s: float) -> float:
    """Reference: score every candidate against every sample (O(n²), vectorised)."""
    candidates = np.concatenate(([0.0], np.unique(samples)))
    cdf = (samples[None, :] <= candidates[:, None]).sum(axis=1) / samples.size
    return float(candidates[int(np.argmax(cdf * benefit_s - candidates))])


def _model_bytes(window: int, samples: FloatArray) -> tuple[int, int]:
    """(traced allocation, pickle size) of one model after learning ``samples``."""
    gc.collect()
    tracemalloc.start()
    model = DurationModel(window=window)
    for x in samples:
        model.update(float(x))
    gc.collect()
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return traced, len(pickle.dumps(model))


#: The control plane's link benchmark's tenant: 6 tools, 11 argument signatures.
_TENANT = [
    ("bash", "ls"), ("bash", "pytest -x"), ("bash", "git status"), ("python", "run.py"),
    ("python", "-c expr"), ("grep", "-rn TODO"), ("grep", "-l import"), ("edit", None),
    ("web_search", None), ("read_file", "README.md"), ("read_file", "setup.py"),
]  # fmt: skip


def _learn_event_us(durations: FloatArray, repeat: int) -> float:
    """µs to learn one tool call of that tenant at every level of the hierarchy (3 or 4
    models), every model read (its TTL search) every 2,500 calls, as a control plane's
    compact snapshots read the models that moved twice a second at 5,000 events/s."""
    models = get_policy("cachettl").new_models()
    calls = [(*_TENANT[i % len(_TENANT)], float(x)) for i, x in enumerate(durations[:50_000])]
    for tool, args, x in calls[:10_000]:
        models.record_tool_call(tool, args, x, "links")
    stream = iter(calls[10_000:])
    count = [0]

    def learn() -> None:
        tool, args, x = next(stream)
        models.record_tool_call(tool, args, x, "links")
        count[0] += 1
        if count[0] % 2500 == 0:
            for _, model in models.durations.items():
                model.best_ttl(2.0)

    return _median_us(learn, max(3, repeat // 2), 2500)


def run(window: int = 2000, repeat: int = 25, seed: int = 0, as_json: bool = False) -> int:
    """Measure and print; returns 0."""
    rng = np.random.default_rng(seed)
    # Log-normal tool durations: median 0.3 s with a heavy tail, like SWE-agent shells.
    durations = rng.lognormal(mean=np.log(0.3), sigma=1.5, size=window * 50)
    model = DurationModel(window=window, forget_on_drift=False)
    for x in durations[:window]:
        model.update(float(x))
    window_samples = model.recent_samples()
    benefit = 2.0

    figures: dict[str, Any] = {"window": window, "python": platform.python_version()}
    figures["optimal_ttl_window_us"] = _median_us(lambda: model.best_ttl(benefit), repeat, 200)
    figures["optimal_ttl_unsorted_us"] = _median_us(
        lambda: optimal_ttl(window_samples, benefit), repeat, 50
    )
    figures["brute_force_us"] = _median_us(
        lambda: _brute_force_ttl(window_samples, benefit), max(3, repeat // 5), 1
    )
    stream = iter(durations[window:].tolist())
    figures["update_us"] = _median_us(lambda: model.update(next(stream)), repeat, 1000)

    policy = get_policy("cachettl")
    models = policy.new_models()
    tools = [("bash", "pytest -x"), ("bash", "ls"), ("bash", "grep -r x"), ("search", "{}")]
    for i, x in enumerate(durations[: 4 * window]):
        tool, args = tools[i % len(tools)]
        models.record_tool_call(tool, args, float(x))
    hit = RequestFacts(tool="bash", tool_args="pytest tests/", context_tokens=20_000)
    # No invocation model for this one: the decision backs off to the tool.
    backoff = RequestFacts(tool="bash", tool_args="make test", context_tokens=20_000)
    figures["decide_invocation_us"] = _median_us(lambda: policy.decide(hit, models), repeat, 200)
    figures["decide_backoff_us"] = _median_us(lambda: policy.decide(backoff, models), repeat, 200)
    for x in durations[:30]:  # a thin invocation: 30 samples, under K = 100
        models.record_tool_call("bash", "make test", float(x))
    blended = get_policy("cachettl", prior_samples=20.0)
    figures["decide_blended_us"] = _median_us(lambda: blended.decide(backoff, models), repeat, 200)

    figures["learn_event_us"] = _learn_event_us(durations, repeat)

    traced, pickled = _model_bytes(window, durations[: 20 * window])
    figures["model_traced_kib"] = traced / 1024
    figures["model_pickle_kib"] = pickled / 1024
    figures["speedup_vs_brute_force"] = figures["brute_force_us"] / figures["optimal_ttl_window_us"]

    if as_json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    else:
        _print(figures, window, repeat)
    return 0


def _print(figures: dict[str, Any], window: int, repeat: int) -> None:
    rows = [
        ("optimal_ttl, sorted window (µs)", figures["optimal_ttl_window_us"], "≤ 20"),
        ("optimal_ttl, unsorted input (µs)", figures["optimal_ttl_unsorted_us"], ""),
        ("brute force O(n²) baseline (µs)", figures["brute_force_us"], ""),
        ("model update (µs)", figures["update_us"], "≤ 5"),
        ("learn a call, every level, reads (µs)", figures["learn_event_us"], ""),
        ("decide, invocation level (µs)", figures["decide_invocation_us"], "≤ 50"),
        ("decide, backed off to tool (µs)", figures["decide_backoff_us"], "≤ 50"),
        ("decide, blended back-off α = 20 (µs)", figures["decide_blended_us"], "≤ 50"),
        ("memory per tool model, traced (KiB)", figures["model_traced_kib"], "≤ 64"),
        ("memory per tool model, pickled (KiB)", figures["model_pickle_kib"], ""),
    ]
    print(f"estimator benchmark: window {window}, median of {repeat} batches")
    for label, value, target in rows:
        print(f"  {label:<40} {value:>10.2f}   {('target ' + target) if target else ''}")
    print(f"  sorted-window search is {figures['speedup_vs_brute_force']:.0f}x the brute force")
