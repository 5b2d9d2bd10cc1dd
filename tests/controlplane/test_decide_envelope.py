"""``DecideTtl`` answers in the cross-engine KV-hint envelope too: over a real gRPC server on
a port, the response's ``kv_hints`` holds one ``cachettl.retention`` action with the decided
TTL, which the engine side's parser (HTTP body, JSON or vLLM's struct) reads back as the
same TTL."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from controlplane._gen.cachettl.v1 import ttl_pb2, ttl_pb2_grpc
from controlplane.kvhints import (
    RETENTION_ACTION,
    RETENTION_VERSION,
    XARGS_KEY,
    Retention,
    parse_kv_hints,
    to_vllm,
)
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import Store
from enginehook.hints.flat import request_hints
from tests.support import ServerThread, running


@pytest.fixture(params=["fixed", "cachettl"])
def served(request: pytest.FixtureRequest, store: Store) -> Iterator[tuple[ServerThread, str]]:
    params = {"ttl_s": 12.345678, "skip_slow_tools": False} if request.param == "fixed" else {}
    plane = ControlPlane(store, request.param, params, min_samples=3)
    _, token = plane.create_tenant("acme")
    with running(plane) as server:
        yield server, token


def test_the_decision_comes_back_as_one_retention_action(served) -> None:
    server, token = served
    channel = grpc.insecure_channel(server.target)
    try:
        stub = ttl_pb2_grpc.TtlServiceStub(channel)  # type: ignore[no-untyped-call]
        request = ttl_pb2.DecideTtlRequest(tool_name="bash", tool_args="ls", context_tokens=8_000)
        reply = stub.DecideTtl(request, metadata=[("authorization", f"Bearer {token}")])
    finally:
        channel.close()
    assert reply.HasField("kv_hints")
    (action,) = reply.kv_hints.actions
    assert (action.action_type, action.action_version) == (RETENTION_ACTION, RETENTION_VERSION)
    assert reply.kv_hints.protocol_version
    assert reply.kv_hints.message_id
    assert set(action.payload.fields) == {"ttl_s"}
    ttl_s = reply.ttl.seconds + reply.ttl.nanos / 1e9
    assert action.payload.fields["ttl_s"].number_value == pytest.approx(ttl_s, abs=1e-9)


def test_the_envelope_round_trips_through_the_parser_into_the_same_ttl(served) -> None:
    server, token = served
    with ControlPlaneClient(server.target, token) as client:
        decisions = [
            client.decide_ttl("bash", args, context_tokens=tokens, turns_served=turns)
            for args, tokens, turns in [("ls", 8_000, 1), ("pytest -x", 64_000, 7), ("", 1, 0)]
        ]
        again = client.decide_ttl("bash", "ls", context_tokens=8_000, turns_served=1)
    assert again.kv_hints is not None
    assert decisions[0].kv_hints is not None
    assert again.kv_hints["message_id"] != decisions[0].kv_hints["message_id"]
    for decision in decisions:
        envelope = decision.kv_hints
        assert envelope is not None
        want = Retention(ttl_s=envelope["actions"][0]["payload"]["ttl_s"])
        assert want.ttl_s == pytest.approx(decision.ttl_s, abs=1e-9)
        assert parse_kv_hints(envelope) == want  # as JSON (SGLang, Dynamo)
        assert parse_kv_hints(to_vllm(envelope)) == want  # as vLLM's Request.kv_hints
        text = json.dumps(envelope)  # as an HTTP body's kv_hints, carried in vllm_xargs
        hints = request_hints({"pin_ttl_s": 999, XARGS_KEY: text})
        assert hints.pin_ttl_s == pytest.approx(decision.ttl_s, abs=1e-9)
    if decisions[0].basis == "fixed":
        assert [d.kv_hints["actions"][0]["payload"] for d in decisions if d.kv_hints] == [
            {"ttl_s": 12.345678}
        ] * 3
