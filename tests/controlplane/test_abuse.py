"""Hostile and careless clients over a real server: half-open calls, floods of invented
tokens, clusters of watchers, revocation of open streams (SQLite and PostgreSQL)."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time

import grpc
import pytest

from controlplane._gen.cachettl.v1 import model_pb2, model_pb2_grpc, ttl_pb2_grpc
from controlplane.rpc.auth import AuthOptions
from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.rpc.gate import Budgets
from controlplane.service import ControlPlane
from controlplane.storage import Store
from tests.support import running

from .abuse import HalfOpen, decide_request, healthy

BOTH = pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)


def _calls(prefix: str, n: int = 5) -> list[ToolCall]:
    return [ToolCall(f"{prefix}{i}", "p", "bash", "ls", 0.1 + i / 10) for i in range(n)]


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@BOTH
def test_calls_without_a_valid_token_hold_no_slot(store: Store) -> None:
    """256 calls that send headers and never a message, with no token or an invented one,
    are answered UNAUTHENTICATED at once; the tenant and the health check are served."""
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    with (
        running(plane, max_concurrent_rpcs=16) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        attack = HalfOpen(channel)
        try:
            attack.open(128)  # no token at all
            for _ in range(128):  # a fresh invented token each
                attack.open(1, metadata=_meta("cttl_" + secrets.token_urlsafe(32)))
            codes = attack.codes(wait_s=15)  # None: still open, holding something
            assert codes[:128] == [grpc.StatusCode.UNAUTHENTICATED] * 128
            # invented tokens each cost a lookup: beyond the lookups allowed to wait at
            # once they are refused (RESOURCE_EXHAUSTED) instead of queueing
            refused = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert set(codes[128:]) <= refused
            assert codes.count(grpc.StatusCode.UNAUTHENTICATED) >= 128 + 64
            assert healthy(channel)
            stub = ttl_pb2_grpc.TtlServiceStub(channel)  # type: ignore[no-untyped-call]
            reply = stub.DecideTtl(decide_request(), metadata=_meta(token), timeout=5)
            assert reply.basis == "cold-start"
        finally:
            attack.close()


@BOTH
def test_a_tenants_half_open_calls_take_only_its_own_slots(store: Store) -> None:
    """A tenant's calls that never send their message fill that tenant's budget only, and
    end DEADLINE_EXCEEDED after ``message_timeout_s``; other tenants and health go on."""
    plane = ControlPlane(store, min_samples=1)
    _, bad = plane.create_tenant("careless")
    _, good = plane.create_tenant("good")
    budgets = Budgets(calls_per_tenant=8, message_timeout_s=2.0)
    with (
        running(plane, max_concurrent_rpcs=32, budgets=budgets) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        attack = HalfOpen(channel)
        try:
            attack.open(256, metadata=_meta(bad))
            stub = ttl_pb2_grpc.TtlServiceStub(channel)  # type: ignore[no-untyped-call]
            time.sleep(0.5)  # the careless calls are in
            for _ in range(20):
                assert healthy(channel)
                reply = stub.DecideTtl(decide_request(), metadata=_meta(good), timeout=5)
                assert reply.basis == "cold-start"
            with pytest.raises(grpc.RpcError) as error:
                stub.DecideTtl(decide_request(), metadata=_meta(bad), timeout=5)
            assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            details = str(error.value.details())
            assert "calls of this tenant: 8 in flight (limit 8, per tenant)" in details
            codes = attack.codes(wait_s=15)
            assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 8
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 248
        finally:
            attack.close()


@BOTH
def test_hundreds_of_watchers_of_one_tenant_lock_nobody_out(store: Store) -> None:
    """300 WatchSnapshots streams of one tenant (one per engine of a large cluster) are
    all served, and another tenant's calls, stream and the health check still are."""
    plane = ControlPlane(store, min_samples=1)
    _, cluster = plane.create_tenant("cluster")
    _, other = plane.create_tenant("other")
    with (
        running(plane) as server,
        ControlPlaneClient(server.target, cluster) as c,
        ControlPlaneClient(server.target, other) as o,
        grpc.insecure_channel(server.target) as channel,
    ):
        c.record_tool_calls(_calls("c"))
        stub = model_pb2_grpc.ModelServiceStub(channel)  # type: ignore[no-untyped-call]
        request = model_pb2.WatchSnapshotsRequest()
        streams = [
            stub.WatchSnapshots(request, metadata=_meta(cluster), timeout=60) for _ in range(300)
        ]
        try:
            assert {next(s).version for s in streams} == {5}
            assert healthy(channel)
            assert o.decide_ttl("bash", reload_cost_s=2.0, queue_delay_s=0.0).basis == (
                "cold-start"
            )
            o.record_tool_calls(_calls("o"))
            assert next(o.watch_snapshots(timeout_s=10)).version == 5
        finally:
            for s in streams:
                s.cancel()


