"""Tool-call tracking: tool durations, pin outcomes and admission delays, per program.

For each program the tracker follows one cycle per tool call::

    turn_finished(turn k, tool f) ─► [pin released: outcome] ─► arrived(turn k+1) ─► admitted

- tool duration = next arrival − finish of the turn that called the tool (measured in the
  engine, as the paper does);
- outcome of the pin (:class:`controlplane.records.PinOutcome`, the one vocabulary of the
  hook, the simulator and the control plane): ``HIT`` when the pin was still held at
  admission, otherwise why it ended (``EXPIRED``, ``RELEASED_UNDER_PRESSURE``), or
  ``NOT_PINNED``; ``UNSPECIFIED`` when it ended for a reason that is no outcome;
- admission delay = admission − arrival of the returning turn. When its cache had been
  released by a known cause (``PinOutcome.feeds_queue_delay``: expired, under pressure,
  not pinned) the delay is a sample of T, the queueing delay of returning unpinned
  requests; the control plane applies the same rule to the same events.

- what the returning turn found of its previous turn's cache
  (:class:`controlplane.records.TurnCache`: a :class:`~controlplane.records.MissReason`
  and its details), from the pin's story and what the host saw at admission
  (:class:`CacheSeen`: hit tokens, and either the returning request's block hashes, which
  the tracker compares with the previous turn's, kept by :meth:`keep_prefix`, or the
  reusable prefix the host knows). :func:`classify` applies the reasons' order.

``returned`` gives a :class:`ReturningTurn` for every returning turn (also after a turn
with no tool call, which has no event); ``admitted`` its :class:`ToolCallReport` with all
of the above; ``program_end`` a :class:`ProgramEndReport`. Event ids are
``<engine id>:<program>:<life>:<turn>`` (or ``:end``), unique per engine instance, so a
receiver can drop duplicates; ``<life>`` numbers the programs started on this tracker, so a
program id used again (after its end, or after it was forgotten as abandoned) gets fresh
ids instead of being dropped as a repeat of its first run. ``event_record`` /
``event_from_record`` are the events' one JSON form (event log, spill files).

Memory: one pending entry and a turn count per program known here, freed at the
program's end, by ``forget_idle`` (programs idle past ``idle_program_s``, whether their
last turn called a tool or not) and by ``forget`` (the controller's bound on programs,
``lifecycle.MAX_PROGRAMS``); at most ``PREFIX_BLOCKS_KEPT`` kept block hashes in all; past
it the oldest programs' prefixes are dropped (their returns are classified without a
divergence check).

>>> t = ToolCallTracker(engine_id="e1")
>>> t.turn_finished("p", 10.0, tool="bash", tool_args="ls", ttl_s=2.0, pinned=True)
0
>>> t.arrived("p", 10.5)
>>> ev = t.admitted("p", 10.6, pin_held=True)
>>> (ev.event_id, ev.duration_s, ev.pin_outcome.label, round(ev.admission_delay_s, 3))
('e1:p:0:0', 0.5, 'hit', 0.1)
>>> ev.queue_delay_sample, event_from_record(event_record(ev)) == ev
(False, True)
>>> t.program_end("p", 20.0).total_turns
1
>>> t.turn_finished("q", 0.0, tool="bash", ttl_s=1.0, pinned=True)
0
>>> t.keep_prefix("q", ["h0", "h1", "h2"])
True
>>> t.pin_released("q", ReleaseReason.TTL); t.arrived("q", 3.5)
>>> seen = CacheSeen(hit_tokens=16, prompt_tokens=80, block_hashes=["h0", "x1", "x2"])
>>> cache = t.returned("q", 3.6, pin_held=False, seen=seen).cache
>>> cache.reason.label, cache.diverged_at, cache.hit_tokens, cache.reusable_tokens
('diverged', 16, 16, 16)
>>> cache.expired_by_s is None  # the prompt diverged: how late the pin was explains nothing
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from controlplane.records import MissReason, NotPinnedCause, PinOutcome, TurnCache
from enginehook.core.pins import ReleaseReason

__all__ = [
    "PREFIX_BLOCKS_KEPT",
    "CacheSeen",
    "PinOutcome",
    "ProgramEndReport",
    "ReturningTurn",
    "ToolCallReport",
    "ToolCallTracker",
    "classify",
    "common_blocks",
    "event_from_record",
    "event_record",
    "outcome_of_release",
    "would_have_met",
]

#: Block hashes of previous turns a tracker keeps at most, all programs together (vLLM's
#: are 32-byte digests: about 20 MB), for the divergence check of returning turns.
PREFIX_BLOCKS_KEPT = 262_144

_OF_RELEASE = {
    ReleaseReason.HIT: PinOutcome.HIT,
    ReleaseReason.TTL: PinOutcome.EXPIRED,
    ReleaseReason.PRESSURE: PinOutcome.RELEASED_UNDER_PRESSURE,
    ReleaseReason.BUDGET: PinOutcome.RELEASED_UNDER_PRESSURE,
    ReleaseReason.MOVED: PinOutcome.MOVED,
    ReleaseReason.DROPPED: PinOutcome.MOVED,
}


def would_have_met(ttl_s: float, duration_s: float) -> PinOutcome:
    """What a shadow pin of ``ttl_s`` would have met for a tool call of ``duration_s``:
    ``HIT`` when the program came back within the TTL (its end included), ``EXPIRED``
    after it, ``NOT_PINNED`` for a TTL of 0 (the policy would not have pinned).

    >>> [would_have_met(2.0, d).label for d in (0.5, 2.0, 2.5)], would_have_met(0, 1).label
    (['hit', 'hit', 'expired'], 'not_pinned')
    """
    if ttl_s <= 0:
        return PinOutcome.NOT_PINNED
    return PinOutcome.HIT if duration_s <= ttl_s else PinOutcome.EXPIRED


def outcome_of_release(reason: ReleaseReason) -> PinOutcome:
    """The outcome recorded when a pin ends for ``reason`` before its program returns
    (``MOVED`` when its program went to another engine or a router dropped it for that;
    ``UNSPECIFIED`` for program end, replacement and shutdown)."""
    return _OF_RELEASE.get(reason, PinOutcome.UNSPECIFIED)


@dataclass(frozen=True, slots=True)
class ToolCallReport:
    """One finished tool call, as reported to the control plane's ``RecordToolCalls``; its
    fields are named as the control plane's ``ToolCall`` names them."""

    event_id: str
    program_id: str
    tenant: str
    tool: str
    tool_args: str | None
    duration_s: float
    finished_at: float
    turn_index: int
    chosen_ttl_s: float
    pin_outcome: PinOutcome
    admission_delay_s: float
    basis: str = ""
    #: What the returning turn found of this turn's cache (``UNSPECIFIED``: not observed).
    cache: TurnCache = field(default_factory=TurnCache)
    #: Shadow mode (:mod:`enginehook.core.rollout`): nothing was pinned; ``chosen_ttl_s``
    #: is the TTL that would have been, ``pin_outcome`` what that pin would have met.
    shadow: bool = False

    @property
    def queue_delay_sample(self) -> bool:
        """Whether ``admission_delay_s`` is a sample of T (``PinOutcome.feeds_queue_delay``)."""
        return self.pin_outcome.feeds_queue_delay


