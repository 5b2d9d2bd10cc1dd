"""Bad input gets the right status code and a message naming the field and the limit;
a rejected batch stores nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from controlplane._gen.cachettl.v1 import (
    events_pb2,
    events_pb2_grpc,
    ttl_pb2,
    ttl_pb2_grpc,
)
from controlplane.rpc.client import ControlPlaneClient, ToolCall, to_event
from controlplane.service import ControlPlane
from controlplane.storage import Store
from tests.support import ServerThread, running

from .abuse import HalfOpen


@pytest.fixture
def setup(store: Store) -> Iterator[tuple[ServerThread, str, ControlPlane]]:
    plane = ControlPlane(store)
    _, token = plane.create_tenant("acme")
    with running(plane, max_concurrent_rpcs=4) as server:
        yield server, token, plane


def _code(error: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, str]:
    return error.value.code(), error.value.details()


def _event(i: int, **fields: object) -> events_pb2.ToolCallEvent:
    event = to_event(ToolCall(f"e{i}", "prog", "bash", "ls", 0.5))
    for name, value in fields.items():
        if name == "duration_s":
            assert isinstance(value, float)
            event.duration.seconds = int(value)
            event.duration.nanos = round((value - int(value)) * 1e9)
        else:
            setattr(event, name, value)
    return event


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"duration_s": -1.0}, "events[3].duration: must be >= 0"),
        ({"duration_s": 90000.0}, "events[3].duration: must be at most 86400 s"),
        ({"tool_name": ""}, "events[3].tool_name: must be 1..128 characters"),
        ({"tool_name": "x" * 129}, "events[3].tool_name: must be at most 128 characters"),
        ({"event_id": "y" * 129}, "events[3].event_id: must be at most 128 characters"),
        ({"program_id": "a\x00b"}, "events[3].program_id: must not contain NUL"),
        ({"tool_args": "z" * 4097}, "events[3].tool_args: must be at most 4096 characters"),
        ({"pin_outcome": 9}, "events[3].pin_outcome: unknown value 9"),
    ],
)
def test_bad_event_rejects_the_whole_batch(setup, store: Store, fields, needle) -> None:
    server, token, _ = setup
    events = [_event(i) for i in range(3)] + [_event(3, **fields)]
    with grpc.insecure_channel(server.target) as channel:
        stub = events_pb2_grpc.ToolEventServiceStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as error:
            stub.RecordToolCalls(
                events_pb2.RecordToolCallsRequest(events=events),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=5,
            )
    code, details = _code(error)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert needle in details
    assert store.count_tool_calls() == 0


def test_batch_limits_and_nan(setup, store: Store) -> None:
    server, token, _ = setup
    with ControlPlaneClient(server.target, token) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.record_tool_calls([])
        assert _code(error) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "events: must hold 1..1000 events, got 0",
        )
        calls = [ToolCall(f"e{i}", "p", "ls", "", 0.1) for i in range(1001)]
        with pytest.raises(grpc.RpcError) as error:
            client.record_tool_calls(calls)
        assert "events: must hold at most 1000 events, got 1001" in _code(error)[1]
        with pytest.raises(ValueError, match="duration_s must be finite"):
            client.record_tool_calls([ToolCall("n", "p", "ls", "", float("nan"))])
        with pytest.raises(grpc.RpcError) as error:
            client.record_program_end("p", 0)
        assert "total_turns: must be in 1..100000, got 0" in _code(error)[1]
        with pytest.raises(grpc.RpcError) as error:
            client.decide_ttl("ls", context_tokens=10**10)
        assert "context_tokens: must be at most 1000000000" in _code(error)[1]
    assert store.count_tool_calls() == 0


def test_unknown_fields_are_rejected(setup) -> None:
    server, token, _ = setup
    payload = ttl_pb2.DecideTtlRequest(tool_name="ls").SerializeToString() + b"\xf8\x06\x01"
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary("/cachettl.v1.TtlService/DecideTtl")
        with pytest.raises(grpc.RpcError) as error:
            call(payload, metadata=(("authorization", f"Bearer {token}"),), timeout=5)
    assert _code(error) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "request: unknown field number(s) 111",
    )


def test_tokens(setup, store: Store) -> None:
    server, _, plane = setup
    with grpc.insecure_channel(server.target) as channel:
        stub = ttl_pb2_grpc.TtlServiceStub(channel)  # type: ignore[no-untyped-call]
        request = ttl_pb2.DecideTtlRequest(tool_name="ls")
        with pytest.raises(grpc.RpcError) as error:
            stub.DecideTtl(request, timeout=5)
        assert _code(error)[0] is grpc.StatusCode.UNAUTHENTICATED
        assert "missing bearer token" in _code(error)[1]
        with pytest.raises(grpc.RpcError) as error:
            stub.DecideTtl(request, metadata=(("authorization", "Bearer nope"),), timeout=5)
        assert _code(error) == (grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown token")
    _, other = plane.create_tenant("gone")
    store.revoke_tenant("gone", 1.0)
    with ControlPlaneClient(server.target, other) as client, pytest.raises(grpc.RpcError) as error:
        client.decide_ttl("ls")
    assert _code(error) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "authorization: the token of tenant 'gone' was revoked",
    )


def test_overload_answers_resource_exhausted(setup) -> None:
    server, token, _ = setup  # at most 4 concurrent unary RPCs (streams have their own budget)
    meta = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(server.target) as channel:
        held = HalfOpen(channel)  # admitted calls whose message has not arrived hold a slot
        try:
            held.open(4, metadata=meta)
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as error:
                ttl_pb2_grpc.TtlServiceStub(channel).DecideTtl(  # type: ignore[no-untyped-call]
                    ttl_pb2.DecideTtlRequest(tool_name="ls"), metadata=meta, timeout=5
                )
            assert _code(error) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "calls: 4 in flight (limit 4, server-wide)",
            )
        finally:
            held.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"waiting_tokens": 10**10}, "waiting_tokens: must be at most 1000000000, got 10000000000"),
        ({"free_tokens": 10**9 + 1}, "free_tokens: must be at most 1000000000, got 1000000001"),
        (
            {"context_tokens": 100, "offloaded_tokens": 101},
            "offloaded_tokens: must be at most context_tokens (100), got 101",
        ),
    ],
)
def test_bad_load_signals_name_the_field(setup, fields: dict[str, Any], message: str) -> None:
    server, token, _ = setup
    request = ttl_pb2.DecideTtlRequest(tool_name="ls", **fields)
    with grpc.insecure_channel(server.target) as channel:
        stub = ttl_pb2_grpc.TtlServiceStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as error:
            stub.DecideTtl(request, metadata=(("authorization", f"Bearer {token}"),), timeout=5)
    assert _code(error) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_client_refuses_bad_load_signals_before_sending(setup) -> None:
    server, token, _ = setup
    with ControlPlaneClient(server.target, token) as client:
        with pytest.raises(ValueError, match="free_tokens must be >= 0, got -1"):
            client.decide_ttl("ls", waiting_tokens=10, free_tokens=-1)
        with pytest.raises(ValueError, match=r"waiting_tokens must be an integer, got 1\.5"):
            client.decide_ttl("ls", waiting_tokens=1.5)  # type: ignore[arg-type]
