"""Soak: many hostile client shapes at once (half-open calls with and without tokens,
invented tokens, hundreds of streams) while another tenant works; afterwards that tenant
was served within its bound, every acknowledged event is stored once, and the server
restarts on its database with the same models."""

from __future__ import annotations

import secrets
import threading
import time

import grpc
import pytest

from controlplane._gen.cachettl.v1 import model_pb2, model_pb2_grpc
from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.rpc.gate import Budgets
from controlplane.service import ControlPlane
from controlplane.storage import Store
from tests.support import running

from .abuse import HalfOpen, healthy

#: The working tenant's worst call while the others misbehave.
BOUND_S = 0.5


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _work(client: ControlPlaneClient, stop: threading.Event, acked: list[str]) -> list[float]:
    """Batches with fresh event ids (each resent once) and decisions, timed."""
    latencies: list[float] = []
    b = 0
    while not stop.is_set():
        calls = [ToolCall(f"w{b}-{i}", f"p{b}", "bash", "ls -la", 0.1 + i / 50) for i in range(20)]
        t = time.perf_counter()
        ack = client.record_tool_calls(calls)
        again = client.record_tool_calls(calls)  # a resend: all duplicates
        client.decide_ttl("bash", "ls", reload_cost_s=2.0, queue_delay_s=0.0)
        latencies.append((time.perf_counter() - t) / 3)
        assert (ack.accepted, again.duplicates) == (20, 20)
        acked += [c.event_id for c in calls]
        b += 1
    return latencies


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_hostile_clients_soak(store: Store) -> None:
    plane = ControlPlane(store, min_samples=5)
    _, attacker = plane.create_tenant("attacker")
    _, worker = plane.create_tenant("worker")
    budgets = Budgets(message_timeout_s=2.0)
    acked: list[str] = []
    with (
        running(plane, budgets=budgets) as server,
        grpc.insecure_channel(server.target) as channel,
        ControlPlaneClient(server.target, worker, timeout_s=10) as w,
        ControlPlaneClient(server.target, attacker) as a,
    ):
        a.record_tool_calls([ToolCall("a0", "p", "bash", "ls", 0.2)])
        half_open = HalfOpen(channel)
        stub = model_pb2_grpc.ModelServiceStub(channel)  # type: ignore[no-untyped-call]
        streams = [
            stub.WatchSnapshots(model_pb2.WatchSnapshotsRequest(), metadata=_meta(attacker))
            for _ in range(300)
        ]
        stop = threading.Event()
        out: list[list[float]] = []
        job = threading.Thread(target=lambda: out.append(_work(w, stop, acked)))
        job.start()
        try:
            for _ in range(3):
                half_open.open(100)  # no token
                half_open.open(50, metadata=_meta(attacker))
                for _ in range(50):
                    half_open.open(1, metadata=_meta("cttl_" + secrets.token_urlsafe(32)))
                time.sleep(1.0)
            assert all(next(s).version >= 1 for s in streams)
            assert healthy(channel)
        finally:
            stop.set()
            job.join(timeout=60)
            half_open.close()
            for s in streams:
                s.cancel()
        (latencies,) = out
        assert len(latencies) > 10
        assert max(latencies) < BOUND_S, f"worst call {max(latencies):.3f} s"
    assert store.count_tool_calls("worker") == len(acked) == len(set(acked))
    stored = {r.call.event_id for r in store.read_tool_calls(0, 10**6, tenant="worker")}
    assert stored == set(acked)
    restarted = ControlPlane(store, min_samples=5)  # the server's final snapshot + tail
    assert restarted.list_tools("worker") == plane.list_tools("worker")
    assert restarted.state.version == plane.state.version
