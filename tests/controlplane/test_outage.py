"""PostgreSQL going away under a running server: decisions come from memory, so they go
on for the auth cache's stale age (then UNAVAILABLE, never a hang)."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from controlplane.rpc.auth import AuthOptions
from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from tests.support import running

from .abuse import TcpProxy, healthy


def test_decisions_survive_a_database_outage(pg_schemas: Callable[[], str]) -> None:
    schema = pg_schemas()
    proxy = TcpProxy(("127.0.0.1", 5432))
    url = f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/test"
    store = create_store(f"{url}?options=-csearch_path%3D{schema}")
    plane = ControlPlane(store, min_samples=1)
    _, token = plane.create_tenant("acme")
    auth = AuthOptions(fresh_s=0.5, stale_s=6.0)
    try:
        with (
            running(plane, auth=auth, tail_interval_s=0.1) as server,
            ControlPlaneClient(server.target, token) as client,
            grpc.insecure_channel(server.target) as channel,
        ):
            calls = [ToolCall(f"e{i}", "p", "bash", "ls", 0.1 * (i + 1)) for i in range(5)]
            client.record_tool_calls(calls)
            before = client.decide_ttl("bash", "ls", reload_cost_s=2.0, queue_delay_s=0.0)
            proxy.stop()
            down = time.monotonic()
            time.sleep(2.5)  # well past fresh_s, and past the 2 s the server used to allow
            while time.monotonic() - down < 5.0:
                during = client.decide_ttl("bash", "ls", reload_cost_s=2.0, queue_delay_s=0.0)
                assert during == before
                assert healthy(channel)
                time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as error:
                client.record_tool_calls([ToolCall("x", "p", "bash", "ls", 0.1)])
            assert error.value.code() is grpc.StatusCode.UNAVAILABLE
            time.sleep(max(0.0, down + 6.5 - time.monotonic()))  # past stale_s
            with pytest.raises(grpc.RpcError) as error:
                client.decide_ttl("bash", "ls", reload_cost_s=2.0, queue_delay_s=0.0)
            assert error.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "database unavailable" in str(error.value.details())
    finally:
        proxy.stop()
        store.close()