@dataclass(frozen=True, slots=True)
class ProgramEndReport:
    """A program ended after ``total_turns`` LLM calls (``RecordProgramEnd``)."""

    event_id: str
    program_id: str
    tenant: str
    total_turns: int
    finished_at: float


@dataclass(frozen=True, slots=True)
class CacheSeen:
    """What the host saw when a returning turn was admitted: the tokens its prefix hit
    served (``hit_tokens``; vLLM: ``num_computed_tokens`` at admission) out of
    ``prompt_tokens``, and either the request's ``block_hashes`` (of ``block_size``
    tokens each; compared with the previous turn's) or the ``reusable_tokens`` of its
    prompt that the previous turn's cache could serve, when the host knows them (the
    simulator, whose prompts always extend the previous context)."""

    hit_tokens: int
    prompt_tokens: int = 0
    block_hashes: Sequence[object] | None = None
    block_size: int = 16
    reusable_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ReturningTurn:
    """A returning turn as the tracker saw it at admission; ``event`` is its tool call
    (``None`` after a turn that called no tool)."""

    program_id: str
    cache: TurnCache
    event: ToolCallReport | None = None


@dataclass(slots=True)
class _Pending:
    tool: str | None
    tool_args: str | None
    finished_at: float
    turn_index: int
    ttl_s: float
    basis: str
    outcome: PinOutcome
    not_pinned: NotPinnedCause = NotPinnedCause.UNSPECIFIED
    arrived_at: float | None = None
    shadow: bool = False


