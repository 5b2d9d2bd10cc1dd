import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
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
    __slots__ = ("ttl", "return_probability", "expected_benefit", "basis", "model_version", "benefit", "kv_hints")
    TTL_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BENEFIT_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BENEFIT_FIELD_NUMBER: _ClassVar[int]
    KV_HINTS_FIELD_NUMBER: _ClassVar[int]
    ttl: _duration_pb2.Duration
    return_probability: float
    expected_benefit: _duration_pb2.Duration
    basis: str
    model_version: int
    benefit: _duration_pb2.Duration
    kv_hints: KvHintsEnvelope
    def __init__(self, ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., return_probability: _Optional[float] = ..., expected_benefit: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., basis: _Optional[str] = ..., model_version: _Optional[int] = ..., benefit: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kv_hints: _Optional[_Union[KvHintsEnvelope, _Mapping]] = ...) -> None: ...

class KvHintsEnvelope(_message.Message):
    __slots__ = ("protocol_version", "message_id", "actions")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    message_id: str
    actions: _containers.RepeatedCompositeFieldContainer[KvHintAction]
    def __init__(self, protocol_version: _Optional[str] = ..., message_id: _Optional[str] = ..., actions: _Optional[_Iterable[_Union[KvHintAction, _Mapping]]] = ...) -> None: ...

class KvHintAction(_message.Message):
    __slots__ = ("action_id", "action_type", "action_version", "payload")
    ACTION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_TYPE_FIELD_NUMBER: _ClassVar[int]
    ACTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    action_id: str
    action_type: str
    action_version: str
    payload: _struct_pb2.Struct
    def __init__(self, action_id: _Optional[str] = ..., action_type: _Optional[str] = ..., action_version: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...
