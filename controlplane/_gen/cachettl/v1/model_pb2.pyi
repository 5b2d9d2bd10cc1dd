import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchSnapshotsRequest(_message.Message):
    __slots__ = ("after_version",)
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    def __init__(self, after_version: _Optional[int] = ...) -> None: ...

class ToolModel(_message.Message):
    __slots__ = ("tool_name", "signature", "level", "sorted_durations_seconds", "summarized", "sample_count", "drift_epoch")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    SORTED_DURATIONS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUMMARIZED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DRIFT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    signature: str
    level: str
    sorted_durations_seconds: _containers.RepeatedScalarFieldContainer[float]
    summarized: bool
    sample_count: int
    drift_epoch: int
    def __init__(self, tool_name: _Optional[str] = ..., signature: _Optional[str] = ..., level: _Optional[str] = ..., sorted_durations_seconds: _Optional[_Iterable[float]] = ..., summarized: _Optional[bool] = ..., sample_count: _Optional[int] = ..., drift_epoch: _Optional[int] = ...) -> None: ...

class WatchSnapshotsResponse(_message.Message):
    __slots__ = ("version", "models", "eta", "queue_delay", "min_samples")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELAY_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    version: int
    models: _containers.RepeatedCompositeFieldContainer[ToolModel]
    eta: float
    queue_delay: _duration_pb2.Duration
    min_samples: int
    def __init__(self, version: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ToolModel, _Mapping]]] = ..., eta: _Optional[float] = ..., queue_delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., min_samples: _Optional[int] = ...) -> None: ...
