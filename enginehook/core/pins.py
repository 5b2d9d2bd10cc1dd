"""The pin table: which programs hold a finished request's KV blocks, and until when.

Engine-independent: a pin is a program id, a block count, times in seconds and an opaque
``handle`` (the engine's block objects in vLLM, nothing in the simulator). Every method
that depends on time takes ``now``; nothing reads a clock.

A pin ends for one of the reasons in :class:`ReleaseReason`:

- ``HIT``: the program's next request was admitted (its prefix hit takes over the blocks);
- ``TTL``: it expired (strictly after ``pinned_at + ttl``, as in the paper's Algorithm 1)
  with no follow-up request of its program waiting;
- ``PROGRAM_END``: the program's last turn arrived or the client ended it;
- ``CLOSED``: a request of the program asked to release its session (a ``release`` hint):
  the pin goes when that request arrives, before it runs;
- ``PRESSURE``: the engine needed the memory (:mod:`enginehook.core.pressure` picks victims);
- ``BUDGET``: a new pin needed room under the global pinned-block budget;
- ``REPLACED``: the same program pinned again (one pin per program);
- ``SHUTDOWN``: the engine reset its prefix cache or stopped.
- ``MOVED``: the program's next turn arrived at another engine (the control plane's
  ``PinCoherenceService`` tells the engine it left).
- ``DROPPED``: a router asked the engine to drop the session's pin (it sends the program
  elsewhere; :mod:`enginehook.vllm.pin_commands`).

>>> table = PinTable(budget_blocks=10, ttl_cap_s=60.0)
>>> table.pin("p1", blocks=4, now=0.0, ttl_s=2.0).pinned
True
>>> [(p.program_id, r.value) for p, r in table.expire(2.0, waiting_programs=set())]
[]
>>> [(p.program_id, r.value) for p, r in table.expire(2.5, waiting_programs=set())]
[('p1', 'ttl')]
>>> table.pinned_blocks
0
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from enginehook.core.pressure import choose_victims
from enginehook.core.ttl import clip_ttl
from estimator import DEFAULT_TTL_CAP_S

__all__ = ["Pin", "PinResult", "PinTable", "ReleaseReason"]

H = TypeVar("H")


class ReleaseReason(Enum):
    """Why a pin ended."""

    HIT = "hit"
    TTL = "ttl"
    PROGRAM_END = "program_end"
    CLOSED = "closed"
    PRESSURE = "pressure"
    BUDGET = "budget"
    REPLACED = "replaced"
    SHUTDOWN = "shutdown"
    MOVED = "moved"
    DROPPED = "dropped"


@dataclass(slots=True)
class Pin(Generic[H]):
    """One program's pinned blocks.

    ``return_probability`` and ``benefit_s`` are the TTL decision's F(τ) and B; with the
    remaining time they give the expected loss of releasing the pin early.
    """

    program_id: str
    blocks: int
    pinned_at: float
    expires_at: float
    ttl_s: float
    return_probability: float = 0.0
    benefit_s: float = 0.0
    basis: str = ""
    handle: H | None = None
    #: The program's first arrival (the paper's pressure victims go latest first).
    program_arrival: float = 0.0
    #: Bumped on every (re)pin so that stale expiry-heap entries are recognised.
    generation: int = 0

    def remaining_s(self, now: float) -> float:
        """Seconds until expiry (0 once past it)."""
        return max(0.0, self.expires_at - now)

    def expected_loss_s(self, now: float) -> float:
        """Latency expected to be lost by releasing now: F(τ)·B scaled by the share of τ
        still to run (returns assumed spread evenly over the TTL)."""
        if self.ttl_s <= 0:
            return 0.0
        return self.return_probability * self.benefit_s * self.remaining_s(now) / self.ttl_s


@dataclass(frozen=True, slots=True)
class PinResult(Generic[H]):
    """Outcome of :meth:`PinTable.pin`: whether the pin was taken, its effective TTL, and
    the pins released to make room (the program's previous pin, budget victims)."""

    pinned: bool
    ttl_s: float
    released: list[tuple[Pin[H], ReleaseReason]]
    reason: str = ""


class PinTable(Generic[H]):
    """Pins keyed by program, an expiry heap, a global block budget and a hard TTL cap.

    ``budget_blocks``: most blocks pinned at once (all programs together).
    ``ttl_cap_s``: no pin lives longer than this, whatever the policy said.
    ``on_release``: called with ``(pin, reason)`` for every pin that ends, in order (the
    vLLM hook frees the blocks there).
    """

    def __init__(
        self,
        budget_blocks: int,
        ttl_cap_s: float = DEFAULT_TTL_CAP_S,
        on_release: Callable[[Pin[H], ReleaseReason], None] | None = None,
    ) -> None:
        if isinstance(budget_blocks, bool) or not isinstance(budget_blocks, int):
            raise ValueError(f"budget_blocks must be an integer, got {budget_blocks!r}")
        if budget_blocks < 0:
            raise ValueError(f"budget_blocks must be >= 0, got {budget_blocks}")
        if not (isinstance(ttl_cap_s, int | float) and math.isfinite(ttl_cap_s)):
            raise ValueError(f"ttl_cap_s must be a finite number, got {ttl_cap_s!r}")
        if ttl_cap_s < 0:
            raise ValueError(f"ttl_cap_s must be >= 0, got {ttl_cap_s}")
        self.budget_blocks = budget_blocks
        self.ttl_cap_s = float(ttl_cap_s)
        self.on_release = on_release
        self._pins: dict[str, Pin[H]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._overdue: set[str] = set()
        self._pinned_blocks = 0
        self._generation = 0

    # -- queries -----------------------------------------------------------------------
    @property
    def pinned_blocks(self) -> int:
        """Blocks held by all pins."""
        return self._pinned_blocks

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, program_id: object) -> bool:
        return program_id in self._pins

    def __iter__(self) -> Iterator[Pin[H]]:
        return iter(list(self._pins.values()))

    def get(self, program_id: str) -> Pin[H] | None:
        """The program's pin, if it holds one."""
        return self._pins.get(program_id)

    def due(self, now: float) -> bool:
        """Whether :meth:`expire` has anything to look at (O(1) amortised): an overdue
        pin, or a pin whose expiry lies strictly before ``now``."""
        if self._overdue:
            return True
        expiry = self.next_expiry()
        return expiry is not None and expiry < now

    def next_expiry(self) -> float | None:
        """Earliest expiry among live pins (``None`` when none)."""
        self._drop_stale_heads()
        return self._heap[0][0] if self._heap else None

    # -- taking pins -------------------------------------------------------------------
    def pin(
        self,
        program_id: str,
        blocks: int,
        now: float,
        ttl_s: float,
        *,
        return_probability: float = 0.0,
        benefit_s: float = 0.0,
        basis: str = "",
        handle: H | None = None,
        program_arrival: float = 0.0,
        waiting_programs: Collection[str] = (),
    ) -> PinResult[H]:
        """Pin ``blocks`` for ``program_id`` until ``now + min(ttl_s, ttl_cap_s)``.

        The program's previous pin is released first (``REPLACED``). When the budget is
        short, pins of programs with no waiting request and a lower expected loss than the
        new pin are released (``BUDGET``); if that is not enough nothing is released and
        the pin is refused. A TTL of 0 (after the cap) or 0 blocks pins nothing.
        """
        _check_pin(program_id, blocks, ttl_s)
        released: list[tuple[Pin[H], ReleaseReason]] = []
        old = self.release(program_id, ReleaseReason.REPLACED)
        if old is not None:
            released.append((old, ReleaseReason.REPLACED))
        ttl = clip_ttl(float(ttl_s), ceiling_s=None, cap_s=self.ttl_cap_s)
        if ttl <= 0 or blocks == 0:
            return PinResult(False, ttl, released, "zero ttl or no blocks")
        candidate: Pin[H] = Pin(
            program_id, blocks, now, now + ttl, ttl, return_probability, benefit_s, basis
        )
        candidate.handle, candidate.program_arrival = handle, program_arrival
        short = self._pinned_blocks + blocks - self.budget_blocks
        if short > 0:
            victims = self._budget_victims(
                short, candidate.expected_loss_s(now), now, waiting_programs
            )
            if victims is None:
                return PinResult(False, ttl, released, "over the pinned-block budget")
            for victim in victims:
                self._remove(victim.program_id)
                released.append((victim, ReleaseReason.BUDGET))
                self._notify(victim, ReleaseReason.BUDGET)
        self._generation += 1
        candidate.generation = self._generation
        self._pins[program_id] = candidate
        self._pinned_blocks += blocks
        heapq.heappush(self._heap, (candidate.expires_at, candidate.generation, program_id))
        if len(self._heap) > 4 * len(self._pins) + 64:
            self._compact()
        return PinResult(True, ttl, released)

    def _budget_victims(
        self, short: int, new_loss: float, now: float, waiting: Collection[str]
    ) -> list[Pin[H]] | None:
        if short > self.budget_blocks:
            return None
        cheaper = [p for p in self._pins.values() if p.expected_loss_s(now) < new_loss]
        victims = choose_victims(cheaper, short, now, waiting, allow_waiting=False)
        if sum(v.blocks for v in victims) < short:
            return None
        return victims

    def extend(self, program_id: str, now: float, ttl_s: float) -> Pin[H] | None:
        """Hold the program's pin until at least ``now + min(ttl_s, ttl_cap_s)`` (never
        shorter than it stands); ``None`` when the program holds no pin."""
        pin = self._pins.get(program_id)
        if pin is None:
            return None
        ttl = clip_ttl(float(ttl_s), ceiling_s=None, cap_s=self.ttl_cap_s)
        if now + ttl > pin.expires_at:
            pin.expires_at = now + ttl
            pin.ttl_s = pin.expires_at - pin.pinned_at
            self._generation += 1
            pin.generation = self._generation
            self._overdue.discard(program_id)
            heapq.heappush(self._heap, (pin.expires_at, pin.generation, program_id))
        return pin

    # -- ending pins -------------------------------------------------------------------
    def release(self, program_id: str, reason: ReleaseReason) -> Pin[H] | None:
        """End the program's pin (if any) for ``reason`` and return it."""
        pin = self._remove(program_id)
        if pin is not None:
            self._notify(pin, reason)
        return pin

    def admitted(self, program_id: str) -> Pin[H] | None:
        """The program's next request was admitted: its prefix hit takes over (``HIT``)."""
        return self.release(program_id, ReleaseReason.HIT)

    def program_end(self, program_id: str) -> Pin[H] | None:
        """The program finished: release its pin (``PROGRAM_END``)."""
        return self.release(program_id, ReleaseReason.PROGRAM_END)

    def release_all(self, reason: ReleaseReason = ReleaseReason.SHUTDOWN) -> list[Pin[H]]:
        """End every pin (prefix-cache reset, shutdown)."""
        return [p for p in (self.release(pid, reason) for pid in list(self._pins)) if p]

    def expire(
        self, now: float, waiting_programs: Collection[str]
    ) -> list[tuple[Pin[H], ReleaseReason]]:
        """Release every pin past its expiry whose program has no request waiting.

        Expiry is strict: a pin is held through ``now == expires_at`` and released at the
        first call with ``now > expires_at`` (the paper's Algorithm 1 releases after the
        TTL, not at it). An overdue pin whose program's next request is already waiting is kept (its
        admission will hand the blocks over) and re-checked on later calls. Cost: O(k log n)
        for k expiries plus the overdue pins, never a scan of all pins.
        """
        released: list[tuple[Pin[H], ReleaseReason]] = []
        heap = self._heap
        while heap and heap[0][0] < now:
            _, generation, program_id = heapq.heappop(heap)
            pin = self._pins.get(program_id)
            if pin is not None and pin.generation == generation:
                self._overdue.add(program_id)
        for program_id in sorted(self._overdue):
            if program_id not in self._pins:
                self._overdue.discard(program_id)
            elif program_id not in waiting_programs:
                pin = self.release(program_id, ReleaseReason.TTL)
                if pin is not None:
                    released.append((pin, ReleaseReason.TTL))
        return released

    # -- internals ---------------------------------------------------------------------
    def _remove(self, program_id: str) -> Pin[H] | None:
        pin = self._pins.pop(program_id, None)
        if pin is not None:
            self._pinned_blocks -= pin.blocks
            self._overdue.discard(program_id)
        if not self._pins:
            self._heap.clear()
        return pin

    def _notify(self, pin: Pin[H], reason: ReleaseReason) -> None:
        if self.on_release is not None:
            self.on_release(pin, reason)

    def _compact(self) -> None:
        self._heap = [(p.expires_at, p.generation, p.program_id) for p in self._pins.values()]
        heapq.heapify(self._heap)

    def _drop_stale_heads(self) -> None:
        heap = self._heap
        while heap:
            _, generation, program_id = heap[0]
            pin = self._pins.get(program_id)
            if pin is not None and pin.generation == generation:
                return
            heapq.heappop(heap)


def _check_pin(program_id: str, blocks: int, ttl_s: float) -> None:
    if not program_id:
        raise ValueError("program_id must be a non-empty string")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        raise ValueError(f"blocks must be an integer >= 0, got {blocks!r}")
    if not math.isfinite(ttl_s) or ttl_s < 0:
        raise ValueError(f"ttl_s must be a finite number >= 0, got {ttl_s!r}")
