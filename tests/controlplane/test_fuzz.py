"""Hypothesis fuzzing of every RPC: messages generated from the wire contract's own
descriptors (any field values, unknown fields, raw garbage bytes). The server never fails
with INTERNAL/UNKNOWN, keeps serving, and its store stays consistent: every stored event
was acknowledged, and the models equal a replay of the store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane import inspection
from controlplane._gen.cachettl.v1 import events_pb2, inspect_pb2, model_pb2, ttl_pb2
from controlplane.service import ControlPlane
from controlplane.state import ModelState
from controlplane.storage import create_store
from tests.support import ServerThread, running

RPCS: list[tuple[str, type[Message]]] = [
    ("/cachettl.v1.ToolEventService/RecordToolCalls", events_pb2.RecordToolCallsRequest),
    ("/cachettl.v1.ToolEventService/RecordProgramEnd", events_pb2.RecordProgramEndRequest),
    ("/cachettl.v1.TtlService/DecideTtl", ttl_pb2.DecideTtlRequest),
    ("/cachettl.v1.InspectService/ListTools", inspect_pb2.ListToolsRequest),
    ("/cachettl.v1.InspectService/GetToolDistribution", inspect_pb2.GetToolDistributionRequest),
    ("/cachettl.v1.InspectService/GetWorkloadStats", inspect_pb2.GetWorkloadStatsRequest),
    ("/cachettl.v1.InspectService/ListMisses", inspect_pb2.ListMissesRequest),
]
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
F = FieldDescriptor
_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
}
_TEXT = st.one_of(
    st.sampled_from(["", "bash", "ls -la", "pytest -x", "a\x00b", "x" * 129, "é" * 200]),
    st.text(max_size=40),
)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INTS:
        low, high = _INTS[field.type]
        return st.one_of(st.sampled_from([0, 1, low, high]), st.integers(low, high))
    if field.type == F.TYPE_STRING:
        return _TEXT
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if field.type == F.TYPE_ENUM:
        return st.integers(-3, 9)
    raise AssertionError(f"no strategy for {field.full_name}")


def messages(descriptor: Any) -> st.SearchStrategy[bytes]:
    """Serialized messages of ``descriptor`` with arbitrary field values."""
    cls: Any = GetMessageClass(descriptor)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE:
            value = messages(field.message_type).map(GetMessageClass(field.message_type).FromString)
        else:
            value = _scalar(field)
        repeated = field.is_repeated
        parts[field.name] = st.lists(value, max_size=4) if repeated else value
    fields = st.fixed_dictionaries({}, optional=parts)

    def build(values: dict[str, Any], junk: bytes) -> bytes:
        message = cls()
        for name, value in values.items():
            target = getattr(message, name)
            if isinstance(value, list):
                target.extend(value)
            elif isinstance(value, Message):
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return bytes(message.SerializeToString() + junk)

    unknown = st.sampled_from([b"", b"", b"", b"\xf8\x06\x01"])
    return st.builds(build, fields, unknown)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, str]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.sqlite3'}"
    store = create_store(url)
    plane = ControlPlane(store, min_samples=2)
    _, token = plane.create_tenant("fuzz")
    with running(plane) as thread:
        yield thread, token
    store.close()


FUZZ = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


def _call(server: ServerThread, token: str, method: str, payload: bytes) -> None:
    status: tuple[Any, str] = (grpc.StatusCode.OK, "")
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary(method)
        try:
            call(payload, metadata=(("authorization", f"Bearer {token}"),), timeout=10)
        except grpc.RpcError as error:
            status = (error.code(), error.details())
    assert status[0] in ALLOWED, (method, *status)


@pytest.mark.parametrize(("method", "message"), RPCS, ids=[m.rsplit("/")[-1] for m, _ in RPCS])
def test_fuzz_rpc(server, method: str, message: type[Message]) -> None:
    thread, token = server

    @FUZZ
    @given(payload=messages(message.DESCRIPTOR))
    def check(payload: bytes) -> None:
        _call(thread, token, method, payload)

    check()


def test_fuzz_garbage_bytes_and_snapshot_stream(server) -> None:
    thread, token = server

    @FUZZ
    @given(method=st.sampled_from([m for m, _ in RPCS]), payload=st.binary(max_size=64))
    def check(method: str, payload: bytes) -> None:
        _call(thread, token, method, payload)

    check()


def test_fuzz_snapshot_stream(server) -> None:
    thread, token = server

    @settings(FUZZ, max_examples=30)
    @given(payload=messages(model_pb2.WatchSnapshotsRequest.DESCRIPTOR))
    def check(payload: bytes) -> None:
        with grpc.insecure_channel(thread.target) as channel:
            stream = channel.unary_stream("/cachettl.v1.ModelService/WatchSnapshots")(
                payload, metadata=(("authorization", f"Bearer {token}"),), timeout=0.1
            )
            status: tuple[Any, str] = (grpc.StatusCode.OK, "")
            try:
                next(stream)
            except grpc.RpcError as error:
                status = (error.code(), error.details())
        assert status[0] in ALLOWED | {grpc.StatusCode.DEADLINE_EXCEEDED}, status

    check()


def test_store_is_consistent_after_fuzzing(server) -> None:
    thread, _ = server
    plane = thread.server.plane
    rows = plane.store.read_tool_calls(0, 1_000_000)
    replay = ModelState.fresh(plane.policy, min_samples=2)
    replay.apply_tool_calls(rows)
    replay.apply_program_ends(plane.store.read_program_ends(0, 1_000_000))
    assert plane.version == replay.version
    assert plane.list_tools("fuzz") == inspection.list_tools(replay, "fuzz")
    assert plane.workload_stats("fuzz") == inspection.workload(replay, "fuzz")
