"""``oracle-law``: ``cachettl`` with perfect statistics, the bound of any learner.

The ``oracle`` knows each call's own duration, which no estimator can: its gap to
``cachettl`` mixes two things, what learning loses (lag after a change, thin samples, a
wrong back-off level) and what not knowing the draw loses (a log-normal call with σ = 1.5
may come back in 0.1 s or in 20 s). ``oracle-law`` separates them. It decides exactly as
``cachettl`` does (its rules, benefit, load-aware price, cap and slack) but takes F, the
distribution of the call's duration, from the trace: the durations of the
:data:`LAW_SAMPLES` calls of the same signature nearest in arrival order, before and
after it (the call itself left out; a call the trace does not hold: all of its
signature's calls). That is the law the call was drawn from, up to a
window's width around a step change, known without lag and from the first call on. A
learner can at best match it, so ``cachettl`` over ``oracle-law`` is what learning loses,
and ``oracle-law`` over ``oracle`` what only knowing the future would win.

>>> from simulator.trace import Program, Turn
>>> turns = tuple(Turn(100, 10, "bash", f"ls {i}", float(i)) for i in range(5))
>>> law = TraceLaw([Program("p", 0.0, (*turns, Turn(10, 10)))], window=2)
>>> law.of("p", "bash", "ls 2", 2.0).tolist()
[1.0, 3.0]
>>> law.of("p", "bash", "ls 0", 0.0).tolist()
[1.0, 2.0]
>>> law.of("q", "bash", "ls 9", 9.0).tolist(), law.of("q", "curl", "x", 1.0)
([0.0, 1.0, 2.0, 3.0, 4.0], None)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from enginehook.core.host import FinishedTurn
from estimator import Decision, RequestFacts, SignatureRegistry
from estimator.policies import CachettlPolicy
from estimator.ttl import FloatArray, best_ttl_sorted
from simulator.policies.base import Param, register_scheduling_policy
from simulator.policies.cachettl import Cachettl
from simulator.policies.pinning import count
from simulator.trace import Program

__all__ = ["LAW_SAMPLES", "OracleLaw", "TraceLaw"]

#: Calls of a signature that stand for the law of one call (half before it, half after).
LAW_SAMPLES = 200


class TraceLaw:
    """Per call of a trace, the durations of the ``window`` calls of its signature
    nearest to it in arrival order (programs by arrival, then turn)."""

    def __init__(self, programs: Sequence[Program], window: int = LAW_SAMPLES) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self._signatures = signatures = SignatureRegistry()
        by_key: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._where: dict[tuple[str, str | None, float], tuple[tuple[str, str], int]] = {}
        for program in sorted(programs, key=lambda p: (p.arrival_s, p.program_id)):
            for turn in program.turns:
                if turn.tool is None:
                    continue
                key = (turn.tool, signatures.compute(turn.tool, turn.tool_args))
                where = (program.program_id, turn.tool_args, turn.tool_duration_s)
                self._where[where] = (key, len(by_key[key]))
                by_key[key].append(turn.tool_duration_s)
        self._durations = {key: np.asarray(values) for key, values in by_key.items()}
        self._window = window

    def of(
        self, program_id: str, tool: str, args: str | None, duration_s: float
    ) -> FloatArray | None:
        """The sorted law of one call, named by its program and its true duration; a call
        the trace does not hold gets all of its signature's calls; None for a signature
        the trace never calls."""
        where = self._where.get((program_id, args, duration_s))
        if where is None:
            values = self._durations.get((tool, self._signatures.compute(tool, args)))
            return None if values is None else np.sort(values)
        key, index = where
        values = self._durations[key]
        n = values.shape[0]
        half = self._window // 2
        start = max(0, min(index - half, n - self._window - 1))
        stop = min(n, start + self._window + 1)
        return np.sort(np.delete(values[start:stop], index - start))


@register_scheduling_policy
class OracleLaw(Cachettl):
    """``cachettl`` deciding on the law of each call's duration, read from the trace."""

    name = "oracle-law"
    help = "cachettl on each call's duration law (its signature's nearest calls), not its draw"
    PARAMS: ClassVar[dict[str, Param]] = {
        **Cachettl.PARAMS,
        "law_samples": Param(count, LAW_SAMPLES, "calls of a signature that make a call's law"),
    }
    law_samples: int

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._law: TraceLaw | None = None

    def see_trace(self, programs: Sequence[Program]) -> None:
        # An engine given no trace (a cluster's) has no law: deciding there is an error.
        self._law = TraceLaw(programs, max(1, self.law_samples)) if programs else None

    def choose(self, facts: RequestFacts, turn: FinishedTurn) -> Decision:
        assert self.models is not None
        if self._law is None or turn.tool is None or turn.true_duration_s is None:
            raise ValueError("oracle-law decides only in a simulation that gave it its trace")
        law = self._law.of(turn.program_id, turn.tool, turn.tool_args, turn.true_duration_s)
        if law is None:  # a tool the trace never calls: what cachettl would learn
            return super().choose(facts, turn)
        facts = self.with_switches(facts)
        policy = self._ttl
        assert isinstance(policy, CachettlPolicy)
        benefit = policy.benefit_s(facts, self.models)
        pressure = policy.pressure(facts)
        ttl, probability = best_ttl_sorted(law, benefit / pressure, policy.ttl_cap_s)
        if policy.ttl_slack > 1.0 and ttl > 0.0:
            ttl = min(ttl * policy.ttl_slack, policy.ttl_cap_s)
            probability = int(np.searchsorted(law, ttl, side="right")) / law.shape[0]
        expected = probability * benefit - pressure * ttl if ttl > 0 else 0.0
        return Decision(ttl, probability, expected, self.name, benefit)
