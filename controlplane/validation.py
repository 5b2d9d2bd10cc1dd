"""Decode and check wire messages; every error names the field and the limit.

Limits live in ``controlplane.records.LIMITS`` (and controlplane/README.md). A batch is
checked whole before anything is stored, so a rejected batch stores nothing.
"""

from __future__ import annotations

from typing import Any, NoReturn

from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.protobuf.unknown_fields import UnknownFieldSet

from controlplane import wire
from controlplane._gen.cachettl.v1 import events_pb2, inspect_pb2, ttl_pb2
from controlplane.errors import InvalidInputError
from controlplane.records import (
    LIMITS,
    Limits,
    MissReason,
    NotPinnedCause,
    PinOutcome,
    ProgramEnd,
    ToolCall,
    TurnCache,
)
from estimator import RequestFacts

__all__ = [
    "check_name",
    "decide_request",
    "distribution_request",
    "misses_request",
    "program_end",
    "tool_calls",
]


def check_name(field: str, value: str, limit_name: str, required: bool = True) -> str:
    """A name or text field: at most ``LIMITS.<limit_name>`` characters, no NUL."""
    limit = getattr(LIMITS, limit_name)
    if required and not value:
        raise InvalidInputError(field, f"must be 1..{limit} characters, got an empty string")
    if len(value) > limit:
        raise InvalidInputError(field, f"must be at most {limit} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidInputError(field, "must not contain NUL characters")
    return value


def check_known(field: str, message: Message) -> None:
    """Reject fields this server does not know (a client built for a newer contract)."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = ", ".join(str(unknown[i].field_number) for i in range(len(unknown)))
        raise InvalidInputError(field, f"unknown field number(s) {numbers}")


def duration_s(
    field: str, value: Duration, limits: Limits = LIMITS, maximum: float | None = None
) -> float:
    """A Duration as seconds: 0 <= d <= maximum (default: the maximum tool duration)."""
    check_known(field, value)
    limit = limits.max_duration_s if maximum is None else maximum
    if not -999_999_999 <= value.nanos <= 999_999_999:
        raise InvalidInputError(field, f"nanos must be in ±999999999, got {value.nanos}")
    seconds = wire.seconds(value)
    if seconds < 0 or value.nanos < 0:
        raise InvalidInputError(field, f"must be >= 0, got {seconds!r} s")
    if seconds > limit:
        raise InvalidInputError(field, f"must be at most {limit:g} s, got {seconds!r} s")
    return seconds


def timestamp_s(field: str, value: Timestamp) -> float:
    check_known(field, value)
    if not 0 <= value.nanos <= 999_999_999:
        raise InvalidInputError(field, f"nanos must be in 0..999999999, got {value.nanos}")
    if not 0 <= value.seconds <= 253_402_300_799:  # 9999-12-31
        raise InvalidInputError(field, "must be between 1970 and 9999")
    return wire.timestamp_seconds(value)


def _name_ok(value: str, limit: int, required: bool = True) -> bool:
    """``check_name``'s rule, without building the field's name (a batch's fast path)."""
    return (bool(value) or not required) and len(value) <= limit and "\x00" not in value


def _tool_call(i: int, event: events_pb2.ToolCallEvent, limits: Limits) -> ToolCall:
    """One event, checked. The common case, every field valid, builds no field name: the
    checks that fail are run again through the named ones, so an error says the same."""
    names = (event.event_id, event.program_id, event.tool_name, event.tool_args)
    outcome = _PIN_OUTCOMES.get(event.pin_outcome)
    if (
        outcome is None
        or len(UnknownFieldSet(event))
        or not event.HasField("duration")
        or not _name_ok(names[0], LIMITS.event_id)
        or not _name_ok(names[1], LIMITS.program_id)
        or not _name_ok(names[2], LIMITS.tool_name)
        or not _name_ok(names[3], LIMITS.tool_args, required=False)
    ):
        _explain(f"events[{i}]", event)
    at = f"events[{i}]"
    return ToolCall(
        event_id=names[0],
        program_id=names[1],
        tool=names[2],
        tool_args=names[3],
        duration_s=_seconds(at, "duration", event.duration, limits),
        finished_at=(
            timestamp_s(f"{at}.finished_at", event.finished_at)
            if event.HasField("finished_at")
            else None
        ),
        turn_index=event.turn_index,
        chosen_ttl_s=(
            _seconds(at, "chosen_ttl", event.chosen_ttl, limits)
            if event.HasField("chosen_ttl")
            else None
        ),
        pin_outcome=outcome,
        admission_delay_s=(
            _seconds(at, "admission_delay", event.admission_delay, limits)
            if event.HasField("admission_delay")
            else None
        ),
        cache=_turn_cache(at, event, limits),
        shadow=event.shadow,
    )


def _seconds(at: str, name: str, value: Duration, limits: Limits) -> float:
    """:func:`duration_s` of field ``name`` of event ``at``, the field's name built only
    for an error."""
    seconds = value.seconds + value.nanos / 1e9
    if (
        0 <= value.nanos <= 999_999_999
        and value.seconds >= 0
        and seconds <= limits.max_duration_s
        and not len(UnknownFieldSet(value))
    ):
        return seconds
    return duration_s(f"{at}.{name}", value, limits)


def _explain(at: str, event: events_pb2.ToolCallEvent) -> NoReturn:
    """Raise the error of the first bad field of ``event``'s head (the fast path found one)."""
    check_known(at, event)
    if event.pin_outcome not in _PIN_OUTCOMES:
        raise InvalidInputError(f"{at}.pin_outcome", f"unknown value {event.pin_outcome}")
    if not event.HasField("duration"):
        raise InvalidInputError(f"{at}.duration", "is required")
    check_name(f"{at}.event_id", event.event_id, "event_id")
    check_name(f"{at}.program_id", event.program_id, "program_id")
    check_name(f"{at}.tool_name", event.tool_name, "tool_name")
    check_name(f"{at}.tool_args", event.tool_args, "tool_args", required=False)
    raise AssertionError(f"{at}: the fast check and the named checks disagree")


def _optional_count(at: str, event: events_pb2.ToolCallEvent, field: str) -> int | None:
    if not event.HasField(field):
        return None
    return _tokens(f"{at}.{field}", getattr(event, field), LIMITS.context_tokens)


_PIN_OUTCOMES: dict[int, PinOutcome] = {m.value: m for m in PinOutcome}
_WITH_CAUSE = frozenset({MissReason.NOT_PINNED, MissReason.PREFIX_CACHE})
_WITH_EXPIRY = frozenset({MissReason.EXPIRED, MissReason.PREFIX_CACHE})
#: What a turn with no cache report found (every field unset): one shared value.
_NO_CACHE = TurnCache()
_CACHE_FIELDS = ("expired_by", "diverged_at_token", "hit_tokens", "reusable_tokens")


def _turn_cache(at: str, event: events_pb2.ToolCallEvent, limits: Limits) -> TurnCache:
    """The returning turn's cache report; every field optional, each checked."""
    if not (event.miss_reason or event.not_pinned_cause) and not any(
        event.HasField(f) for f in _CACHE_FIELDS
    ):
        return _NO_CACHE
    reason = _enum(f"{at}.miss_reason", event.miss_reason, MissReason)
    # A turn the prefix cache served after all keeps its pin's story (no pin taken, and
    # why; or how late after its pin's expiry it came back).
    cause = _enum(f"{at}.not_pinned_cause", event.not_pinned_cause, NotPinnedCause)
    if cause is not NotPinnedCause.UNSPECIFIED and reason not in _WITH_CAUSE:
        raise InvalidInputError(
            f"{at}.not_pinned_cause",
            f"only with miss_reason NOT_PINNED or PREFIX_CACHE, got {reason.name}",
        )
    expired_by = None
    if event.HasField("expired_by"):
        if reason not in _WITH_EXPIRY:
            raise InvalidInputError(
                f"{at}.expired_by",
                f"only with miss_reason EXPIRED or PREFIX_CACHE, got {reason.name}",
            )
        expired_by = duration_s(f"{at}.expired_by", event.expired_by, limits)
    hit = _optional_count(at, event, "hit_tokens")
    reusable = _optional_count(at, event, "reusable_tokens")
    return TurnCache(
        reason,
        cause,
        expired_by,
        _optional_count(at, event, "diverged_at_token"),
        hit,
        reusable,
    )


def _enum(field: str, value: int, kind: type[MissReason] | type[NotPinnedCause]) -> Any:
    member = kind._value2member_map_.get(value)
    if member is None:
        valid = ", ".join(f"{m.value} ({m.name})" for m in kind)
        raise InvalidInputError(field, f"unknown value {value}; valid: {valid}")
    return member


def tool_calls(
    request: events_pb2.RecordToolCallsRequest, limits: Limits = LIMITS
) -> list[ToolCall]:
    """The batch's calls, all checked; raises on the first bad field."""
    check_known("request", request)
    n = len(request.events)
    if n == 0:
        raise InvalidInputError("events", f"must hold 1..{limits.batch_events} events, got 0")
    if n > limits.batch_events:
        raise InvalidInputError(
            "events", f"must hold at most {limits.batch_events} events, got {n}"
        )
    return [_tool_call(i, e, limits) for i, e in enumerate(request.events)]


def program_end(request: events_pb2.RecordProgramEndRequest) -> ProgramEnd:
    check_known("request", request)
    program = check_name("program_id", request.program_id, "program_id")
    if not 1 <= request.total_turns <= LIMITS.total_turns:
        raise InvalidInputError(
            "total_turns", f"must be in 1..{LIMITS.total_turns}, got {request.total_turns}"
        )
    finished = (
        timestamp_s("finished_at", request.finished_at) if request.HasField("finished_at") else None
    )
    return ProgramEnd(program, request.total_turns, finished)


def _tokens(field: str, value: int, limit: int) -> int:
    if value > limit:
        raise InvalidInputError(field, f"must be at most {limit}, got {value}")
    return value


def _optional_tokens(request: ttl_pb2.DecideTtlRequest, field: str, limit: int) -> int | None:
    """A proto3 ``optional`` token count: None when the caller did not set it."""
    return _tokens(field, getattr(request, field), limit) if request.HasField(field) else None


def _optional_duration(
    request: ttl_pb2.DecideTtlRequest, field: str, limits: Limits
) -> float | None:
    return duration_s(field, getattr(request, field), limits) if request.HasField(field) else None


def decide_request(request: ttl_pb2.DecideTtlRequest, limits: Limits = LIMITS) -> RequestFacts:
    """The facts of a ``DecideTtl`` request. Their ``tenant`` and ``share`` are left at
    the defaults: the service fills them in from the caller's token."""
    check_known("request", request)
    context = _tokens("context_tokens", request.context_tokens, limits.context_tokens)
    offloaded = _optional_tokens(request, "offloaded_tokens", limits.context_tokens)
    if offloaded is not None and offloaded > context:
        raise InvalidInputError(
            "offloaded_tokens", f"must be at most context_tokens ({context}), got {offloaded}"
        )
    args = check_name("tool_args", request.tool_args, "tool_args", required=False)
    program = check_name("program_id", request.program_id, "program_id", required=False)
    return RequestFacts(
        tool=check_name("tool_name", request.tool_name, "tool_name"),
        tool_args=args or None,
        context_tokens=context,
        program_id=program or None,
        turns_served=request.turns_served,
        reload_cost_s=_optional_duration(request, "reload_cost", limits),
        queue_delay_s=_optional_duration(request, "queue_delay", limits),
        offload=request.offload,
        waiting_tokens=_optional_tokens(request, "waiting_tokens", limits.context_tokens),
        free_tokens=_optional_tokens(request, "free_tokens", limits.context_tokens),
        offloaded_tokens=offloaded,
    )


def distribution_request(
    request: inspect_pb2.GetToolDistributionRequest,
) -> tuple[str, str, int]:
    check_known("request", request)
    tool = check_name("tool_name", request.tool_name, "tool_name")
    args = check_name("tool_args", request.tool_args, "tool_args", required=False)
    if request.cdf_points > LIMITS.cdf_points:
        raise InvalidInputError(
            "cdf_points", f"must be at most {LIMITS.cdf_points}, got {request.cdf_points}"
        )
    return tool, args, request.cdf_points or 50


def misses_request(
    request: inspect_pb2.ListMissesRequest,
) -> tuple[str | None, str | None, MissReason | None, int]:
    """``(tool, program, reason, limit)`` of a ``ListMisses`` request (``None``: any)."""
    check_known("request", request)
    tool = check_name("tool_name", request.tool_name, "tool_name", required=False)
    program = check_name("program_id", request.program_id, "program_id", required=False)
    reason = _enum("reason", request.reason, MissReason)
    if reason is not MissReason.UNSPECIFIED and not reason.missed:
        raise InvalidInputError("reason", f"must be a miss reason, got {reason.name}")
    if request.limit > LIMITS.misses_listed:
        raise InvalidInputError(
            "limit", f"must be at most {LIMITS.misses_listed}, got {request.limit}"
        )
    chosen = None if reason is MissReason.UNSPECIFIED else reason
    return tool or None, program or None, chosen, request.limit or 50
