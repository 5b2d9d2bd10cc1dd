"""Where each program's turns last arrived, across a cluster's engines.

A pin is worth its memory only if the router brings the program back to the engine that
holds it. No router tells an engine that it moved a program, but every engine reports its
turn arrivals here (``PinCoherenceService.ReportArrivals``), so the control plane sees a
move the moment the program's next turn lands elsewhere. The engine the program left is
told (``WatchMoves``): it drops the program's pin at once instead of holding it until its
TTL, and forgets the open tool call, so that the program's absence is not measured as one
long tool call if it ever comes back.

This works behind any router, session-aware or blind, since it keys on the program id the
engines already read (``X-Session-ID`` and the other session sources).

Where the locations live: a server on SQLite (or ``memory://``) keeps them here, in
:class:`ProgramLocations`; a server on PostgreSQL keeps them in the database
(:mod:`controlplane.storage.locations`), so that replicas sharing it see a program move
between engines linked to different replicas. Both answer a report with the same
:class:`Move` records.

Bounds: per tenant, the locations of the :attr:`ProgramLocations.max_programs` most recently
arrived programs are kept (least recently arrived forgotten first); a forgotten program's
next arrival counts as new (nothing is sent). Single-threaded: the server calls it from its
event loop.

>>> where = ProgramLocations(max_programs=2)
>>> where.arrived("acme", "engine-a", "p1", 10.0) is None   # new program
True
>>> where.arrived("acme", "engine-a", "p1", 12.0) is None   # back on the same engine
True
>>> where.arrived("acme", "engine-b", "p1", 15.0)           # moved: engine-a must hear it
Move(program_id='p1', from_engine='engine-a', to_engine='engine-b', arrived_at=15.0)
>>> where.arrived("other", "engine-a", "p1", 16.0) is None  # program ids are per tenant
True
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from controlplane.records import MAX_PROGRAM_LOCATIONS, Move

__all__ = ["MAX_PROGRAMS", "Location", "ProgramLocations"]

#: Programs whose location is kept per tenant (the least recently arrived go first).
MAX_PROGRAMS = MAX_PROGRAM_LOCATIONS


@dataclass(frozen=True, slots=True)
class Location:
    """The engine a program's latest turn arrived at, and when."""

    engine_id: str
    arrived_at: float


class ProgramLocations:
    """The latest engine of each program, per tenant, bounded (module docstring)."""

    def __init__(self, max_programs: int = MAX_PROGRAMS) -> None:
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.max_programs = max_programs
        self._tenants: dict[str, OrderedDict[str, Location]] = {}
        #: Per tenant, programs last seen on each engine, kept as locations change (the
        #: console asks for it; counting up to ``max_programs`` locations would hold the
        #: event loop tens of milliseconds).
        self._per_engine: dict[str, Counter[str]] = {}

    def arrived(self, tenant: str, engine_id: str, program_id: str, at: float) -> Move | None:
        """A turn of ``program_id`` arrived at ``engine_id`` at ``at``. Returns the move an
        engine must hear, or ``None`` when the program is new here or stayed on the same
        engine: the program left the engine of its previous turn for this one, or, when
        this arrival is older than the one stored (its report came late, after the next
        turn's elsewhere), it left this engine for the stored one, which stays."""
        programs = self._tenants.setdefault(tenant, OrderedDict())
        counts = self._per_engine.setdefault(tenant, Counter())
        before = programs.pop(program_id, None)
        stale = before is not None and at < before.arrived_at
        now = before if stale and before is not None else Location(engine_id, at)
        programs[program_id] = now
        if before is not None:
            _less(counts, before.engine_id)
        counts[now.engine_id] += 1
        if len(programs) > self.max_programs:
            _less(counts, programs.popitem(last=False)[1].engine_id)
        if before is None or before.engine_id == engine_id:
            return None
        if stale:
            return Move(program_id, engine_id, before.engine_id, before.arrived_at)
        return Move(program_id, before.engine_id, engine_id, at)

    def report(
        self, tenant: str, engine_id: str, arrivals: Iterable[tuple[str, float]]
    ) -> list[Move]:
        """Apply a report of ``(program_id, arrived_at)`` turns at ``engine_id``, in order;
        the moves it revealed, in order.

        >>> where = ProgramLocations()
        >>> where.report("acme", "engine-a", [("p1", 1.0), ("p2", 1.0)])
        []
        >>> where.report("acme", "engine-b", [("p1", 2.0), ("p1", 2.5), ("p3", 2.0)])
        [Move(program_id='p1', from_engine='engine-a', to_engine='engine-b', arrived_at=2.0)]
        >>> where.report("acme", "engine-c", [("p2", 3.0)])
        [Move(program_id='p2', from_engine='engine-a', to_engine='engine-c', arrived_at=3.0)]
        >>> where.report("acme", "engine-a", [("p2", 1.5)])  # late: p2 went on to engine-c
        [Move(program_id='p2', from_engine='engine-a', to_engine='engine-c', arrived_at=3.0)]
        >>> where.where("acme", "p2")
        Location(engine_id='engine-c', arrived_at=3.0)
        """
        return [
            move
            for program, at in arrivals
            if (move := self.arrived(tenant, engine_id, program, at))
        ]

    def engines(self, tenant: str) -> Counter[str]:
        """How many of the tenant's programs were last seen on each engine (kept as
        locations change: as long as the tenant has engines, not programs).

        >>> where = ProgramLocations(max_programs=2)
        >>> where.report("acme", "a", [("p1", 1.0), ("p2", 1.0)])
        []
        >>> _ = where.report("acme", "b", [("p1", 2.0), ("p3", 2.0)])  # p2 forgotten
        >>> where.engines("acme")
        Counter({'b': 2})
        """
        return Counter(self._per_engine.get(tenant, ()))

    def where(self, tenant: str, program_id: str) -> Location | None:
        """Where the program's latest turn arrived (``None``: unknown or forgotten)."""
        programs = self._tenants.get(tenant)
        return None if programs is None else programs.get(program_id)

    def __len__(self) -> int:
        return sum(len(programs) for programs in self._tenants.values())


def _less(counts: Counter[str], engine_id: str) -> None:
    counts[engine_id] -= 1
    if counts[engine_id] <= 0:
        del counts[engine_id]
