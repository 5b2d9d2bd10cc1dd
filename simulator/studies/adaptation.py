"""Adaptation after a step change, replayed on the estimator alone (no engine): the second
measurement of ``cachettl bench learning`` (:mod:`simulator.studies.learning`).

One ``bash`` tool with the seven invocations of the families' base (log-normal durations of
different spreads) learns ``--pre`` calls, then every duration is multiplied by
``--factor``. After each later call the ``cachettl`` TTL policy gives a TTL for the call's
signature and for the tool (no signature); it is compared with the TTL the same policy
gives on 20,000 samples of the post-change law (the true optimum), at a benefit B of three
times the post-change mean of that key. The curve is the median relative error over the
replicates after k samples of the key; *samples to adapt* is the first k from which it
stays within 10 %. Learners side by side: cachettl's own (ADWIN forgetting), no
forgetting, River's KSWIN and Page-Hinkley, a CUSUM on log-durations, and a sliding window
of 30 samples; each also with the blended back-off (α = 20).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from estimator import RequestFacts, get_policy
from estimator.cost import CostModel
from estimator.hierarchy import DurationHierarchy
from estimator.models import Models
from estimator.profiles import get_profile
from simulator.families import base_spec
from simulator.studies.study import HARDWARE

__all__ = ["FLOOR", "LEARNERS", "TOLERANCE", "Curve", "adaptation", "markdown_curves"]

#: name -> (DurationHierarchy settings, cachettl policy settings).
LEARNERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "cachettl (ADWIN)": ({}, {}),
    "no forgetting": ({"forget_on_drift": False}, {}),
    "KSWIN": ({"detector": "kswin"}, {}),
    "Page-Hinkley": ({"detector": "page-hinkley"}, {}),
    "CUSUM": ({"detector": "cusum"}, {}),
    "sliding window 30": ({"window": 30, "forget_on_drift": False, "min_samples": 10}, {}),
    "ADWIN + drift prior": ({"drift_prior": 30.0}, {}),
    "ADWIN every sample": ({"detector": "adwin-fast"}, {}),
    "ADWIN every sample + drift prior": ({"detector": "adwin-fast", "drift_prior": 30.0}, {}),
    "CUSUM + drift prior": ({"detector": "cusum", "drift_prior": 30.0}, {}),
    "CUSUM + drift prior K": ({"detector": "cusum", "drift_prior": 100.0}, {}),
}
#: Not a learner: told the change point and the old law's shape, it estimates only the
#: scale of the new law from the key's k new samples (the mean shift of log-durations).
#: No learner can do better on a change of scale, so its error is the floor the others
#: are read against.
FLOOR = "known change (the floor)"
#: Points of the old law the floor's models are built from (quantiles of its window).
FLOOR_POINTS = 200
#: The blended back-off's strength in the ``+ blend`` rows.
BLEND = 20.0
#: Relative error within which a TTL counts as adapted.
TOLERANCE = 0.10
#: Samples of the post-change law the true optimum is computed on.
TRUTH_SAMPLES = 20_000
TOOL = "bash"


@dataclass(frozen=True, slots=True)
class Curve:
    """One learner's adaptation: median relative TTL error after k samples (k = 1, 2 …)."""

    errors: list[float]
    within: list[float]  # share of replicates within the tolerance

    @property
    def samples_to_adapt(self) -> int | None:
        """First k from which the median error stays within the tolerance (None: never)."""
        last_bad = max((k for k, e in enumerate(self.errors) if e > TOLERANCE), default=-1)
        return last_bad + 2 if last_bad + 1 < len(self.errors) else None


def _invocations() -> list[tuple[str, float, float, float]]:
    """(args, weight, median_s, sigma) of the families' base invocations."""
    return [(i.args[0], i.weight, i.median_s, i.sigma) for i in base_spec().invocations]


def _models(hierarchy: dict[str, Any], window: int = 2000) -> Models:
    settings = {"window": window, "min_samples": 100, **hierarchy}
    return Models(DurationHierarchy(**settings), _cost())


