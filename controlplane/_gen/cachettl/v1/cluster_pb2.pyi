import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReportArrivalsRequest(_message.Message):
    __slots__ = ("engine_id", "arrivals")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    arrivals: _containers.RepeatedCompositeFieldContainer[Arrival]
    def __init__(self, engine_id: _Optional[str] = ..., arrivals: _Optional[_Iterable[_Union[Arrival, _Mapping]]] = ...) -> None: ...

class Arrival(_message.Message):
    __slots__ = ("program_id", "arrived_at")
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_AT_FIELD_NUMBER: _ClassVar[int]
    program_id: str
    arrived_at: _timestamp_pb2.Timestamp
    def __init__(self, program_id: _Optional[str] = ..., arrived_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportArrivalsResponse(_message.Message):
    __slots__ = ("moved", "refused", "refusals")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    moved: int
    refused: int
    refusals: _containers.RepeatedCompositeFieldContainer[RefusedArrival]
    def __init__(self, moved: _Optional[int] = ..., refused: _Optional[int] = ..., refusals: _Optional[_Iterable[_Union[RefusedArrival, _Mapping]]] = ...) -> None: ...

class RefusedArrival(_message.Message):
    __slots__ = ("index", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchMovesRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class WatchMovesResponse(_message.Message):
    __slots__ = ("program_id", "to_engine_id", "arrived_at")
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    TO_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_AT_FIELD_NUMBER: _ClassVar[int]
    program_id: str
    to_engine_id: str
    arrived_at: _timestamp_pb2.Timestamp
    def __init__(self, program_id: _Optional[str] = ..., to_engine_id: _Optional[str] = ..., arrived_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
