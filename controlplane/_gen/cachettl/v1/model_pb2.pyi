import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_MODE_UNSPECIFIED: _ClassVar[RolloutMode]
    ROLLOUT_MODE_ALL: _ClassVar[RolloutMode]
    ROLLOUT_MODE_ONLY: _ClassVar[RolloutMode]
    ROLLOUT_MODE_EXCEPT: _ClassVar[RolloutMode]
    ROLLOUT_MODE_SHADOW: _ClassVar[RolloutMode]
ROLLOUT_MODE_UNSPECIFIED: RolloutMode
ROLLOUT_MODE_ALL: RolloutMode
ROLLOUT_MODE_ONLY: RolloutMode
ROLLOUT_MODE_EXCEPT: RolloutMode
ROLLOUT_MODE_SHADOW: RolloutMode

class WatchSnapshotsRequest(_message.Message):
    __slots__ = ("after_version", "compact", "lineage")
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    compact: bool
    lineage: int
    def __init__(self, after_version: _Optional[int] = ..., compact: _Optional[bool] = ..., lineage: _Optional[int] = ...) -> None: ...

class ToolModel(_message.Message):
    __slots__ = ("tool_name", "signature", "level", "sorted_durations_seconds", "summarized", "sample_count", "drift_epoch", "quantile_sketch", "log_steps")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    SORTED_DURATIONS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUMMARIZED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DRIFT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUANTILE_SKETCH_FIELD_NUMBER: _ClassVar[int]
    LOG_STEPS_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    signature: str
    level: str
    sorted_durations_seconds: _containers.RepeatedScalarFieldContainer[float]
    summarized: bool
    sample_count: int
    drift_epoch: int
    quantile_sketch: bool
    log_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tool_name: _Optional[str] = ..., signature: _Optional[str] = ..., level: _Optional[str] = ..., sorted_durations_seconds: _Optional[_Iterable[float]] = ..., summarized: _Optional[bool] = ..., sample_count: _Optional[int] = ..., drift_epoch: _Optional[int] = ..., quantile_sketch: _Optional[bool] = ..., log_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchSnapshotsResponse(_message.Message):
    __slots__ = ("version", "models", "eta", "queue_delay", "min_samples", "delta", "base_version", "lineage", "cdf_error", "rollout", "signature_rules")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELAY_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    CDF_ERROR_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_RULES_FIELD_NUMBER: _ClassVar[int]
    version: int
    models: _containers.RepeatedCompositeFieldContainer[ToolModel]
    eta: float
    queue_delay: _duration_pb2.Duration
    min_samples: int
    delta: bool
    base_version: int
    lineage: int
    cdf_error: float
    rollout: Rollout
    signature_rules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ToolModel, _Mapping]]] = ..., eta: _Optional[float] = ..., queue_delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., min_samples: _Optional[int] = ..., delta: _Optional[bool] = ..., base_version: _Optional[int] = ..., lineage: _Optional[int] = ..., cdf_error: _Optional[float] = ..., rollout: _Optional[_Union[Rollout, _Mapping]] = ..., signature_rules: _Optional[_Iterable[str]] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("mode", "tools")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    mode: RolloutMode
    tools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mode: _Optional[_Union[RolloutMode, str]] = ..., tools: _Optional[_Iterable[str]] = ...) -> None: ...