_COST: list[CostModel] = []


def _cost() -> CostModel:
    if not _COST:
        _COST.append(CostModel.from_profile(get_profile(HARDWARE)))
    return _COST[0].clone()


def _draw(rng: random.Random, inv: tuple[str, float, float, float], factor: float) -> float:
    return factor * inv[2] * math.exp(rng.gauss(0.0, inv[3]))


def _ttl(policy: Any, models: Models, args: str | None, benefit: float) -> float:
    facts = RequestFacts(tool=TOOL, tool_args=args, reload_cost_s=benefit, queue_delay_s=0.0)
    return float(policy.decide(facts, models).ttl_s)


def _truth(factor: float, policy: Any) -> tuple[dict[str | None, float], dict[str | None, float]]:
    """(benefit, true TTL) per signature's args and for the tool (key None)."""
    rng = random.Random("truth")
    invs = _invocations()
    models = _models({"forget_on_drift": False}, window=TRUTH_SAMPLES)
    sums: dict[str | None, list[float]] = {None: []}
    for _ in range(TRUTH_SAMPLES):
        inv = rng.choices(invs, weights=[i[1] for i in invs])[0]
        d = _draw(rng, inv, factor)
        models.record_tool_call(TOOL, inv[0], d)
        sums.setdefault(inv[0], []).append(d)
        sums[None].append(d)
    benefit = {k: 3.0 * statistics.fmean(v) for k, v in sums.items()}
    return benefit, {k: _ttl(policy, models, k, b) for k, b in benefit.items()}


def _error(ttl: float, true: float) -> float:
    return abs(ttl - true) / true if true > 0 else (0.0 if ttl <= 1e-3 else 1.0)


class _Floor:
    """The floor's TTLs: the old law's quantiles scaled by exp(mean new log − mean old
    log), learned into fresh models (so the same policy decides on them)."""

    def __init__(self) -> None:
        self.old: dict[str | None, list[float]] = {None: []}
        self.new: dict[str | None, list[float]] = {None: []}

    def learn(self, args: str, duration: float, changed: bool) -> None:
        side = self.new if changed else self.old
        side.setdefault(args, []).append(math.log(duration))
        side[None].append(math.log(duration))

    def ttl(self, policy: Any, args: str | None, benefit: float) -> float:
        old = sorted(self.old[args])
        shift = statistics.fmean(self.new[args]) - statistics.fmean(old)
        models = _models({"forget_on_drift": False}, window=FLOOR_POINTS)
        for i in range(FLOOR_POINTS):
            log = old[min(len(old) - 1, int((i + 0.5) / FLOOR_POINTS * len(old)))]
            models.record_tool_call(TOOL, args, math.exp(log + shift))
        return _ttl(policy, models, args, benefit)


def _replicate(
    learner: str, blend: bool, factor: float, pre: int, horizon: int, seed: int, truth: Any
) -> dict[str | None, list[float]]:
    if learner == FLOOR:
        return _floor(factor, pre, horizon, seed, truth)
    hierarchy, params = LEARNERS[learner]
    policy = get_policy("cachettl", **{**params, "prior_samples": BLEND if blend else 0.0})
    benefit, true = truth
    rng = random.Random(f"adapt:{seed}")
    invs = _invocations()
    weights = [i[1] for i in invs]
    models = _models(hierarchy)
    for _ in range(pre):
        inv = rng.choices(invs, weights=weights)[0]
        models.record_tool_call(TOOL, inv[0], _draw(rng, inv, 1.0))
    errors: dict[str | None, list[float]] = {None: []}
    while len(errors) <= len(invs) or any(len(e) < horizon for e in errors.values()):
        inv = rng.choices(invs, weights=weights)[0]
        models.record_tool_call(TOOL, inv[0], _draw(rng, inv, factor))
        own = errors.setdefault(inv[0], [])
        if len(own) < horizon:
            own.append(_error(_ttl(policy, models, inv[0], benefit[inv[0]]), true[inv[0]]))
        if len(errors[None]) < horizon:
            errors[None].append(_error(_ttl(policy, models, None, benefit[None]), true[None]))
    return errors


