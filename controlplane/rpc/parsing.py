"""Requests as the servicer receives them: parsed by the service rather than by gRPC, so
that corrupt bytes are answered INVALID_ARGUMENT (gRPC's own parser would answer
INTERNAL), and large ones parsed off the event loop, in their tenant's share of the server.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import DecodeError, Message

__all__ = ["PARSE_ON_LOOP_BYTES", "Malformed", "Unparsed", "parser", "serializer"]


class Malformed:
    """Stands for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __str__(self) -> str:
        return str(self.error)


#: Requests larger than this are parsed on a lane thread, in the tenant's share of the
#: server (:mod:`controlplane.rpc.lanes`), not on the event loop that answers decisions:
#: a 4 MB batch took the loop 5 ms.
PARSE_ON_LOOP_BYTES = 64 << 10


class Unparsed:
    """A request too large to parse on the event loop: parsed later, on a lane."""

    def __init__(self, cls: type[Message], data: bytes) -> None:
        self.cls = cls
        self.data = data

    def parse(self) -> object:
        return _parse(self.cls, self.data)


def _parse(cls: type[Message], data: bytes) -> object:
    try:
        return cls.FromString(data)
    except DecodeError as error:
        return Malformed(error)


def parser(cls: type[Message]) -> Callable[[bytes], object]:
    """gRPC's request deserializer for ``cls``: the message, ``Malformed`` for bytes that do
    not parse, or ``Unparsed`` for a request over ``PARSE_ON_LOOP_BYTES``."""

    def parse(data: bytes) -> object:
        if len(data) > PARSE_ON_LOOP_BYTES:
            return Unparsed(cls, data)
        return _parse(cls, data)

    return parse


def serializer(cls: type[Message]) -> Callable[[object], bytes]:
    """gRPC's response serializer for ``cls`` (``bytes`` pass as they are)."""

    def serialize(message: object) -> bytes:
        if isinstance(message, bytes):  # already serialized (snapshots)
            return message
        assert isinstance(message, cls)
        return message.SerializeToString()

    return serialize
