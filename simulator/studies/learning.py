"""``cachettl bench learning``: how the estimator learns on workloads it was not tuned on.

Two measurements in one run:

* **Families** (simulator/families.py): per family, mean JCT / P99 / first-turn wait P90
  of ``cachettl``, ``oracle`` (true durations), ``vllm`` and the peers at the load where
  vLLM's mean slowdown reaches 3 (and at the other ``--loads``), averaged over the seeds,
  with each policy's mean JCT over the oracle's.
* **Adaptation after a step change**, replayed on the estimator alone (no engine): one
  ``bash`` tool with the seven invocations of the families' base (log-normal durations of
  different spreads) learns ``--pre`` calls, then every duration is multiplied by
  ``--factor``. After each later call the ``cachettl`` TTL policy gives a TTL for the
  call's signature and for the tool (no signature); it is compared with the TTL the same
  policy gives on 20,000 samples of the post-change law (the true optimum), at a benefit
  B of three times the post-change mean of that key. The curve is the median relative
  error over the replicates after k samples of the key; *samples to adapt* is the first
  k from which it stays within 10 %. Learners side by side: cachettl's own (ADWIN
  forgetting), no forgetting, River's KSWIN and Page-Hinkley, a CUSUM on log-durations,
  and a sliding window of 30 samples; each also with the blended back-off (α = 20).

Writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
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
from simulator.families import FAMILIES, base_spec
from simulator.studies.seeds import parse_seeds
from simulator.studies.study import HARDWARE, PEERS, Study, output_path

__all__ = ["LEARNERS", "Curve", "adaptation", "register"]

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


#: Policies of the families' table besides the peers (``oracle`` is the reference).
TABLE = ("cachettl", "oracle", "vllm", "continuum", "continuum-preview", *PEERS)


def families_table(
    families: Sequence[str], loads: Sequence[float], programs: int, seeds: Sequence[int]
) -> dict[str, Any]:
    """family -> {rate, target, loads, rows: spec -> per load [mean JCT, P99, wait P90]}.
    Where think time dominates a program's time vLLM's slowdown may never reach 3: the
    reference load is then where it reaches the first of :data:`TARGETS` it does."""
    out: dict[str, Any] = {}
    for family in families:
        study, rate = _reference(family, programs, seeds)
        rows: dict[str, list[list[float]]] = {spec: [] for spec in TABLE}
        for factor in loads:
            measured = study.measure(family, rate * factor, TABLE)
            for spec in TABLE:
                rows[spec].append(measured[spec])
        out[family] = {
            "rate_slowdown_3": rate,
            "target": study.target,
            "loads": list(loads),
            "rows": rows,
        }
        ratio = rows["cachettl"][0][0] / rows["oracle"][0][0]
        print(f"{family}: cachettl / oracle {ratio:.3f} at load {loads[0]:g}", file=sys.stderr)
    return out


#: vLLM mean slowdowns a family's reference load is sought at, in turn.
TARGETS = (3.0, 2.0, 1.5)


def _reference(family: str, programs: int, seeds: Sequence[int]) -> tuple[Study, float]:
    for target in TARGETS:
        study = Study(programs, seeds, target=target)
        try:
            return study, study.rate(family)
        except ValueError:
            print(f"{family}: vLLM never reaches slowdown {target:g}", file=sys.stderr)
    raise ValueError(f"{family}: vLLM reaches none of the slowdowns {TARGETS}")


def register(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench learning``."""
    parser = bench.add_parser(
        "learning", help="families: cachettl against the oracle; adaptation after a step change"
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--loads", default="1,1.2", help="multiples of vLLM's slowdown-3 load")
    parser.add_argument("--programs", type=int, default=100, help="programs per run")
    parser.add_argument("--seeds", default="1000-1003", help="integers and ranges a-b")
    parser.add_argument("--factor", type=float, default=6.0, help="the step change's factor")
    parser.add_argument("--pre", type=int, default=2000, help="calls learned before the change")
    parser.add_argument("--horizon", type=int, default=60, help="samples per key after it")
    parser.add_argument("--replicates", type=int, default=16, help="runs of the adaptation")
    every = (*LEARNERS, FLOOR)
    parser.add_argument("--learners", default=",".join(every), help=f"of: {', '.join(every)}")
    parser.add_argument("--skip-families", action="store_true", help="only the adaptation")
    parser.add_argument("--out", default="results/learning", help="writes OUT.md/.json")
    parser.set_defaults(handler=_learning)


def _check(args: argparse.Namespace) -> tuple[list[str], list[float], list[str]]:
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"--families: unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        raise ValueError(f"--loads must list numbers, got {args.loads!r}") from None
    if not loads or not all(f > 0 for f in loads):
        raise ValueError(f"--loads must be positive, got {args.loads!r}")
    learners = [x.strip() for x in args.learners.split(",")]
    for learner in learners:
        if learner not in LEARNERS and learner != FLOOR:
            raise ValueError(f"--learners: unknown learner {learner!r}")
    for flag, value in (
        ("--programs", args.programs),
        ("--pre", args.pre),
        ("--horizon", args.horizon),
        ("--replicates", args.replicates),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(args.factor) and args.factor > 0):
        raise ValueError(f"--factor must be a positive number, got {args.factor}")
    return families, loads, learners


def _learning(args: argparse.Namespace) -> int:
    families, loads, learners = _check(args)
    seeds = parse_seeds(args.seeds)
    curves = adaptation(args.factor, args.pre, args.horizon, args.replicates, learners)
    table = {} if args.skip_families else families_table(families, loads, args.programs, seeds)
    command = (
        f"cachettl bench learning --families {','.join(families)} --loads {args.loads} "
        f"--programs {args.programs} --seeds {args.seeds} --factor {args.factor:g} "
        f"--pre {args.pre} --horizon {args.horizon} --replicates {args.replicates}"
        + (" --skip-families" if args.skip_families else "")
    )
    summary = {
        "command": command,
        "seeds": seeds,
        "factor": args.factor,
        "families": table,
        "adaptation": {
            label: {
                key: {
                    "samples_to_adapt": c.samples_to_adapt,
                    "median_error": c.errors,
                    "share_within": c.within,
                }
                for key, c in by_key.items()
            }
            for label, by_key in curves.items()
        },
    }
    md = output_path(args.out, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join([*_markdown_families(command, table), *_markdown_curves(args, curves)]))
    output_path(args.out, ".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {md}")
    return 0


def _markdown_families(command: str, table: dict[str, Any]) -> list[str]:
    lines = [
        "# Learning on workloads nothing was tuned on (generated by `cachettl bench learning`)",
        "",
        f"Command: `{command}`",
        "",
    ]
    if not table:
        return lines
    lines += [
        "## Families: mean JCT over the oracle's",
        "",
        "Each cell: mean JCT / oracle's mean JCT, then mean JCT / P99 / first-turn wait P90 "
        "(s), averaged over the seeds; 8B/H100.",
        "",
    ]
    for family, res in table.items():
        cells = [f"{f:g}× ({res['rate_slowdown_3'] * f:.4f}/s)" for f in res["loads"]]
        note = f" (load: multiples of where vLLM's mean slowdown reaches {res['target']:g})"
        lines += [f"### {family}{note}", "", "| policy | " + " | ".join(cells) + " |"]
        lines.append("|---|" + "---|" * len(cells))
        oracle = res["rows"]["oracle"]
        for spec, per_load in res["rows"].items():
            text = [
                f"{m[0] / o[0]:.3f} · " + " / ".join(f"{v:.1f}" for v in m)
                for m, o in zip(per_load, oracle, strict=True)
            ]
            lines.append(f"| {spec} | " + " | ".join(text) + " |")
        lines.append("")
    return lines


def _markdown_curves(args: argparse.Namespace, curves: dict[str, dict[str, Curve]]) -> list[str]:
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
