"""What the waiting queue asks of the pin controller: the rules in force (the pressure rule
and order window, which a CPU tier changes), what an ordering asks about a program (live
pin, first arrival, attained service), the sort key of a request, and program-level
admission (a paused program's requests wait).

:class:`QueueOrder` is a part of :class:`enginehook.core.lifecycle.PinController`: the
controller is the :class:`~enginehook.core.registries.OrderContext` its ordering is called
with.
"""

from __future__ import annotations

from typing import Any

from enginehook.core.admission import ProgramAdmission
from enginehook.core.pins import PinTable
from enginehook.core.pressure import PressureRule
from enginehook.core.programs import Programs
from enginehook.core.registries import OrderKey
from enginehook.core.rules import SchedulingRules

__all__ = ["QueueOrder"]


class QueueOrder:
    """The rules in force, the queue's sort key and program-level admission."""

    # Set by PinController.__init__.
    rules: SchedulingRules
    pins: PinTable[Any]
    admission: ProgramAdmission | None
    _programs: Programs
    _order: OrderKey
    _cpu_tier: bool
    _pressure: PressureRule
    _window: float

    # -- rules in force --------------------------------------------------------------------
    @property
    def cpu_tier(self) -> bool:
        """Whether a CPU tier holds copies of the KV (the tier rules apply)."""
        return self._cpu_tier

    @cpu_tier.setter
    def cpu_tier(self, on: bool) -> None:
        self._cpu_tier = bool(on)
        self._pressure, self._window = self.rules.in_force(self._cpu_tier)

    @property
    def pressure_rule(self) -> PressureRule:
        return self._pressure

    @property
    def order_window_s(self) -> float:
        return self._window

    @property
    def first_turn_head_start_s(self) -> float:
        return self.rules.first_turn_head_start_s

    @property
    def first_turn_over_pins(self) -> bool:
        return self.rules.first_turn_over_pins

    # -- what orderings ask ----------------------------------------------------------------
    def pinned(self, program_id: str | None) -> bool:
        return program_id is not None and program_id in self.pins

    def first_arrival(self, program_id: str | None, default: float) -> float:
        return self._programs.arrivals.first(program_id, default)

    def attained_service(self, program_id: str | None) -> float:
        return self._programs.attained_service(program_id)

    def attained_tokens(self, program_id: str | None) -> float:
        return self._programs.attained_tokens(program_id)

    def order_key(
        self, priority: int, preempted: bool, program_id: str | None, arrival: float, rid: str
    ) -> tuple[object, ...]:
        """The waiting-queue sort key of one request (smaller goes first). With an
        admission, requests of paused programs sort after every other (the host stops
        admitting at the first one, :meth:`may_admit`)."""
        key = self._order(self, priority, preempted, program_id, arrival, rid)
        if self.admission is not None:
            return (1 if self.admission.held(program_id) else 0, *key)
        return key

    # -- program-level admission ------------------------------------------------------------
    def may_admit(self, program_id: str | None) -> bool:
        """Whether a waiting request of the program may be admitted (its program is not
        paused by the admission)."""
        return self.admission is None or not self.admission.held(program_id)

    def admission_tick(self, now: float) -> bool:
        """Run the admission's periodic pause/resume check when due; ``True`` when a
        program was resumed (queue order changed). Hosts call it every scheduling step."""
        if self.admission is None or not self.admission.due(now):
            return False
        return bool(self.admission.tick(now))

    def next_admission_check(self) -> float | None:
        """When the admission checks next while a program is paused (an idle host must
        wake up then); ``None`` without one."""
        if self.admission is None or not self.admission.paused_count():
            return None
        return self.admission.next_tick()
