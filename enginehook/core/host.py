"""What a host and the pin controller exchange: each finished turn as the engine saw it
(:class:`FinishedTurn`), the engine itself (:class:`EngineHost`: free KV, the waiting queue,
giving a pinned handle back, receiving events), the TTL policy (:class:`Decider`), and the
controller's answers (:class:`Admitted`, :class:`Finish`).

Both hosts implement these: the vLLM hook (:mod:`enginehook.vllm.scheduler`) and the
simulator (:class:`simulator.sim.Simulation`); the controller
(:class:`enginehook.core.lifecycle.PinController`) knows nothing else of them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from enginehook.core.pins import Pin, ReleaseReason
from enginehook.core.tracker import ProgramEndReport, ReturningTurn, ToolCallReport
from estimator import Decision, RequestFacts

__all__ = ["Admitted", "Decider", "EngineHost", "Finish", "FinishedTurn"]

H = TypeVar("H")


@dataclass(frozen=True, slots=True)
class FinishedTurn:
    """A turn that just finished decoding, as its engine saw it.

    ``tool``: the tool it called (``None``: none). ``last_turn``: the program ends here.
    ``pin``: the client allows pinning this turn. ``offloaded_tokens``: how much of the
    context a CPU tier holds (``None``: all of it, when a tier is on). ``service_s``: model
    time the turn took (attained service); ``output_tokens``: tokens it generated (with
    ``context_tokens``, its weighted-token service: prompt + 2 × output). ``pin_ttl_s``:
    the TTL the client set for this turn (the decider should honour it). ``pin_ttl_max_s``:
    the most the client lets this turn be pinned (caps the decided TTL; the rules'
    ``ttl_cap_s`` still applies on top; :mod:`enginehook.core.ttl`). ``true_duration_s``:
    the tool's real duration, known only to a simulator (the oracle policy uses it).
    """

    program_id: str
    tool: str | None
    tool_args: str | None = None
    context_tokens: int = 0
    tenant: str = "default"
    last_turn: bool = False
    pin: bool = True
    offloaded_tokens: int | None = None
    service_s: float = 0.0
    output_tokens: int = 0
    pin_ttl_s: float | None = None
    true_duration_s: float | None = None
    pin_ttl_max_s: float | None = None


class Decider(Protocol):
    """The TTL policy the controller asks (the hook's :class:`enginehook.link.decide.TtlDecider`
    adapter, or a simulator policy)."""

    def decide(self, facts: RequestFacts, turn: FinishedTurn) -> Decision: ...


class EngineHost(Protocol[H]):
    """What the controller asks of, and tells, the engine around it."""

    def free_tokens(self) -> int:
        """KV tokens free now."""
        ...

    def waiting_requests(self) -> Iterable[tuple[str | None, int]]:
        """``(program id, prompt tokens)`` of each waiting request, in queue order."""
        ...

    def waiting_programs(self) -> Collection[str]:
        """Programs with a request waiting (a cheap live view)."""
        ...

    def pinned_tokens(self, pin: Pin[H]) -> int:
        """Tokens of its program's next prompt that ``pin`` covers."""
        ...

    def pin_released(self, pin: Pin[H], reason: ReleaseReason) -> None:
        """A pin ended: give its handle back (for ``HIT`` the admitted request took it)."""
        ...

    def emit(self, event: ToolCallReport | ProgramEndReport) -> None:
        """A completed tool call or program end, to learn from and report."""
        ...


class Admitted(NamedTuple, Generic[H]):
    """What :meth:`~enginehook.core.lifecycle.PinController.admitted` found: the pin
    handed over and the returning turn (either may be ``None``)."""

    pin: Pin[H] | None
    turn: ReturningTurn | None


@dataclass(frozen=True, slots=True)
class Finish(Generic[H]):
    """What :meth:`~enginehook.core.lifecycle.PinController.finished` did. ``took``: the
    host's ``take`` was called and returned ``handle``, which now belongs to the pin or,
    when not ``pinned`` (the budget refused it), is the host's to free. ``shadow``: the
    turn's tool is outside the rollout in force (:mod:`enginehook.core.rollout`):
    ``decision`` is the pin it would have made, and nothing was taken."""

    took: bool = False
    pinned: bool = False
    decision: Decision | None = None
    handle: H | None = None
    shadow: bool = False