def _floor(
    factor: float, pre: int, horizon: int, seed: int, truth: Any
) -> dict[str | None, list[float]]:
    """:func:`_replicate`'s draws (the same seed), decided by :class:`_Floor`."""
    policy = get_policy("cachettl")
    benefit, true = truth
    rng = random.Random(f"adapt:{seed}")
    invs = _invocations()
    weights = [i[1] for i in invs]
    floor = _Floor()
    for _ in range(pre):
        inv = rng.choices(invs, weights=weights)[0]
        floor.learn(inv[0], _draw(rng, inv, 1.0), changed=False)
    errors: dict[str | None, list[float]] = {None: []}
    while len(errors) <= len(invs) or any(len(e) < horizon for e in errors.values()):
        inv = rng.choices(invs, weights=weights)[0]
        floor.learn(inv[0], _draw(rng, inv, factor), changed=True)
        own = errors.setdefault(inv[0], [])
        if len(own) < horizon:
            own.append(_error(floor.ttl(policy, inv[0], benefit[inv[0]]), true[inv[0]]))
        if len(errors[None]) < horizon:
            errors[None].append(_error(floor.ttl(policy, None, benefit[None]), true[None]))
    return errors


def adaptation(
    factor: float, pre: int, horizon: int, replicates: int, learners: Sequence[str]
) -> dict[str, dict[str, Curve]]:
    """learner label -> key (signature args, or ``"tool"``) -> its :class:`Curve`."""
    truth = _truth(factor, get_policy("cachettl"))
    out: dict[str, dict[str, Curve]] = {}
    for learner in learners:
        for blend in (False,) if learner == FLOOR else (False, True):
            runs = [
                _replicate(learner, blend, factor, pre, horizon, r, truth)
                for r in range(replicates)
            ]
            curves = {}
            for key in runs[0]:
                rows = [run[key] for run in runs if len(run.get(key, [])) == horizon]
                columns = list(zip(*rows, strict=True))
                curves["tool" if key is None else key] = Curve(
                    [statistics.median(c) for c in columns],
                    [sum(e <= TOLERANCE for e in c) / len(c) for c in columns],
                )
            label = f"{learner} + blend" if blend else learner
            out[label] = curves
            print(f"adaptation {label}: {_adapt_text(curves['tool'])} (tool)", file=sys.stderr)
    return out


def _adapt_text(curve: Curve) -> str:
    k = curve.samples_to_adapt
    return f"> {len(curve.errors)}" if k is None else str(k)


def markdown_curves(args: argparse.Namespace, curves: dict[str, dict[str, Curve]]) -> list[str]:
    keys = list(next(iter(curves.values())))
    lines = [
        f"## Adaptation after a ×{args.factor:g} step change",
        "",
        f"{args.pre} calls before the change, {args.replicates} replicates; samples of the "
        f"key until the median TTL error stays within {TOLERANCE:.0%} of the post-change "
        f"optimum (> {args.horizon}: not within the horizon).",
        "",
        "| learner | " + " | ".join(f"`{k}`" for k in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for label, by_key in curves.items():
        lines.append(f"| {label} | " + " | ".join(_adapt_text(by_key[k]) for k in keys) + " |")
    marks = [k for k in (1, 5, 10, 20, 30, 45, 60) if k <= args.horizon]
    for key in keys:
        lines += [
            "",
            f"Median relative TTL error of `{key}` after k samples:",
            "",
            "| learner | " + " | ".join(f"k={k}" for k in marks) + " |",
            "|---|" + "---|" * len(marks),
        ]
        for label, by_key in curves.items():
            errs = by_key[key].errors
            lines.append(f"| {label} | " + " | ".join(f"{errs[k - 1]:.2f}" for k in marks) + " |")
    return [*lines, ""]
