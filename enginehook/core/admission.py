"""Program-level admission: ThunderAgent's capacity scheduler, for any engine.

ThunderAgent (arXiv 2602.13692; ThunderAgent-org/ThunderAgent, ``wiki/Scheduler.md`` and
``ThunderAgent/scheduler/router.py``) admits whole programs so that the KV cache of every
admitted program fits in memory. Each program is ``REASONING`` (a request on the engine),
``ACTING`` (running a tool) or paused (held in a global queue). With ``T`` the KV tokens of a
program (its context after its last request; for a request not yet served, its prompt)::

    used = Σ T(reasoning) + w · Σ T(acting) − shared + 100 · (active programs)

(``w``: ``acting_token_weight``, default 1.0; ``shared``: prefix tokens programs share, 0 here
because no two programs share a prefix in our traces; 100: ``BUFFER_PER_PROGRAM``). The
engine is over capacity when ``used`` exceeds its KV pool. Every ``interval_s`` (5 s):

1. Resume paused programs by best-fit-decreasing: candidates in priority order (programs
   with a request waiting and step > 1, then new programs, then programs still in their
   tool) are taken while their tokens (+100 each) fit the free capacity; those are resumed
   largest first while each still fits (one engine: the bin is the pool).
2. While over capacity, pause: ``ACTING`` programs smallest first (their next request will
   wait), then mark ``REASONING`` programs smallest first (paused when their request ends;
   their tokens count as freed already, ``future_paused_tokens``).

A new program is admitted at once only if nothing is paused and its tokens (+100) fit;
otherwise it joins the paused queue. A program paused for 30 minutes is resumed regardless
of capacity. It never pins: a paused program's KV goes the engine's usual way (freed into
the prefix cache when its request ended).

Differences from the proxy, all because one engine is simulated exactly: token counts are
the engine's own (the proxy estimates a prompt from its characters, 5 per token to start);
there is one backend, so best fit is the pool itself.

>>> a = ProgramAdmission(capacity_tokens=1_000)
>>> a.arrived("p", 500, now=0.0), a.arrived("q", 450, now=0.0)
(True, False)
>>> a.acting("p", 520, now=1.0)
>>> a.ended("p")
>>> a.tick(5.0)
['q']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "BUFFER_PER_PROGRAM",
    "FORCE_RESUME_S",
    "INTERVAL_S",
    "ProgramAdmission",
]

#: Tokens reserved per active program for decoding (ThunderAgent's ``BUFFER_PER_PROGRAM``).
BUFFER_PER_PROGRAM = 100
#: ThunderAgent's ``--scheduler-interval`` default, seconds.
INTERVAL_S = 5.0
#: A program paused this long is resumed regardless of capacity (``_wait_for_resume``).
FORCE_RESUME_S = 1800.0


class _Status(Enum):
    REASONING = "reasoning"
    ACTING = "acting"


@dataclass(slots=True)
class _Program:
    tokens: int
    status: _Status
    steps: int = 1
    paused: bool = False
    paused_at: float = 0.0
    marked: bool = False


class ProgramAdmission:
    """Which programs may send requests to the engine now (see the module docstring).

    The host tells it when a program's request arrives (:meth:`arrived`), finishes
    (:meth:`acting`) and when the program ends (:meth:`ended`), and calls :meth:`tick`
    at least every ``interval_s``; :meth:`held` says whether a program's waiting request
    must stay out of the engine.
    """

    def __init__(
        self,
        capacity_tokens: int,
        interval_s: float = INTERVAL_S,
        acting_token_weight: float = 1.0,
    ) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        if not interval_s > 0 or math.isinf(interval_s):
            raise ValueError(f"interval_s must be a finite number > 0, got {interval_s}")
        self.capacity_tokens = capacity_tokens
        self.interval_s = interval_s
        self.acting_token_weight = acting_token_weight
        self._programs: dict[str, _Program] = {}
        #: Paused programs in the order they were paused (ThunderAgent's global queue).
        self._paused: dict[str, None] = {}
        self._next_tick = 0.0
        self.pauses = 0
        self.resumes = 0

    # -- capacity ----------------------------------------------------------------------
    def used_tokens(self) -> float:
        """ThunderAgent's ``capacity_used`` of the active programs, less the tokens of
        programs marked for pause."""
        used = 0.0
        for program in self._programs.values():
            if program.paused:
                continue
            weight = 1.0 if program.status is _Status.REASONING else self.acting_token_weight
            used += weight * program.tokens + BUFFER_PER_PROGRAM
            if program.marked:
                used -= program.tokens
        return used

    def remaining(self) -> float:
        return self.capacity_tokens - self.used_tokens()

    # -- what the host tells ---------------------------------------------------------
    def arrived(self, program_id: str, tokens: int, now: float) -> bool:
        """A request of the program arrived (``tokens``: its prompt). Returns whether it
        may go to the engine now."""
        program = self._programs.get(program_id)
        if program is None:
            fits = not self._paused and self.remaining() >= tokens + BUFFER_PER_PROGRAM
            program = self._programs[program_id] = _Program(tokens, _Status.REASONING)
            if not fits:
                self._pause(program_id, program, now)
            return fits
        program.steps += 1
        program.tokens = tokens
        program.status = _Status.REASONING
        return not program.paused

    def acting(self, program_id: str, tokens: int, now: float) -> None:
        """The program's request finished with ``tokens`` of context (now in its tool)."""
        program = self._programs.get(program_id)
        if program is None:
            return
        program.tokens = tokens
        program.status = _Status.ACTING
        if program.marked:
            program.marked = False
            self._pause(program_id, program, now)

    def ended(self, program_id: str) -> None:
        """The program ended (or was forgotten)."""
        self._programs.pop(program_id, None)
        self._paused.pop(program_id, None)

    def held(self, program_id: str | None) -> bool:
        """Whether the program is paused (its requests must not be admitted)."""
        if program_id is None:
            return False
        program = self._programs.get(program_id)
        return program is not None and program.paused

    def paused_count(self) -> int:
        return len(self._paused)

    # -- the periodic scheduler -------------------------------------------------------
    def due(self, now: float) -> bool:
        return now >= self._next_tick

    def next_tick(self) -> float:
        """When the next periodic check runs."""
        return self._next_tick

    def tick(self, now: float) -> list[str]:
        """Run the periodic check if it is due (force-resume, best-fit-decreasing resume,
        pause until within capacity). Returns the programs resumed."""
        if now < self._next_tick:
            return []
        self._next_tick = now + self.interval_s
        resumed = self._force_resume(now)
        resumed += self._resume()
        self._pause_until_safe(now)
        return resumed

    def _force_resume(self, now: float) -> list[str]:
        late = [
            pid for pid in self._paused if now - self._programs[pid].paused_at >= FORCE_RESUME_S
        ]
        for pid in late:
            self._resume_one(pid)
        return late

    def _resume(self) -> list[str]:
        free = self.remaining()
        if free <= BUFFER_PER_PROGRAM or not self._paused:
            return []
        paused = sorted(self._paused, key=lambda pid: self._programs[pid].tokens)

        def group(pid: str) -> int:
            program = self._programs[pid]
            if program.steps == 1:
                return 1
            return 0 if program.status is _Status.REASONING else 2

        chosen: list[str] = []
        total = 0
        for pid in sorted(paused, key=group):  # stable: ascending tokens within a group
            need = self._programs[pid].tokens + BUFFER_PER_PROGRAM
            if total + need <= free:
                chosen.append(pid)
                total += need
        resumed = []
        for pid in sorted(chosen, key=lambda p: -self._programs[p].tokens):
            need = self._programs[pid].tokens + BUFFER_PER_PROGRAM
            if need > free:
                continue
            self._resume_one(pid)
            resumed.append(pid)
            free -= need
            if free <= BUFFER_PER_PROGRAM:
                break
        return resumed

    def _pause_until_safe(self, now: float) -> None:
        while self.remaining() < 0:
            active = [
                (p.tokens, pid)
                for pid, p in self._programs.items()
                if not p.paused and not p.marked
            ]
            acting = [a for a in active if self._programs[a[1]].status is _Status.ACTING]
            if acting:
                pid = min(acting)[1]
                self._pause(pid, self._programs[pid], now)
                continue
            if not active:
                return
            self._programs[min(active)[1]].marked = True

    def _pause(self, program_id: str, program: _Program, now: float) -> None:
        program.paused = True
        program.paused_at = now
        self._paused[program_id] = None
        self.pauses += 1

    def _resume_one(self, program_id: str) -> None:
        self._paused.pop(program_id, None)
        program = self._programs[program_id]
        program.paused = False
        self.resumes += 1

    def __repr__(self) -> str:
        return (
            f"ProgramAdmission(capacity={self.capacity_tokens}, programs={len(self._programs)}, "
            f"paused={len(self._paused)})"
        )
