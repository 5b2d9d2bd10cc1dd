"""The pin controller: a program's KV cache around its tool calls, for any engine.

:class:`PinController` is the one object both hosts run: the vLLM hook
(:mod:`enginehook.vllm.scheduler`) and the simulator (:class:`simulator.sim.Simulation`). It owns
the pin table, the tool-call trackers, program arrivals and attained service, the TTL
policy (a :class:`~enginehook.core.host.Decider`) and the
:class:`~enginehook.core.rules.SchedulingRules`, and it
exposes the lifecycle::

    arrived ─► admitted (a live pin hands its blocks over) ─► finished (decide, pin, track)
    expire(now) · relieve(needed, ...) under memory pressure · order_key(...) of the queue
    admission_tick(now) · may_admit(program) where a program-level admission runs

An engine implements the small :class:`~enginehook.core.host.EngineHost` protocol (free
KV, the waiting queue, giving a pinned handle back, receiving events); nothing here knows
vLLM or the simulator, and every method that depends on time takes ``now``. What the
controller keeps of each program is :class:`~enginehook.core.programs.Programs`; what the
waiting queue asks of it (the rules in force, the sort key, program-level admission) is
:class:`~enginehook.core.order.QueueOrder`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Generic, TypeVar

from controlplane.records import NotPinnedCause
from enginehook.core.admission import ProgramAdmission
from enginehook.core.host import Admitted, Decider, EngineHost, Finish, FinishedTurn
from enginehook.core.order import QueueOrder
from enginehook.core.pins import Pin, PinTable, ReleaseReason
from enginehook.core.pressure import PressureRule, may_release
from enginehook.core.priority import ProgramArrivals
from enginehook.core.programs import MAX_PROGRAMS, Programs
from enginehook.core.registries import ORDERINGS, VICTIMS
from enginehook.core.rollout import RolloutState
from enginehook.core.rules import SchedulingRules
from enginehook.core.tracker import CacheSeen, ToolCallTracker
from enginehook.core.ttl import clip_ttl, finite_cap
from estimator import Decision, RequestFacts

__all__ = ["PinController"]

H = TypeVar("H")


class PinController(QueueOrder, Generic[H]):
    """Pins, trackers, arrivals, the policy and the rules of one engine."""

    def __init__(
        self,
        rules: SchedulingRules,
        host: EngineHost[H],
        *,
        pool_blocks: int,
        decider: Decider | None,
        engine_id: str,
        cpu_tier: bool = False,
        block_size: int = 16,
        max_programs: int = MAX_PROGRAMS,
        rollout: RolloutState | None = None,
    ) -> None:
        """``decider``: ``None`` never pins (the controller still tracks and orders).
        ``block_size``: tokens per KV block (the admission's capacity is the pool's tokens).
        ``max_programs``: the bound on programs kept (:data:`MAX_PROGRAMS`).
        ``rollout``: which tools may be pinned (:mod:`enginehook.core.rollout`; default:
        every tool); a call of another tool is decided and reported, never pinned."""
        self._programs = Programs(engine_id, max_programs)
        self.rules = rules
        self.host = host
        self.decider = decider
        self.engine_id = engine_id
        budget = int(rules.budget_share * pool_blocks)
        cap = finite_cap(rules.ttl_cap_s)
        self.pins: PinTable[H] = PinTable(budget, ttl_cap_s=cap, on_release=self._released)
        self.admission: ProgramAdmission | None = None
        if rules.admission == "thunderagent":
            self.admission = ProgramAdmission(
                pool_blocks * block_size, interval_s=rules.admission_interval_s
            )
        self._order = ORDERINGS[rules.ordering]
        self._victims = VICTIMS[rules.victim]
        self.cpu_tier = cpu_tier
        self.rollout = rollout if rollout is not None else RolloutState()

    # -- the lifecycle ---------------------------------------------------------------------
    @property
    def arrivals(self) -> ProgramArrivals:
        """Programs' first arrivals."""
        return self._programs.arrivals

    @property
    def max_programs(self) -> int:
        return self._programs.max_programs

    @property
    def evicted(self) -> int:
        """Programs forgotten to keep ``max_programs``."""
        return self._programs.evicted

    @property
    def programs(self) -> int:
        """Programs the controller keeps state for (at most ``max_programs``)."""
        return len(self._programs)

    def tracker(self, tenant: str = "default") -> ToolCallTracker:
        """The tool-call tracker of ``tenant`` (one per engine and tenant)."""
        return self._programs.tracker(tenant)

    def _tracker_of(self, program_id: str) -> ToolCallTracker:
        return self._programs.tracker_of(program_id)

    def arrived(
        self,
        program_id: str,
        arrival: float,
        now: float,
        tenant: str = "default",
        prompt_tokens: int = 0,
        parent: str | None = None,
        turns: int | None = None,
    ) -> None:
        """A request of the program arrived (``arrival``: its queue time; ``prompt_tokens``:
        its prompt, which the admission counts). ``turns``: the turns the program finished
        before this request on any engine, when the client's request says so
        (:func:`enginehook.hints.turns.turn_hint`): its turns are counted from at least
        there, so a program that moved between engines is counted whole; without it each
        engine counts the turns it served since the program arrived there. ``parent``: the
        program this one works for (a sub-agent's session). It is scheduled as part of
        that program: it inherits the parent's first arrival (the parent waits on it, so it
        is as old as the parent's work) and, on its first request, the parent's attained
        service, so it is not a new program (no first-turn head start or reclaim: those are
        for new sessions) and a session that fans out gets no larger share under
        service-based orders."""
        evicted = self._programs.arrived(
            program_id, arrival, now, tenant, parent, pinned=self.pins, turns=turns
        )
        if evicted is not None and self.admission is not None:
            self.admission.ended(evicted)
        if self.admission is not None:
            self.admission.arrived(program_id, prompt_tokens, now)

    def admitted(self, program_id: str, now: float, seen: CacheSeen | None = None) -> Admitted[H]:
        """A request of the program was admitted: a live pin hands its blocks over
        (``pin``, already ended as ``HIT``) and the tool call it returned from is complete
        (``turn``: what it found of its previous turn's cache; ``None``: it returns from no
        finished turn). ``seen``: what the host saw of the request's cache (hit tokens,
        block hashes or the reusable prefix), for the turn's miss reason."""
        pin = self.pins.admitted(program_id)
        tracker = self._tracker_of(program_id)
        turn = tracker.returned(program_id, now, pin_held=pin is not None, seen=seen)
        if turn is not None and turn.event is not None:
            self.host.emit(turn.event)
        return Admitted(pin, turn)

    def finished(
        self, turn: FinishedTurn, now: float, take: Callable[[], tuple[int, H]]
    ) -> Finish[H]:
        """A turn finished: end the program, or decide a TTL and pin what ``take()`` hands
        over (``(blocks, handle)``; called only when the decision is to pin)."""
        program = turn.program_id
        tracker = self._tracker_of(program)
        served = turn.context_tokens + turn.output_tokens
        self._programs.served(program, turn.service_s, served)
        if self.admission is not None and not turn.last_turn:
            self.admission.acting(program, turn.context_tokens, now)
        if turn.last_turn:
            self.end_program(program, now)
            return Finish()
        if turn.tool is None or self.decider is None or not turn.pin:
            cause = NotPinnedCause.CLIENT if not turn.pin else NotPinnedCause.TTL_ZERO
            tracker.turn_finished(
                program, now, tool=turn.tool, tool_args=turn.tool_args, not_pinned=cause
            )
            return Finish()
        decision = self.decider.decide(self._facts(turn, tracker), turn)
        ttl_s = clip_ttl(decision.ttl_s, ceiling_s=turn.pin_ttl_max_s, cap_s=math.inf)
        if ttl_s != decision.ttl_s:  # the pin table applies the rules' cap
            decision = replace(decision, ttl_s=ttl_s)
        if not self.rollout.pins(turn.tool):
            return self._shadow(turn, decision, tracker, now)
        if decision.ttl_s <= 0:
            tracker.turn_finished(
                program, now, tool=turn.tool, tool_args=turn.tool_args, basis=decision.basis
            )
            return Finish(decision=decision)
        blocks, handle = take()
        over = self.pins.pinned_blocks + blocks > self.pins.budget_blocks
        result = self.pins.pin(
            program,
            blocks,
            now,
            decision.ttl_s,
            return_probability=decision.return_probability,
            benefit_s=decision.benefit_s,
            basis=decision.basis,
            handle=handle,
            program_arrival=self.arrivals.first(program, now),
            waiting_programs=self._waiting_programs() if over else (),
        )
        tracker.turn_finished(
            program,
            now,
            tool=turn.tool,
            tool_args=turn.tool_args,
            ttl_s=result.ttl_s if result.pinned else 0.0,
            pinned=result.pinned,
            basis=decision.basis,
            not_pinned=NotPinnedCause.BUDGET,
        )
        return Finish(took=True, pinned=result.pinned, decision=decision, handle=handle)

    def _shadow(
        self, turn: FinishedTurn, decision: Decision, tracker: ToolCallTracker, now: float
    ) -> Finish[H]:
        """A turn whose tool is outside the rollout in force: the pin it would have made
        (the TTL under the rules' cap) is reported, and nothing is taken."""
        would = min(max(0.0, decision.ttl_s), self.pins.ttl_cap_s)
        tracker.turn_finished(
            turn.program_id, now, tool=turn.tool, tool_args=turn.tool_args, ttl_s=would,
            basis=decision.basis, shadow=True,
        )  # fmt: skip
        return Finish(decision=replace(decision, ttl_s=would), shadow=True)

    def _facts(self, turn: FinishedTurn, tracker: ToolCallTracker) -> RequestFacts:
        assert turn.tool is not None
        waiting, free = self.load(turn.context_tokens)
        return RequestFacts(
            tool=turn.tool,
            tool_args=turn.tool_args,
            context_tokens=turn.context_tokens,
            tenant=turn.tenant,
            program_id=turn.program_id,
            turns_served=tracker.turns_served(turn.program_id) + 1,
            offload=self._cpu_tier,
            offloaded_tokens=turn.offloaded_tokens if self._cpu_tier else None,
            waiting_tokens=waiting,
            free_tokens=free,
        )

    def load(self, context_tokens: int) -> tuple[int, int]:
        """KV tokens the waiting requests still need (prompts less what their programs'
        pins cover) and free KV tokens now: the load a pin is priced against.

        The policy clamps (waiting − free) / context to at most 1, so the walk over the
        queue stops once the sum passes free + context: a long queue under saturation
        costs a few requests, not all of them, and the decision is the same.
        """
        free = self.host.free_tokens()
        enough = free + context_tokens
        waiting = 0
        pins = self.pins
        for program, tokens in self.host.waiting_requests():
            pin = pins.get(program) if program is not None else None
            waiting += max(0, tokens - (self.host.pinned_tokens(pin) if pin else 0))
            if waiting > enough:
                break
        return waiting, free

    def close(self, program_id: str) -> Pin[H] | None:
        """A request of the program asked to release its session: its pin goes now
        (``CLOSED``, returned); the host ends the program when that request finishes
        (a turn with ``last_turn``), so nothing is pinned after it."""
        return self.pins.release(program_id, ReleaseReason.CLOSED)

    def moved_away(self, program_id: str, arrived_at: float) -> Pin[H] | None:
        """The program's next turn arrived at another engine at ``arrived_at`` (the control
        plane says so): its pin here goes now (``MOVED``, returned), the tool call it left
        here is reported with the duration it really had, and its state here is forgotten."""
        return self._left(program_id, arrived_at, ReleaseReason.MOVED)

    def drop(self, program_id: str, now: float) -> Pin[H] | None:
        """A router dropped the program's pin (it sends the program's next turn elsewhere):
        as :meth:`moved_away` at ``now``, with ``DROPPED``; a program holding no pin is left
        as it is (``None``)."""
        if self.pins.get(program_id) is None:
            return None
        return self._left(program_id, now, ReleaseReason.DROPPED)

    def _left(self, program_id: str, at: float, reason: ReleaseReason) -> Pin[H] | None:
        pin = self.pins.release(program_id, reason)
        event = self._tracker_of(program_id).moved(program_id, at)
        self._forget(program_id)
        if event is not None:
            self.host.emit(event)
        return pin

    def extend(self, program_id: str, ttl_s: float, now: float) -> Pin[H] | None:
        """A router extended the program's pin to ``now + ttl_s`` (within the rules' cap;
        never shortened); the pin, or ``None`` when the program holds none."""
        return self.pins.extend(program_id, now, ttl_s)

    def end_program(self, program_id: str, now: float) -> None:
        """The program ended: its pin goes, its last turn is counted, its state forgotten."""
        self.pins.program_end(program_id)
        tracker = self._tracker_of(program_id)
        tracker.turn_finished(program_id, now, tool=None)
        event = tracker.program_end(program_id, now)
        self._forget(program_id)
        if event is not None:
            self.host.emit(event)

    def _forget(self, program_id: str) -> None:
        self._programs.forget(program_id)
        if self.admission is not None:
            self.admission.ended(program_id)

    # -- time and memory -----------------------------------------------------------------
    def expire(self, now: float) -> list[Pin[H]]:
        """Release the pins past their expiry whose program has no request waiting."""
        if not self.pins.due(now):
            return []
        return [pin for pin, _ in self.pins.expire(now, self._waiting_programs())]

    def _waiting_programs(self) -> Collection[str]:
        """Programs whose waiting request the engine may admit: a request the program-level
        admission holds does not keep its program's pin past expiry or out of pressure's
        reach (the admission decided that program waits; its pin would hold KV for a turn
        that cannot come)."""
        waiting = self.host.waiting_programs()
        admission = self.admission
        if admission is None or not waiting:
            return waiting
        return {p for p in waiting if not admission.held(p)}

    def relieve(
        self,
        needed_blocks: int,
        requester: str | None,
        *,
        for_running: bool,
        nothing_running: bool,
        now: float,
        fits: Callable[[], bool] | None = None,
        waited_s: float = 0.0,
    ) -> int:
        """Release pins for a request that cannot get ``needed_blocks`` blocks, if the
        pressure rule in force allows it: the victim strategy's pins in order (never the
        requester's own), until ``fits()`` says the request fits (all chosen, without
        ``fits``). Returns how many were released.

        Where the running rule refuses a waiting request, ``first_turn_reclaim`` still
        lets a new program's first turn (a program with nothing served yet) take the pins
        whose expected loss (the latency their program would lose by a miss) is below
        ``waited_s``, the time it has waited: past that point the newcomer has lost more by
        waiting than the pin's program would lose, and with memory held by pins it has no
        other way in. ``waiting_reclaim`` extends this to every waiting request of a
        program (returning turns too). Only priced pins (a benefit B > 0) of programs with
        no request waiting qualify; a request without a program (non-agent traffic) takes
        none."""
        if not len(self.pins):
            return 0
        pins = [p for p in self.pins if p.program_id != requester]
        if not may_release(
            self._pressure, for_running=for_running, nothing_running=nothing_running
        ):
            if not (
                self._pressure is PressureRule.RUNNING
                and requester is not None
                and (
                    self.rules.waiting_reclaim
                    or (self.rules.first_turn_reclaim and self.attained_tokens(requester) == 0)
                )
            ):
                return 0
            waiting = self._waiting_programs()
            pins = [
                p
                for p in pins
                if p.benefit_s > 0
                and p.program_id not in waiting
                and p.expected_loss_s(now) < waited_s
            ]
            if not pins:
                return 0
        released = 0
        for victim in self._victims(pins, needed_blocks, now, self._waiting_programs()):
            self.pins.release(victim.program_id, ReleaseReason.PRESSURE)
            released += 1
            if fits is not None and fits():
                break
        return released

    def forget_idle(self, now: float, idle_s: float) -> list[str]:
        """Forget programs whose tool call finished over ``idle_s`` ago without a return,
        and report each one's end (the turns it was served). Returns their ids."""
        ended, quiet = self._programs.idle(now, idle_s)
        for program_id in quiet:
            self._forget(program_id)
        for event in ended:
            self._forget(event.program_id)
            self.host.emit(event)
        return [event.program_id for event in ended]

    def release_all(self, reason: ReleaseReason = ReleaseReason.SHUTDOWN) -> None:
        """End every pin (prefix-cache reset, shutdown)."""
        self.pins.release_all(reason)

    def _released(self, pin: Pin[H], reason: ReleaseReason) -> None:
        self.host.pin_released(pin, reason)
        self._tracker_of(pin.program_id).pin_released(pin.program_id, reason)

    def __repr__(self) -> str:
        return f"PinController({self.rules!r}, pins={len(self.pins)}, tier={self._cpu_tier})"
