import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecideTtlRequest(_message.Message):
    __slots__ = ("program_id", "tool_name", "tool_args", "context_tokens", "reload_cost", "queue_delay", "turns_served", "offload", "waiting_tokens", "free_tokens", "offloaded_tokens")
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_ARGS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELOAD_COST_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELAY_FIELD_NUMBER: _ClassVar[int]
    TURNS_SERVED_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    program_id: str
    tool_name: str
    tool_args: str
    context_tokens: int
    reload_cost: _duration_pb2.Duration
    queue_delay: _duration_pb2.Duration
    turns_served: int
    offload: bool
    waiting_tokens: int
    free_tokens: int
    offloaded_tokens: int
    def __init__(self, program_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., tool_args: _Optional[str] = ..., context_tokens: _Optional[int] = ..., reload_cost: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., queue_delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., turns_served: _Optional[int] = ..., offload: _Optional[bool] = ..., waiting_tokens: _Optional[int] = ..., free_tokens: _Optional[int] = ..., offloaded_tokens: _Optional[int] = ...) -> None: ...

class DecideTtlResponse(_message.Message):
    __slots__ = ("ttl", "return_probability", "expected_benefit", "basis", "model_version", "benefit")
    TTL_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BENEFIT_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BENEFIT_FIELD_NUMBER: _ClassVar[int]
    ttl: _duration_pb2.Duration
    return_probability: float
    expected_benefit: _duration_pb2.Duration
    basis: str
    model_version: int
    benefit: _duration_pb2.Duration
    def __init__(self, ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., return_probability: _Optional[float] = ..., expected_benefit: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., basis: _Optional[str] = ..., model_version: _Optional[int] = ..., benefit: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...
