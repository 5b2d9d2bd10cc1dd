"""Generalisation workloads: traces of kinds the estimator and the rules were not tuned on.

Every family starts from a base of seven shell invocations with log-normal durations of
different spreads (``base_spec``; SWE-like turn counts and tokens) and changes
one thing about the durations, or, for ``tracelab``, follows published statistics of
coding sessions. Programs keep their arrival order (arrivals are drawn afterwards at the
rate asked for), so "at a point of the run" is a share of the programs.

A family is asked for by name, with its parameters in the policy syntax:
``step(factor=6,at=0.5)``; a parameter left out takes its default, and a default of 0
(``factor``, ``at``) means "drawn per seed". The statistics each follows are in
simulator/README.md ("Generalisation families").

Seeds: :data:`HELD_OUT_SEEDS` are kept for verdicts; nothing is tuned on them. Tuning
uses :data:`TUNING_SEEDS`.

>>> [p.program_id for p in generate_family("step(factor=6)", 2, seed=1)]
['step-0', 'step-1']
>>> parse_family("pareto(alpha=1.5)")
('pareto', {'alpha': 1.5})
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from simulator.drawing import Invocation, WorkloadSpec, draw_program
from simulator.trace import Program, Turn

__all__ = [
    "FAMILIES",
    "HELD_OUT_SEEDS",
    "STEP_FACTORS",
    "TUNING_SEEDS",
    "Family",
    "base_spec",
    "generate_family",
    "is_family",
    "parse_family",
    "study_workloads",
]

#: Seeds of the verdicts (never used to choose a setting).
HELD_OUT_SEEDS: tuple[int, ...] = tuple(range(1000, 1024))
#: Seeds settings are chosen on.
TUNING_SEEDS: tuple[int, ...] = tuple(range(0, 8))
#: The step factors a ``step`` trace draws from when ``factor=0``.
STEP_FACTORS: tuple[float, ...] = (1 / 8, 1 / 4, 1 / 2, 2.0, 4.0, 6.0, 8.0)

Params = dict[str, float]


def base_spec() -> WorkloadSpec:
    """The families' base: seven shell invocations with log-normal durations."""
    invocations = (
        Invocation("bash", ("ls -la {d}",), 0.20, 0.01, 0.5, 1.5),
        Invocation("bash", ("grep -rn '{w}' {d}",), 0.20, 0.05, 0.9, 4.0),
        Invocation("bash", ("python scripts/{w}.py",), 0.15, 0.8, 0.7, 2.0),
        Invocation("bash", ("pytest {t} -x -q",), 0.12, 8.0, 0.6, 6.0),
        Invocation("bash", ("make -C {d}",), 0.08, 20.0, 0.4, 3.0),
        Invocation("bash", ("pip install -e {d}",), 0.10, 5.0, 1.2, 2.0),
        Invocation("bash", ("curl -s https://{d}.org/{w}",), 0.15, 1.0, 1.5, 2.0),
    )
    return WorkloadSpec(
        "base",
        "seven shell invocations, log-normal durations of different spreads",
        10.9,
        2.1,
        2,
        70_126,
        19_732,
        3_500,
        260,
        invocations,
        default_rate=0.05,
    )


def _programs(name: str, n: int, seed: int, spec: WorkloadSpec | None = None) -> list[Program]:
    spec = spec or base_spec()
    rng = random.Random(f"family:{name}:{seed}")
    return [
        dataclasses.replace(draw_program(spec, i, rng), program_id=f"{name}-{i}") for i in range(n)
    ]


def _map_calls(programs: Sequence[Program], change: Callable[[int, Turn], Turn]) -> list[Program]:
    """Programs whose tool turns are ``change(program index, turn)``."""
    return [
        dataclasses.replace(
            p, turns=tuple(change(i, t) if t.tool is not None else t for t in p.turns)
        )
        for i, p in enumerate(programs)
    ]


def _point(params: Params, rng: random.Random) -> float:
    at = params["at"]
    return at if at > 0 else rng.uniform(0.25, 0.75)


def _step(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"step:{seed}")
    factor = params["factor"] or rng.choice(STEP_FACTORS)
    start = round(_point(params, rng) * n)
    return _map_calls(
        _programs("step", n, seed),
        lambda i, t: (
            dataclasses.replace(t, tool_duration_s=t.tool_duration_s * factor) if i >= start else t
        ),
    )