@BOTH
def test_streams_have_their_own_budget_per_tenant(store: Store) -> None:
    plane = ControlPlane(store, min_samples=1)
    _, cluster = plane.create_tenant("cluster")
    _, other = plane.create_tenant("other")
    budgets = Budgets(streams_per_tenant=4)
    with (
        running(plane, max_concurrent_rpcs=4, budgets=budgets) as server,
        grpc.insecure_channel(server.target) as channel,
        ControlPlaneClient(server.target, other) as o,
    ):
        stub = model_pb2_grpc.ModelServiceStub(channel)  # type: ignore[no-untyped-call]
        never = model_pb2.WatchSnapshotsRequest(after_version=10**9)
        streams = [stub.WatchSnapshots(never, metadata=_meta(cluster)) for _ in range(4)]
        try:
            for s in streams:
                s.initial_metadata()  # open
            with pytest.raises(grpc.RpcError) as error:
                next(stub.WatchSnapshots(never, metadata=_meta(cluster), timeout=10))
            assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "WatchSnapshots streams of this tenant: 4 in flight (limit 4, per tenant)" in (
                str(error.value.details())
            )
            for _ in range(8):  # more than max_concurrent_rpcs unary calls, one at a time
                assert o.decide_ttl("bash").basis == "cold-start"
            o.record_tool_calls(_calls("o"))
            assert next(o.watch_snapshots(timeout_s=10)).version == 5
        finally:
            for s in streams:
                s.cancel()


@BOTH
def test_revocation_ends_open_streams(store: Store) -> None:
    """A revoked tenant's stream ends PERMISSION_DENIED within the auth cache's fresh age
    plus one watch interval, sharing tenants' streams included."""
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("leaver", share=True)
    _, stays = plane.create_tenant("stays", share=True)
    auth = AuthOptions(fresh_s=0.3, stale_s=30.0)
    with (
        running(plane, watch_interval_s=0.05, auth=auth) as server,
        ControlPlaneClient(server.target, token) as leaver,
        ControlPlaneClient(server.target, stays) as other,
    ):
        leaver.record_tool_calls(_calls("l"))
        stream = leaver.watch_snapshots(timeout_s=20)
        assert next(stream).version == 5
        plane.store.revoke_tenant("leaver", time.time())
        revoked = time.monotonic()
        for i in range(3):
            other.record_tool_calls(_calls(f"s{i}-"))
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
        assert error.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "tenant 'leaver' was revoked" in str(error.value.details())
        assert time.monotonic() - revoked < 5.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-streams-per-tenant", "0"], "--max-streams-per-tenant must be > 0, got 0"),
        (["--auth-fresh", "10", "--auth-stale", "5"], "--auth-fresh must be at most --auth-stale"),
    ],
)
def test_serve_refuses_bad_limits_naming_the_flag(flags: list[str], message: str) -> None:
    command = [sys.executable, "-m", "controlplane", "serve", "--db", "memory://", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr
