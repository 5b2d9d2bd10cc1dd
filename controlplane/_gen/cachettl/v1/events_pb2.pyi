import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PinOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIN_OUTCOME_UNSPECIFIED: _ClassVar[PinOutcome]
    PIN_OUTCOME_HIT: _ClassVar[PinOutcome]
    PIN_OUTCOME_EXPIRED: _ClassVar[PinOutcome]
    PIN_OUTCOME_RELEASED_UNDER_PRESSURE: _ClassVar[PinOutcome]
    PIN_OUTCOME_NOT_PINNED: _ClassVar[PinOutcome]
    PIN_OUTCOME_MOVED: _ClassVar[PinOutcome]

class MissReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS_REASON_UNSPECIFIED: _ClassVar[MissReason]
    MISS_REASON_HIT: _ClassVar[MissReason]
    MISS_REASON_PREFIX_CACHE: _ClassVar[MissReason]
    MISS_REASON_NOT_PINNED: _ClassVar[MissReason]
    MISS_REASON_EXPIRED: _ClassVar[MissReason]
    MISS_REASON_RELEASED_UNDER_PRESSURE: _ClassVar[MissReason]
    MISS_REASON_EVICTED: _ClassVar[MissReason]
    MISS_REASON_DIVERGED: _ClassVar[MissReason]

class NotPinnedCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOT_PINNED_CAUSE_UNSPECIFIED: _ClassVar[NotPinnedCause]
    NOT_PINNED_CAUSE_NO_TOOL: _ClassVar[NotPinnedCause]
    NOT_PINNED_CAUSE_CLIENT: _ClassVar[NotPinnedCause]
    NOT_PINNED_CAUSE_TTL_ZERO: _ClassVar[NotPinnedCause]
    NOT_PINNED_CAUSE_BUDGET: _ClassVar[NotPinnedCause]
PIN_OUTCOME_UNSPECIFIED: PinOutcome
PIN_OUTCOME_HIT: PinOutcome
PIN_OUTCOME_EXPIRED: PinOutcome
PIN_OUTCOME_RELEASED_UNDER_PRESSURE: PinOutcome
PIN_OUTCOME_NOT_PINNED: PinOutcome
PIN_OUTCOME_MOVED: PinOutcome
MISS_REASON_UNSPECIFIED: MissReason
MISS_REASON_HIT: MissReason
MISS_REASON_PREFIX_CACHE: MissReason
MISS_REASON_NOT_PINNED: MissReason
MISS_REASON_EXPIRED: MissReason
MISS_REASON_RELEASED_UNDER_PRESSURE: MissReason
MISS_REASON_EVICTED: MissReason
MISS_REASON_DIVERGED: MissReason
NOT_PINNED_CAUSE_UNSPECIFIED: NotPinnedCause
NOT_PINNED_CAUSE_NO_TOOL: NotPinnedCause
NOT_PINNED_CAUSE_CLIENT: NotPinnedCause
NOT_PINNED_CAUSE_TTL_ZERO: NotPinnedCause
NOT_PINNED_CAUSE_BUDGET: NotPinnedCause

class ToolCallEvent(_message.Message):
    __slots__ = ("event_id", "program_id", "tool_name", "tool_args", "duration", "finished_at", "turn_index", "chosen_ttl", "pin_outcome", "admission_delay", "miss_reason", "not_pinned_cause", "expired_by", "diverged_at_token", "hit_tokens", "reusable_tokens", "shadow")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_ARGS_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_TTL_FIELD_NUMBER: _ClassVar[int]
    PIN_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_DELAY_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    NOT_PINNED_CAUSE_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_BY_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    program_id: str
    tool_name: str
    tool_args: str
    duration: _duration_pb2.Duration
    finished_at: _timestamp_pb2.Timestamp
    turn_index: int
    chosen_ttl: _duration_pb2.Duration
    pin_outcome: PinOutcome
    admission_delay: _duration_pb2.Duration
    miss_reason: MissReason
    not_pinned_cause: NotPinnedCause
    expired_by: _duration_pb2.Duration
    diverged_at_token: int
    hit_tokens: int
    reusable_tokens: int
    shadow: bool
    def __init__(self, event_id: _Optional[str] = ..., program_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., tool_args: _Optional[str] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., turn_index: _Optional[int] = ..., chosen_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., pin_outcome: _Optional[_Union[PinOutcome, str]] = ..., admission_delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., not_pinned_cause: _Optional[_Union[NotPinnedCause, str]] = ..., expired_by: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., diverged_at_token: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., reusable_tokens: _Optional[int] = ..., shadow: _Optional[bool] = ...) -> None: ...

class RecordToolCallsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ToolCallEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[ToolCallEvent, _Mapping]]] = ...) -> None: ...

class RecordToolCallsResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "model_version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    model_version: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., model_version: _Optional[int] = ...) -> None: ...

class RecordProgramEndRequest(_message.Message):
    __slots__ = ("program_id", "total_turns", "finished_at")
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TURNS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    program_id: str
    total_turns: int
    finished_at: _timestamp_pb2.Timestamp
    def __init__(self, program_id: _Optional[str] = ..., total_turns: _Optional[int] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RecordProgramEndResponse(_message.Message):
    __slots__ = ("duplicate", "model_version")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    model_version: int
    def __init__(self, duplicate: _Optional[bool] = ..., model_version: _Optional[int] = ...) -> None: ...
