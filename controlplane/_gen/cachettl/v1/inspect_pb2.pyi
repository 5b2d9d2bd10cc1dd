import datetime

from google.protobuf import duration_pb2 as _duration_pb2
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
    __slots__ = ("hits", "expired", "released_under_pressure", "not_pinned", "hit_rate")
    HITS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_UNDER_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    NOT_PINNED_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    hits: int
    expired: int
    released_under_pressure: int
    not_pinned: int
    hit_rate: float
    def __init__(self, hits: _Optional[int] = ..., expired: _Optional[int] = ..., released_under_pressure: _Optional[int] = ..., not_pinned: _Optional[int] = ..., hit_rate: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("tool_name", "signature", "basis", "sample_count", "seen_count", "drift_epoch", "quantiles", "cdf", "pins", "model_version")
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
    def __init__(self, tool_name: _Optional[str] = ..., signature: _Optional[str] = ..., basis: _Optional[str] = ..., sample_count: _Optional[int] = ..., seen_count: _Optional[int] = ..., drift_epoch: _Optional[int] = ..., quantiles: _Optional[_Iterable[_Union[Quantile, _Mapping]]] = ..., cdf: _Optional[_Iterable[_Union[CdfPoint, _Mapping]]] = ..., pins: _Optional[_Union[PinStats, _Mapping]] = ..., model_version: _Optional[int] = ...) -> None: ...

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