def common_blocks(previous: Sequence[object], current: Sequence[object]) -> int:
    """Leading blocks whose hashes are equal in both sequences.

    Block hashes are chained (vLLM's cover their parent's hash: equal at block i means
    equal at every block before it), so a binary search finds the first difference in
    O(log n) comparisons; sequences without that property are not supported.

    >>> common_blocks("abc", "abxd"), common_blocks("ab", "abc"), common_blocks("", "a")
    (2, 2, 0)
    """
    low, high = 0, min(len(previous), len(current))  # blocks [0, low) are equal
    while low < high:
        mid = (low + high) // 2
        if previous[mid] == current[mid]:
            low = mid + 1
        else:
            high = mid
    return low


def classify(outcome: PinOutcome, pin_held: bool, cache: TurnCache) -> MissReason:
    """The returning turn's :class:`~controlplane.records.MissReason`, the first that
    applies in the order that enum documents. ``outcome``: what the pin tracking says
    (``HIT`` when it was still held); ``cache``: what the host saw (hit tokens, reusable
    tokens, divergence; ``None`` fields: not observed, then only the pin's story counts).

    >>> seen = TurnCache(hit_tokens=0, reusable_tokens=64)
    >>> classify(PinOutcome.EXPIRED, False, seen).label
    'expired'
    >>> classify(PinOutcome.EXPIRED, False, replace(seen, hit_tokens=64)).label
    'prefix_cache'
    >>> classify(PinOutcome.HIT, True, replace(seen, hit_tokens=32)).label
    'evicted'
    >>> classify(PinOutcome.HIT, True, TurnCache(hit_tokens=32, reusable_tokens=32,
    ...                                          diverged_at=32)).label
    'diverged'
    >>> classify(PinOutcome.NOT_PINNED, False, TurnCache()).label
    'not_pinned'
    """
    hit, reusable = cache.hit_tokens, cache.reusable_tokens
    if hit is None or reusable is None:
        if pin_held:
            return MissReason.HIT
        return _REASON_OF.get(outcome, MissReason.UNSPECIFIED)
    served = hit >= reusable
    if cache.diverged_at is not None and (pin_held or served):
        return MissReason.DIVERGED
    if pin_held:
        return MissReason.HIT if served else MissReason.EVICTED
    if served:
        return MissReason.PREFIX_CACHE
    return _REASON_OF.get(outcome, MissReason.EVICTED)


#: The miss reasons that carry how late the program came back after its pin expired (the
#: control plane's rule, ``controlplane.validation``).
_EXPIRED_BY = frozenset({MissReason.EXPIRED, MissReason.PREFIX_CACHE})
#: The miss reasons that carry why no pin was taken.
_WITH_CAUSE = frozenset({MissReason.NOT_PINNED, MissReason.PREFIX_CACHE})

_REASON_OF = {
    PinOutcome.NOT_PINNED: MissReason.NOT_PINNED,
    PinOutcome.EXPIRED: MissReason.EXPIRED,
    PinOutcome.RELEASED_UNDER_PRESSURE: MissReason.RELEASED_UNDER_PRESSURE,
}


