"""Drawing agent programs from a workload's description (turn counts, tokens, tool calls).

Shared by the paper-shaped workloads (simulator/workloads.py) and the generalisation
families (simulator/families.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.trace import Program, Turn

__all__ = ["CONTEXT_WINDOW", "Invocation", "WorkloadSpec", "draw_program"]

CONTEXT_WINDOW = 131_072


@dataclass(frozen=True, slots=True)
class Invocation:
    """One kind of tool call: its share, argument templates, duration and output size.

    Durations are log-normal (``median_s``, ``sigma``), clipped at ``max_s``; output sizes
    are log-normal around ``output_tokens`` (relative weights, rescaled per program).
    """

    tool: str
    args: tuple[str, ...]
    weight: float
    median_s: float
    sigma: float
    output_tokens: float
    max_s: float = 600.0

    def duration(self, rng: random.Random) -> float:
        return min(self.max_s, self.median_s * math.exp(rng.gauss(0.0, self.sigma)))


_FILES = (
    "django/db/models/query.py",
    "sympy/core/expr.py",
    "astropy/io/fits/card.py",
    "sklearn/utils/validation.py",
    "requests/models.py",
    "xarray/core/dataset.py",
)
_TESTS = ("tests/test_query.py", "sympy/core/tests/test_expr.py", "tests/test_card.py")

_WORDS = ("parse", "validate", "to_dict", "resolve", "__repr__", "filter", "Card", "unit")
_DIRS = ("src", "lib", "core", "utils", "models", "io")


def _fill(template: str, rng: random.Random) -> str:
    a = rng.randrange(1, 400)
    return template.format(
        w=rng.choice(_WORDS),
        d=rng.choice(_DIRS),
        f=rng.choice(_FILES),
        t=rng.choice(_TESTS),
        a=a,
        b=a + rng.randrange(20, 120),
    )


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A workload: turn count, tokens per program, first-turn input, outputs and tools."""

    name: str
    description: str
    turns_mean: float
    turns_std: float
    min_turns: int
    tokens_mean: float
    tokens_std: float
    first_input_tokens: float
    output_tokens: float
    invocations: tuple[Invocation, ...]
    default_rate: float
    lognormal_tokens: bool = False

    def draw_total_tokens(self, rng: random.Random) -> float:
        if self.lognormal_tokens:
            sigma2 = math.log(1.0 + (self.tokens_std / self.tokens_mean) ** 2)
            mu = math.log(self.tokens_mean) - sigma2 / 2.0
            total = math.exp(rng.gauss(mu, math.sqrt(sigma2)))
        else:
            total = rng.gauss(self.tokens_mean, self.tokens_std)
        return min(max(total, self.tokens_mean / 5.0), CONTEXT_WINDOW - 1024)


def _pick(invocations: Sequence[Invocation], rng: random.Random) -> Invocation:
    return rng.choices(invocations, weights=[i.weight for i in invocations])[0]


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return mean * math.exp(rng.gauss(-sigma * sigma / 2.0, sigma))


def draw_program(spec: WorkloadSpec, index: int, rng: random.Random) -> Program:
    n = max(spec.min_turns, round(rng.gauss(spec.turns_mean, spec.turns_std)))
    calls = [_pick(spec.invocations, rng) for _ in range(n - 1)]
    outputs = [max(8, round(_lognormal(rng, spec.output_tokens, 0.5))) for _ in range(n)]
    first = max(256, round(_lognormal(rng, spec.first_input_tokens, 0.3)))
    raw = [_lognormal(rng, c.output_tokens, 0.8) for c in calls]
    budget = spec.draw_total_tokens(rng) - first - sum(outputs)
    scale = max(budget, 16.0 * len(raw)) / max(sum(raw), 1e-9)
    inputs = [first] + [max(16, round(r * scale)) for r in raw]
    turns = []
    for k in range(n):
        if k < n - 1:
            call = calls[k]
            args = _fill(rng.choice(call.args), rng)
            turns.append(Turn(inputs[k], outputs[k], call.tool, args, call.duration(rng)))
        else:
            turns.append(Turn(inputs[k], outputs[k]))
    return Program(f"{spec.name}-{index}", 0.0, tuple(turns))
