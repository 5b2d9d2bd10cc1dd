"""What the pin controller keeps of each program: its tenant, first arrival, attained
service (model seconds and weighted tokens) and its tenant's tool-call tracker, for at most
``max_programs`` programs.

:class:`Programs` is part of :class:`enginehook.core.lifecycle.PinController`; the
controller owns the pins and tells it which programs hold one (a program holding a pin is
never evicted to keep the bound).

>>> programs = Programs("engine-0", max_programs=2)
>>> programs.arrived("a", 1.0, 1.0, pinned=()), programs.arrived("b", 2.0, 2.0, pinned=())
(None, None)
>>> programs.arrived("c", 3.0, 3.0, pinned={"a"}), programs.evicted, len(programs)
('b', 1, 2)
"""

from __future__ import annotations

from collections.abc import Container

from enginehook.core.priority import ProgramArrivals
from enginehook.core.tracker import ProgramEndReport, ToolCallTracker

__all__ = ["MAX_PROGRAMS", "Programs"]

#: Most programs a :class:`~enginehook.core.lifecycle.PinController` keeps state for
#: (arrival, tenant, service and its tracker's turn counts). Past it the program that arrived
#: least recently and holds no pin is forgotten, as a program idle past ``idle_program_s`` is
#: (its next turn starts afresh); :attr:`Programs.evicted` counts them.
MAX_PROGRAMS = 65_536


class Programs:
    """Tenants, arrivals, attained service and trackers of the programs one engine serves."""

    def __init__(self, engine_id: str, max_programs: int = MAX_PROGRAMS) -> None:
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.engine_id = engine_id
        self.max_programs = max_programs
        #: Programs forgotten to keep ``max_programs``.
        self.evicted = 0
        self.arrivals = ProgramArrivals()
        self._trackers: dict[str, ToolCallTracker] = {}
        self._tenants: dict[str, str] = {}  # most recent arrival last
        self._service: dict[str, float] = {}
        self._tokens: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._tenants)

    def tracker(self, tenant: str = "default") -> ToolCallTracker:
        """The tool-call tracker of ``tenant`` (one per engine and tenant)."""
        tracker = self._trackers.get(tenant)
        if tracker is None:
            tracker = self._trackers[tenant] = ToolCallTracker(self.engine_id, tenant)
        return tracker

    def tracker_of(self, program_id: str) -> ToolCallTracker:
        """The tracker of the program's tenant."""
        return self.tracker(self._tenants.get(program_id, "default"))

    def attained_service(self, program_id: str | None) -> float:
        return self._service.get(program_id, 0.0) if program_id is not None else 0.0

    def attained_tokens(self, program_id: str | None) -> float:
        return self._tokens.get(program_id, 0.0) if program_id is not None else 0.0

    def served(self, program_id: str, service_s: float, tokens: float) -> None:
        """A turn of the program finished: ``service_s`` model seconds, ``tokens`` weighted
        tokens more of attained service."""
        self._service[program_id] = self._service.get(program_id, 0.0) + service_s
        self._tokens[program_id] = self._tokens.get(program_id, 0.0) + tokens

    def arrived(
        self,
        program_id: str,
        arrival: float,
        now: float,
        tenant: str = "default",
        parent: str | None = None,
        *,
        pinned: Container[str],
        turns: int | None = None,
    ) -> str | None:
        """A request of the program arrived (see
        :meth:`enginehook.core.lifecycle.PinController.arrived` for ``parent`` and
        ``turns``). Returns
        the program forgotten to keep the bound (the least recent not in ``pinned``), if
        any."""
        self._tenants.pop(program_id, None)  # most recent last: the bound evicts the oldest
        self._tenants[program_id] = tenant
        evicted = None
        if len(self._tenants) > self.max_programs:
            evicted = next((p for p in self._tenants if p not in pinned), None)
            if evicted is not None:
                self.tracker_of(evicted).forget(evicted)
                self.forget(evicted)
                self.evicted += 1
        if parent is not None and parent != program_id:
            arrival = min(arrival, self.arrivals.first(parent, arrival))
            if program_id not in self._tokens and parent in self._tokens:
                self._tokens[program_id] = self._tokens[parent]
                self._service[program_id] = self._service.get(parent, 0.0)
        self.arrivals.observe(program_id, arrival)
        self.tracker(tenant).arrived(program_id, now, turns)
        return evicted

    def idle(self, now: float, idle_s: float) -> tuple[list[ProgramEndReport], list[str]]:
        """The programs whose tool call finished over ``idle_s`` ago without a return: the
        ends to report, and the quiet ones (nothing to report); the caller forgets both."""
        ended: list[ProgramEndReport] = []
        quiet: list[str] = []
        for tracker in self._trackers.values():
            ended += tracker.forget_idle(now, idle_s, quiet)
        return ended, quiet

    def forget(self, program_id: str) -> None:
        """Drop the program's arrival, service and tenant (its tracker forgets its own)."""
        self.arrivals.forget(program_id)
        self._service.pop(program_id, None)
        self._tokens.pop(program_id, None)
        self._tenants.pop(program_id, None)
