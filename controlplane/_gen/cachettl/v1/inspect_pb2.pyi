import datetime

from . import events_pb2 as _events_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListToolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinStats(_message.Message):
    __slots__ = ("hits", "expired", "released_under_pressure", "not_pinned", "hit_rate", "moved")
    HITS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_UNDER_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    NOT_PINNED_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    hits: int
    expired: int
    released_under_pressure: int
    not_pinned: int
    hit_rate: float
    moved: int
    def __init__(self, hits: _Optional[int] = ..., expired: _Optional[int] = ..., released_under_pressure: _Optional[int] = ..., not_pinned: _Optional[int] = ..., hit_rate: _Optional[float] = ..., moved: _Optional[int] = ...) -> None: ...

class ToolSummary(_message.Message):
    __slots__ = ("tool_name", "sample_count", "seen_count", "p50", "p90", "p99", "drift_epoch", "signatures", "pins")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    DRIFT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    sample_count: int
    seen_count: int
    p50: _duration_pb2.Duration
    p90: _duration_pb2.Duration
    p99: _duration_pb2.Duration
    drift_epoch: int
    signatures: _containers.RepeatedScalarFieldContainer[str]
    pins: PinStats
    def __init__(self, tool_name: _Optional[str] = ..., sample_count: _Optional[int] = ..., seen_count: _Optional[int] = ..., p50: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., p90: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., p99: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., drift_epoch: _Optional[int] = ..., signatures: _Optional[_Iterable[str]] = ..., pins: _Optional[_Union[PinStats, _Mapping]] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools", "model_version")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolSummary]
    model_version: int
    def __init__(self, tools: _Optional[_Iterable[_Union[ToolSummary, _Mapping]]] = ..., model_version: _Optional[int] = ...) -> None: ...

class GetToolDistributionRequest(_message.Message):
    __slots__ = ("tool_name", "tool_args", "cdf_points")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_ARGS_FIELD_NUMBER: _ClassVar[int]
    CDF_POINTS_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    tool_args: str
    cdf_points: int
    def __init__(self, tool_name: _Optional[str] = ..., tool_args: _Optional[str] = ..., cdf_points: _Optional[int] = ...) -> None: ...

class Quantile(_message.Message):
    __slots__ = ("q", "value")
    Q_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    q: float
    value: _duration_pb2.Duration
    def __init__(self, q: _Optional[float] = ..., value: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CdfPoint(_message.Message):
    __slots__ = ("duration", "probability")
    DURATION_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    duration: _duration_pb2.Duration
    probability: float
    def __init__(self, duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., probability: _Optional[float] = ...) -> None: ...

class GetToolDistributionResponse(_message.Message):
    __slots__ = ("tool_name", "signature", "basis", "sample_count", "seen_count", "drift_epoch", "quantiles", "cdf", "pins", "model_version", "misses")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    DRIFT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUANTILES_FIELD_NUMBER: _ClassVar[int]
    CDF_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    signature: str
    basis: str
    sample_count: int
    seen_count: int
    drift_epoch: int
    quantiles: _containers.RepeatedCompositeFieldContainer[Quantile]
    cdf: _containers.RepeatedCompositeFieldContainer[CdfPoint]
    pins: PinStats
    model_version: int
    misses: MissStats
    def __init__(self, tool_name: _Optional[str] = ..., signature: _Optional[str] = ..., basis: _Optional[str] = ..., sample_count: _Optional[int] = ..., seen_count: _Optional[int] = ..., drift_epoch: _Optional[int] = ..., quantiles: _Optional[_Iterable[_Union[Quantile, _Mapping]]] = ..., cdf: _Optional[_Iterable[_Union[CdfPoint, _Mapping]]] = ..., pins: _Optional[_Union[PinStats, _Mapping]] = ..., model_version: _Optional[int] = ..., misses: _Optional[_Union[MissStats, _Mapping]] = ...) -> None: ...

class ReasonCount(_message.Message):
    __slots__ = ("reason", "count")
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    reason: _events_pb2.MissReason
    count: int
    def __init__(self, reason: _Optional[_Union[_events_pb2.MissReason, str]] = ..., count: _Optional[int] = ...) -> None: ...

class MissStats(_message.Message):
    __slots__ = ("returning", "missed", "reasons", "expired_by")
    RETURNING_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_BY_FIELD_NUMBER: _ClassVar[int]
    returning: int
    missed: int
    reasons: _containers.RepeatedCompositeFieldContainer[ReasonCount]
    expired_by: _containers.RepeatedCompositeFieldContainer[Quantile]
    def __init__(self, returning: _Optional[int] = ..., missed: _Optional[int] = ..., reasons: _Optional[_Iterable[_Union[ReasonCount, _Mapping]]] = ..., expired_by: _Optional[_Iterable[_Union[Quantile, _Mapping]]] = ...) -> None: ...

class ListMissesRequest(_message.Message):
    __slots__ = ("tool_name", "program_id", "reason", "limit")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    program_id: str
    reason: _events_pb2.MissReason
    limit: int
    def __init__(self, tool_name: _Optional[str] = ..., program_id: _Optional[str] = ..., reason: _Optional[_Union[_events_pb2.MissReason, str]] = ..., limit: _Optional[int] = ...) -> None: ...

class MissedTurn(_message.Message):
    __slots__ = ("event_id", "program_id", "tool_name", "turn_index", "finished_at", "reason", "not_pinned_cause", "chosen_ttl", "duration", "expired_by", "diverged_at_token", "hit_tokens", "reusable_tokens")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NOT_PINNED_CAUSE_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_TTL_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_BY_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    program_id: str
    tool_name: str
    turn_index: int
    finished_at: _timestamp_pb2.Timestamp
    reason: _events_pb2.MissReason
    not_pinned_cause: _events_pb2.NotPinnedCause
    chosen_ttl: _duration_pb2.Duration
    duration: _duration_pb2.Duration
    expired_by: _duration_pb2.Duration
    diverged_at_token: int
    hit_tokens: int
    reusable_tokens: int
    def __init__(self, event_id: _Optional[str] = ..., program_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., turn_index: _Optional[int] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[_Union[_events_pb2.MissReason, str]] = ..., not_pinned_cause: _Optional[_Union[_events_pb2.NotPinnedCause, str]] = ..., chosen_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., expired_by: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., diverged_at_token: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., reusable_tokens: _Optional[int] = ...) -> None: ...

class ListMissesResponse(_message.Message):
    __slots__ = ("turns", "summary")
    TURNS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    turns: _containers.RepeatedCompositeFieldContainer[MissedTurn]
    summary: MissStats
    def __init__(self, turns: _Optional[_Iterable[_Union[MissedTurn, _Mapping]]] = ..., summary: _Optional[_Union[MissStats, _Mapping]] = ...) -> None: ...

class GetWorkloadStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkloadStatsResponse(_message.Message):
    __slots__ = ("eta", "queue_delay", "programs_completed", "programs_in_window", "tool_calls", "queue_samples", "model_version")
    ETA_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELAY_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_IN_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    eta: float
    queue_delay: _duration_pb2.Duration
    programs_completed: int
    programs_in_window: int
    tool_calls: int
    queue_samples: int
    model_version: int
    def __init__(self, eta: _Optional[float] = ..., queue_delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., programs_completed: _Optional[int] = ..., programs_in_window: _Optional[int] = ..., tool_calls: _Optional[int] = ..., queue_samples: _Optional[int] = ..., model_version: _Optional[int] = ...) -> None: ...
