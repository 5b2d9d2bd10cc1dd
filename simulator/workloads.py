"""Synthetic agent workloads shaped like the traces of Continuum (arXiv 2511.02230, Table 2).

No trace of the paper is public, so programs are drawn from distributions fitted to its
published statistics:

* ``swe`` (mini-swe-agent on SWE-bench): 10.9 ± 2.1 turns, tool time 925 ± 3,550 ms,
  70,126 ± 19,732 tokens per program (all inputs and outputs). Every tool call is a bash
  command; ``tool`` is ``"bash"`` and ``tool_args`` the command line, whose first word is
  what the paper keys its statistics by (``cd``, ``grep``, ``pytest`` ...). ``cd`` calls
  are mostly ``cd /testbed && grep ...``-style (milliseconds) with a few
  ``cd /testbed && pytest ...`` runs (tens of seconds): the slowest 10 % of ``cd`` calls
  carry about 94 % of its time, as in the paper's Fig. 5.
* ``bfcl`` (BFCL v4 web search): 6.3 ± 2.3 turns, tool time 1,923 ± 2,133 ms, 93,256 ±
  68,687 tokens per program, capped at the 128k context window of Llama-3.1 (the paper
  scaled this trace down to fit; the cap lowers the mean to about 85k). Tools
  ``web_search`` and ``fetch_url`` with JSON arguments; the slowest 10 % of ``fetch_url``
  calls carry about half its time (paper: 52.5 %).

Token counts per program follow the table; a program's total is spread over its turns in
proportion to per-tool output sizes. ``cachettl bench workloads`` prints the measured
statistics next to the paper's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from simulator.drawing import Invocation, WorkloadSpec, draw_program
from simulator.families import FAMILIES, generate_family, is_family
from simulator.trace import Program, Turn, redraw_arrivals, scale_turns

__all__ = [
    "WORKLOADS",
    "generate",
    "get_workload",
]

SWE_INVOCATIONS: tuple[Invocation, ...] = (
    Invocation(
        "bash",
        ("cd /testbed && grep -rn 'def {w}' {d}", "cd /testbed && grep -n {w} {f}"),
        0.11,
        0.02,
        0.8,
        4.0,
    ),
    Invocation(
        "bash",
        ("cd /testbed && ls {d}", "cd /testbed && find . -name '*{w}*'"),
        0.06,
        0.015,
        0.8,
        1.5,
    ),
    Invocation(
        "bash", ("cd /testbed && git diff", "cd /testbed && git status"), 0.04, 0.02, 0.6, 2.0
    ),
    Invocation("bash", ("cd /testbed && python reproduce_issue.py",), 0.055, 0.35, 0.8, 1.5),
    Invocation("bash", ("cd /testbed && python -m pytest {t} -x -q",), 0.030, 13.0, 0.6, 6.0, 90.0),
    Invocation("bash", ("cat {f}", "cat -n {f} | head -200"), 0.12, 0.008, 0.6, 8.0),
    Invocation("bash", ("sed -n '{a},{b}p' {f}", "sed -i 's/{w}/{w}_/' {f}"), 0.16, 0.01, 0.6, 3.0),
    Invocation("bash", ("grep -rn '{w}' {d}", "grep -n '{w}' {f}"), 0.10, 0.03, 0.9, 4.0),
    Invocation(
        "bash", ("python reproduce_issue.py", "python -c 'import {w}'"), 0.13, 0.6, 0.9, 2.0
    ),
    Invocation("bash", ("ls -la {d}", "find {d} -name '*.py'"), 0.10, 0.01, 0.6, 1.5),
    Invocation("bash", ("pytest {t} -x -q",), 0.025, 7.0, 0.8, 6.0),
    Invocation("bash", ("git diff {f}",), 0.03, 0.02, 0.5, 2.0),
)

BFCL_INVOCATIONS: tuple[Invocation, ...] = (
    Invocation("web_search", ('{{"query": "{w} {d}", "max_results": 5}}',), 0.42, 1.3, 0.45, 0.6),
    Invocation(
        "fetch_url",
        (
            '{{"url": "https://{d}.org/{w}", "mode": "markdown"}}',
            '{{"url": "https://{d}.com/wiki/{w}", "mode": "raw"}}',
        ),
        0.58,
        1.2,
        1.2,
        1.6,
        15.0,
    ),
)

WORKLOADS: dict[str, WorkloadSpec] = {
    "swe": WorkloadSpec(
        "swe",
        "SWE-bench-shaped (mini-swe-agent, bash tools)",
        10.9,
        2.1,
        2,
        70_126,
        19_732,
        3_500,
        260,
        SWE_INVOCATIONS,
        default_rate=0.05,
    ),
    "bfcl": WorkloadSpec(
        "bfcl",
        "BFCL-v4-web-search-shaped (web_search, fetch_url)",
        6.3,
        2.3,
        2,
        93_256,
        68_687,
        2_500,
        180,
        BFCL_INVOCATIONS,
        default_rate=0.06,
        lognormal_tokens=True,
    ),
}


def get_workload(name: str) -> WorkloadSpec:
    """The workload called ``name``; the error lists the valid names."""
    try:
        return WORKLOADS[name]
    except KeyError:
        valid = ", ".join([*sorted(WORKLOADS), *FAMILIES])
        raise ValueError(f"unknown workload {name!r}; valid: {valid}") from None


def generate(
    name: str,
    programs: int,
    rate: float | None = None,
    seed: int = 0,
    turn_scale: int = 1,
) -> list[Program]:
    """``programs`` programs of workload ``name`` with Poisson arrivals at ``rate``/s.
    ``name`` may also be a generalisation family, ``NAME`` or ``NAME(key=value,...)``
    (simulator/families.py).

    >>> ps = generate("swe", 3, rate=0.1, seed=1)
    >>> [p.program_id for p in ps], ps[0].turns[0].tool
    (['swe-0', 'swe-1', 'swe-2'], 'bash')
    """
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be an integer >= 1, got {programs!r}")
    if is_family(name):
        drawn = generate_family(name, programs, seed)
        default_rate = FAMILIES[name.split("(")[0].strip()].default_rate
    else:
        spec = get_workload(name)
        rng = random.Random(f"{name}:programs:{seed}")
        drawn = [draw_program(spec, i, rng) for i in range(programs)]
        default_rate = spec.default_rate
    drawn = [scale_turns(p, turn_scale) for p in drawn]
    return redraw_arrivals(drawn, default_rate if rate is None else rate, seed)


def stats(programs: Sequence[Program], first_word: Callable[[Turn], str]) -> dict[str, float]:
    """Table-2 statistics of a trace plus the tail share of the slowest 10 % of calls of
    each tool key (``first_word`` maps a turn to its key)."""
    turns = [len(p.turns) for p in programs]
    tokens = [p.total_tokens for p in programs]
    calls = [t for p in programs for t in p.turns if t.tool is not None]
    times = [t.tool_duration_s * 1000.0 for t in calls]
    out = {
        "programs": float(len(programs)),
        "turns_mean": _mean(turns),
        "turns_std": _std(turns),
        "tool_ms_mean": _mean(times),
        "tool_ms_std": _std(times),
        "tokens_mean": _mean(tokens),
        "tokens_std": _std(tokens),
    }
    by_key: dict[str, list[float]] = {}
    for t in calls:
        by_key.setdefault(first_word(t), []).append(t.tool_duration_s)
    for key, values in sorted(by_key.items()):
        values.sort(reverse=True)
        top = values[: max(1, len(values) // 10)]
        out[f"top10_share:{key}"] = math.fsum(top) / max(math.fsum(values), 1e-12)
        out[f"share_of_calls:{key}"] = len(values) / len(calls)
    return out


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs)) if xs else 0.0