def _drift(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"drift:{seed}")
    factor = params["factor"] or rng.choice((1 / 8, 8.0))
    span = max(n - 1, 1)
    return _map_calls(
        _programs("drift", n, seed),
        lambda i, t: dataclasses.replace(
            t, tool_duration_s=t.tool_duration_s * factor ** (i / span)
        ),
    )


def _new_tool(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"new-tool:{seed}")
    start = round(_point(params, rng) * n)
    median = params["median_s"]

    def change(i: int, t: Turn) -> Turn:
        if i < start or rng.random() >= params["share"]:
            return t
        duration = median * math.exp(rng.gauss(0.0, 0.5))
        return dataclasses.replace(t, tool_args="docker build -t app .", tool_duration_s=duration)

    return _map_calls(_programs("new-tool", n, seed), change)


def _rare(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"rare:{seed}")
    kinds = int(params["kinds"])
    medians = [math.exp(rng.uniform(math.log(0.01), math.log(60.0))) for _ in range(kinds)]
    weights = [1.0 / (k + 1) ** params["zipf"] for k in range(kinds)]

    def change(_i: int, t: Turn) -> Turn:
        if rng.random() >= params["share"]:
            return t
        k = rng.choices(range(kinds), weights=weights)[0]
        duration = min(600.0, medians[k] * math.exp(rng.gauss(0.0, 0.5)))
        return dataclasses.replace(t, tool_args=f"./task_{k}.sh --run", tool_duration_s=duration)

    return _map_calls(_programs("rare", n, seed), change)


_BUILDS = ("make all", "cargo build", "docker build .", "npm ci", "bazel test //...")


def _bimodal(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"bimodal:{seed}")
    hit = [rng.uniform(0.2, 0.9) for _ in _BUILDS]

    def change(_i: int, t: Turn) -> Turn:
        if rng.random() >= params["share"]:
            return t
        k = rng.randrange(len(_BUILDS))
        centre = params["hit_s"] if rng.random() < hit[k] else params["build_s"]
        duration = centre * math.exp(rng.gauss(0.0, 0.3))
        return dataclasses.replace(t, tool_args=_BUILDS[k], tool_duration_s=duration)

    return _map_calls(_programs("bimodal", n, seed), change)


def _pareto_draw(rng: random.Random, median: float, alpha: float, cap: float) -> float:
    scale = median / 2.0 ** (1.0 / alpha)  # a Pareto(α, x_m) has median x_m·2^(1/α)
    return float(min(cap, scale * (1.0 - rng.random()) ** (-1.0 / alpha)))


def _pareto(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"pareto:{seed}")
    spec = base_spec()
    medians = {i.args[0].split()[0]: i.median_s for i in spec.invocations}
    alpha = params["alpha"]
    alphas = {k: alpha or rng.choice((1.1, 1.3, 1.6, 2.0)) for k in medians}

    def change(_i: int, t: Turn) -> Turn:
        key = (t.tool_args or "").split()[0]
        duration = _pareto_draw(rng, medians[key], alphas[key], 600.0)
        return dataclasses.replace(t, tool_duration_s=duration)

    return _map_calls(_programs("pareto", n, seed, spec), change)


#: TraceLab's think time between turns (arXiv 2606.30560): median 1.4 min, P90 20.6 min.
THINK_MEDIAN_S = 84.0
THINK_SIGMA = math.log(20.6 * 60.0 / THINK_MEDIAN_S) / 1.2816
THINK_CAP_S = 3600.0


def _think(rng: random.Random) -> float:
    return min(THINK_CAP_S, THINK_MEDIAN_S * math.exp(rng.gauss(0.0, THINK_SIGMA)))


def _think_time(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"think-time:{seed}")

    def change(_i: int, t: Turn) -> Turn:
        if rng.random() >= params["share"]:
            return t
        return dataclasses.replace(t, tool_duration_s=t.tool_duration_s + _think(rng))

    return _map_calls(_programs("think-time", n, seed), change)


def _tracelab_spec() -> WorkloadSpec:
    invocations = (
        Invocation("read_file", ('{{"path": "{f}"}}',), 0.30, 0.02, 0.6, 6.0),
        Invocation("edit_file", ('{{"path": "{f}", "old": "{w}"}}',), 0.18, 0.05, 0.6, 1.0),
        Invocation("grep", ('{{"pattern": "{w}", "path": "{d}"}}',), 0.17, 0.2, 1.0, 3.0),
        Invocation("bash", ("pytest {t} -x -q",), 0.15, 14.0, 1.0, 5.0, 600.0),
        Invocation("bash", ("npm run build",), 0.08, 45.0, 0.8, 3.0, 600.0),
        Invocation("bash", ("git status",), 0.07, 0.05, 0.5, 1.0),
        Invocation("task", ('{{"subagent": "explore", "goal": "{w}"}}',), 0.05, 90.0, 1.0, 2.0),
    )
    return WorkloadSpec(
        "tracelab",
        "TraceLab-like coding sessions",
        30.0,
        10.0,
        4,
        110_000,
        25_000,
        6_000,
        300,
        invocations,
        default_rate=0.01,
    )