def _compare(
    previous: Sequence[object] | None, seen: CacheSeen | None
) -> tuple[int | None, int | None, int | None]:
    """``(hit tokens, reusable tokens, diverged-at token)`` from what the host saw and
    the previous turn's kept block hashes (block-exact: k is the first token of the first
    differing block; vLLM never serves a prompt's last token from cache)."""
    if seen is None:
        return None, None, None
    if seen.block_hashes is None or previous is None:
        return seen.hit_tokens, seen.reusable_tokens, None
    size = seen.block_size
    common = common_blocks(previous, seen.block_hashes)
    reusable = min(common, max(0, (seen.prompt_tokens - 1) // size)) * size
    diverged = common < min(len(previous), len(seen.block_hashes))
    return seen.hit_tokens, reusable, common * size if diverged else None


class ToolCallTracker:
    """Per-program bookkeeping of tool calls (engine-independent, times passed in)."""

    def __init__(self, engine_id: str, tenant: str = "default") -> None:
        if not engine_id:
            raise ValueError("engine_id must be a non-empty string")
        self.engine_id = engine_id
        self.tenant = tenant
        self._turns: dict[str, int] = {}
        #: Each live program's number among the programs started here (see event ids).
        self._lives: dict[str, int] = {}
        self._started = 0
        self._pending: dict[str, _Pending] = {}
        #: Previous turns' block hashes, oldest first, and how many they are in all.
        self._prefixes: dict[str, Sequence[object]] = {}
        self._prefix_blocks = 0

    def turns_served(self, program_id: str) -> int:
        """LLM calls of the program finished so far."""
        return self._turns.get(program_id, 0)

    def turn_finished(
        self,
        program_id: str,
        now: float,
        *,
        tool: str | None,
        tool_args: str | None = None,
        ttl_s: float = 0.0,
        pinned: bool = False,
        basis: str = "",
        not_pinned: NotPinnedCause = NotPinnedCause.TTL_ZERO,
        shadow: bool = False,
    ) -> int:
        """A turn of the program finished; ``tool`` is the tool it called (``None``: no
        tool call). ``not_pinned``: why no pin was taken, when ``pinned`` is false.
        ``shadow``: nothing was pinned (shadow mode, or a tool outside the rollout) and
        ``ttl_s`` is the TTL that would have been: the event reports what that pin would
        have met, ``HIT`` when the program returns within it, ``EXPIRED`` otherwise,
        ``NOT_PINNED`` for a TTL of 0. Returns the turn's index (0-based)."""
        turn = self._turns.get(program_id, 0)
        self._turns[program_id] = turn + 1
        if program_id not in self._lives:  # its first turn here (maybe not its first)
            self._lives[program_id] = self._started
            self._started += 1
        self._drop_prefix(program_id)
        outcome = PinOutcome.HIT if pinned else PinOutcome.NOT_PINNED
        if tool is None:
            ttl_s, pinned, not_pinned, shadow = 0.0, False, NotPinnedCause.NO_TOOL, False
        if shadow:  # the cache really was released: the returning turn's miss says so
            pinned, outcome = False, PinOutcome.NOT_PINNED
            not_pinned = NotPinnedCause.TTL_ZERO if ttl_s <= 0 else NotPinnedCause.UNSPECIFIED
        cause = NotPinnedCause.UNSPECIFIED if pinned else not_pinned
        self._pending[program_id] = _Pending(
            tool, tool_args, now, turn, ttl_s, basis, outcome, cause, shadow=shadow
        )
        return turn

    def keep_prefix(self, program_id: str, block_hashes: Sequence[object]) -> bool:
        """Keep the block hashes of the program's just finished turn (its cached prefix)
        until its next turn is admitted, for the divergence check; ``False`` when the
        program has no turn waiting to return."""
        pending = self._pending.get(program_id)
        if pending is None or pending.arrived_at is not None:
            return False
        self._drop_prefix(program_id)
        self._prefixes[program_id] = block_hashes
        self._prefix_blocks += len(block_hashes)
        while self._prefix_blocks > PREFIX_BLOCKS_KEPT:
            self._drop_prefix(next(iter(self._prefixes)))
        return program_id in self._prefixes

    def _drop_prefix(self, program_id: str) -> Sequence[object] | None:
        kept = self._prefixes.pop(program_id, None)
        if kept is not None:
            self._prefix_blocks -= len(kept)
        return kept

    def pin_released(self, program_id: str, reason: ReleaseReason) -> None:
        """The program's pin ended before its next request was admitted."""
        pending = self._pending.get(program_id)
        pinned = pending is not None and pending.outcome is PinOutcome.HIT
        if pending is not None and pinned and reason is not ReleaseReason.HIT:
            pending.outcome = outcome_of_release(reason)

    def arrived(self, program_id: str, now: float, turns: int | None = None) -> None:
        """The program's next request arrived (ends the tool call's duration); ``turns``:
        the turns it finished before, anywhere (the client's count): its turns are counted
        from at least there (:mod:`enginehook.hints.turns`)."""
        if turns is not None and turns > self._turns.get(program_id, 0):
            self._turns[program_id] = turns
        pending = self._pending.get(program_id)
        if pending is not None and pending.arrived_at is None:
            pending.arrived_at = max(now, pending.finished_at)

    def returning(self, program_id: str) -> bool:
        """Whether the program has a tool call waiting for its next turn's admission."""
        pending = self._pending.get(program_id)
        return pending is not None and pending.tool is not None and pending.arrived_at is not None

    def admitted(
        self, program_id: str, now: float, *, pin_held: bool, seen: CacheSeen | None = None
    ) -> ToolCallReport | None:
        """The program's next request was admitted; ``pin_held``: its pin was still live;
        ``seen``: what the host saw of its cache (see :meth:`returned`).

        Returns the completed tool-call event, or ``None`` when no tool call was pending.
        """
        turn = self.returned(program_id, now, pin_held=pin_held, seen=seen)
        return turn.event if turn is not None else None

    def returned(
        self, program_id: str, now: float, *, pin_held: bool, seen: CacheSeen | None = None
    ) -> ReturningTurn | None:
        """The program's next request was admitted: what it found of its previous turn's
        cache and, when that turn called a tool, the completed tool-call event. ``None``
        when the program had no finished turn waiting to return."""
        pending = self._pending.get(program_id)
        if pending is None or pending.arrived_at is None:
            return None
        del self._pending[program_id]
        previous = self._drop_prefix(program_id)
        outcome = pending.outcome
        if outcome is PinOutcome.HIT and not pin_held:
            outcome = PinOutcome.UNSPECIFIED  # released without our seeing why
        hit, reusable, diverged = _compare(previous, seen)
        expired_by = None
        if outcome is PinOutcome.EXPIRED:
            expired_by = max(0.0, pending.arrived_at - (pending.finished_at + pending.ttl_s))
        cache = TurnCache(
            MissReason.UNSPECIFIED,
            pending.not_pinned if outcome is PinOutcome.NOT_PINNED else NotPinnedCause.UNSPECIFIED,
            expired_by,
            diverged,
            hit,
            reusable,
        )
        cache = replace(cache, reason=classify(outcome, pin_held, cache))
        if cache.reason not in _EXPIRED_BY:  # the pin's lateness explains no other miss
            cache = replace(cache, expired_by_s=None)
        if cache.reason not in _WITH_CAUSE:  # nor does why no pin was taken
            cache = replace(cache, not_pinned_cause=NotPinnedCause.UNSPECIFIED)
        if pending.tool is None:
            return ReturningTurn(program_id, cache)
        duration_s, delay_s = pending.arrived_at - pending.finished_at, now - pending.arrived_at
        if pending.shadow:
            outcome = would_have_met(pending.ttl_s, duration_s)
        event = self._call(program_id, pending, duration_s, outcome, max(0.0, delay_s), cache)
        return ReturningTurn(program_id, cache, event)

    def moved(self, program_id: str, arrived_at: float) -> ToolCallReport | None:
        """The program's next turn arrived at another engine at ``arrived_at``: the tool
        call it left here ended then (its event is returned, with that duration and no
        admission delay seen here), and everything this engine knew of the program is
        forgotten, so that a later return here starts afresh instead of counting the time
        away as one long tool call."""
        pending = self._pending.pop(program_id, None)
        self._drop_prefix(program_id)
        self._turns.pop(program_id, None)
        self._lives.pop(program_id, None)
        if pending is None or pending.tool is None or pending.arrived_at is not None:
            return None
        # whatever its pin did here, the next turn was admitted elsewhere: no sample of T
        duration_s = max(0.0, arrived_at - pending.finished_at)
        return self._call(program_id, pending, duration_s, PinOutcome.MOVED, 0.0)

    def _call(
        self,
        program_id: str,
        p: _Pending,
        duration_s: float,
        outcome: PinOutcome,
        delay_s: float,
        cache: TurnCache | None = None,
    ) -> ToolCallReport:
        """The tool-call event of the program's pending turn ``p`` (which called a tool)."""
        assert p.tool is not None
        event_id = self._event_id(program_id, p.turn_index)
        return ToolCallReport(
            event_id, program_id, self.tenant, p.tool, p.tool_args, duration_s, p.finished_at,
            p.turn_index, p.ttl_s, outcome, delay_s, p.basis, cache or TurnCache(), p.shadow,
        )  # fmt: skip

    def program_end(self, program_id: str, now: float) -> ProgramEndReport | None:
        """The program ended; ``None`` if it never finished a turn here."""
        self._pending.pop(program_id, None)
        self._drop_prefix(program_id)
        if program_id not in self._turns:
            return None
        event_id = self._event_id(program_id, "end")
        turns = self._end(program_id)
        return ProgramEndReport(event_id, program_id, self.tenant, turns, now)

    def _event_id(self, program_id: str, turn: int | str) -> str:
        return f"{self.engine_id}:{program_id}:{self._lives.get(program_id, 0)}:{turn}"

    def _end(self, program_id: str) -> int:
        """Forget the program's life; returns the turns it was served."""
        self._lives.pop(program_id, None)
        return self._turns.pop(program_id, 0)

    def forget_idle(
        self, now: float, idle_s: float, quiet: list[str] | None = None
    ) -> list[ProgramEndReport]:
        """Drop programs whose last tool call finished over ``idle_s`` ago without a return
        (abandoned programs: an agent stopped by its step limit, a client gone), so memory
        stays bounded. Returns each one's end, ``total_turns`` the turns it was served and
        ``ended_at`` its last turn's finish: the program did end there, and leaving it out
        would bias the turn-count statistics towards programs that say when they end. A
        program whose last turn called no tool is forgotten without an end (a chat that
        may go on; its next turn starts afresh); its id is appended to ``quiet``."""
        stale = [
            pid
            for pid, p in self._pending.items()
            if p.arrived_at is None and now - p.finished_at > idle_s
        ]
        ended = []
        for pid in stale:
            self._drop_prefix(pid)
            pending = self._pending.pop(pid)
            if pending.tool is not None and pid in self._turns:
                event_id = self._event_id(pid, "end")
                turns = self._end(pid)
                ended.append(
                    ProgramEndReport(event_id, pid, self.tenant, turns, pending.finished_at)
                )
            else:
                self._end(pid)
                if quiet is not None:
                    quiet.append(pid)
        return ended

    def forget(self, program_id: str) -> None:
        """Forget everything known of the program (no event: the controller's bound on
        programs made room); its next turn here starts afresh."""
        self._pending.pop(program_id, None)
        self._drop_prefix(program_id)
        self._end(program_id)

    def __len__(self) -> int:
        return len(self._turns)


def event_record(event: ToolCallReport | ProgramEndReport) -> dict[str, Any]:
    """The event as a JSON-ready dict with its ``kind`` (outcome and reasons by label)."""
    kind = "tool_call" if isinstance(event, ToolCallReport) else "program_end"
    record: dict[str, Any] = {"kind": kind, **asdict(event)}
    if isinstance(event, ToolCallReport):
        record["pin_outcome"] = event.pin_outcome.label
        record["cache"]["reason"] = event.cache.reason.label
        record["cache"]["not_pinned_cause"] = event.cache.not_pinned_cause.label
    return record


def event_from_record(record: Mapping[str, Any]) -> ToolCallReport | ProgramEndReport:
    """The inverse of :func:`event_record`. Also reads records of earlier releases (spill
    files and event logs written before): without ``cache``, and with the keys the hook once
    named otherwise (``tool_name``, ``ttl_s``, ``outcome``, ``ended_at``)."""
    data = {_RENAMED.get(key, key): value for key, value in record.items()}
    kind = data.pop("kind")
    if kind == "program_end":
        return ProgramEndReport(**data)
    if kind != "tool_call":
        raise ValueError(f"kind must be 'tool_call' or 'program_end', got {kind!r}")
    data["pin_outcome"] = PinOutcome.parse(data["pin_outcome"])
    cache = dict(data.pop("cache", None) or {})
    if cache:
        cache["reason"] = MissReason.parse(cache.get("reason", 0))
        cache["not_pinned_cause"] = NotPinnedCause.parse(cache.get("not_pinned_cause", 0))
        data["cache"] = TurnCache(**cache)
    return ToolCallReport(**data)


#: Keys of records written by earlier releases -> today's field names.
_RENAMED = {
    "tool_name": "tool",
    "ttl_s": "chosen_ttl_s",
    "outcome": "pin_outcome",
    "ended_at": "finished_at",
}