def _tracelab(n: int, seed: int, params: Params) -> list[Program]:
    rng = random.Random(f"tracelab:{seed}")

    def change(_i: int, t: Turn) -> Turn:
        if rng.random() >= params["think_share"]:
            return t
        return dataclasses.replace(t, tool_duration_s=t.tool_duration_s + _think(rng))

    return _map_calls(_programs("tracelab", n, seed, _tracelab_spec()), change)


@dataclass(frozen=True, slots=True)
class Family:
    """A generalisation workload: its builder, parameters (with defaults) and what it is."""

    name: str
    build: Callable[[int, int, Params], list[Program]]
    defaults: Params
    description: str
    default_rate: float = 0.05


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("step", _step, {"factor": 0.0, "at": 0.0}, "every tool ×factor at a point"),
        Family("drift", _drift, {"factor": 0.0}, "every tool drifts geometrically to ×factor"),
        Family(
            "new-tool",
            _new_tool,
            {"at": 0.0, "share": 0.2, "median_s": 15.0},
            "a new tool takes a share of calls from a point on",
        ),
        Family(
            "rare",
            _rare,
            {"kinds": 400.0, "zipf": 1.1, "share": 0.5},
            "a long tail of argument signatures (Zipf over kinds)",
        ),
        Family(
            "bimodal",
            _bimodal,
            {"share": 0.4, "hit_s": 0.5, "build_s": 40.0},
            "build tools: a cache hit or a full build",
        ),
        Family("pareto", _pareto, {"alpha": 0.0}, "Pareto durations (α per tool)"),
        Family(
            "think-time", _think_time, {"share": 0.25}, "think time after a share of tool calls"
        ),
        Family(
            "tracelab",
            _tracelab,
            {"think_share": 0.08},
            "TraceLab-like coding sessions",
            default_rate=0.01,
        ),
    )
}

_SHARES = ("at", "share", "think_share")
_SPEC = re.compile(r"^([a-z-]+)(?:\((.*)\))?$")


def parse_family(text: str) -> tuple[str, Params]:
    """``(name, parameters)`` of ``NAME`` or ``NAME(key=value,...)``; errors name the
    family and the parameter."""
    m = _SPEC.match(text.strip())
    if m is None or m.group(1) not in FAMILIES:
        raise ValueError(f"unknown family {text!r}; valid: {', '.join(FAMILIES)}")
    name, body = m.group(1), m.group(2)
    params: Params = {}
    for part in filter(None, (p.strip() for p in (body or "").split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in FAMILIES[name].defaults:
            valid = ", ".join(FAMILIES[name].defaults)
            raise ValueError(f"family {name}: unknown parameter {key!r}; valid: {valid}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"family {name}: {key} must be a number, got {value!r}") from None
        if not (math.isfinite(number) and number >= 0):
            raise ValueError(f"family {name}: {key} must be a finite number >= 0, got {value}")
        if key in _SHARES and number > 1:
            raise ValueError(f"family {name}: {key} must be in [0, 1], got {value}")
        if key == "kinds" and (number < 1 or number != int(number)):
            raise ValueError(f"family {name}: kinds must be an integer >= 1, got {value}")
        params[key] = number
    return name, params


def generate_family(text: str, programs: int, seed: int = 0) -> list[Program]:
    """``programs`` programs of family ``text`` (``NAME`` or ``NAME(key=value,...)``),
    all arriving at 0 (draw arrivals with :func:`simulator.trace.redraw_arrivals`)."""
    name, params = parse_family(text)
    family = FAMILIES[name]
    return family.build(programs, seed, {**family.defaults, **params})


def study_workloads() -> dict[str, Callable[[int, int], list[Program]]]:
    """Each family under its name, as the study commands take a workload:
    ``(programs, seed) -> trace``."""
    return {name: functools.partial(generate_family, name) for name in FAMILIES}


def is_family(text: str) -> bool:
    """Whether ``text`` names a family (with or without parameters)."""
    m = _SPEC.match(text.strip())
    return m is not None and m.group(1) in FAMILIES
