"""Never-read snapshot streams share one encoded snapshot and hold a bounded share of
gRPC's send buffers, and what they held is given back when they end
(controlplane.rpc.sends; the figures at 1,000 streams: ``cachettl bench memory``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import grpc
import pytest

from controlplane._gen.cachettl.v1 import model_pb2, model_pb2_grpc
from controlplane.records import ToolCall
from controlplane.rpc.client import ControlPlaneClient
from controlplane.rpc.gate import Budgets
from controlplane.service import ControlPlane
from controlplane.storage import create_store

STREAMS = 200
BUDGET = 1 << 20


@pytest.fixture
def plane() -> Iterator[ControlPlane]:
    store = create_store("memory://")
    yield ControlPlane(store)
    store.close()


def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def _fill(plane: ControlPlane, name: str, tools: int, samples: int) -> str:
    tenant, token = plane.create_tenant(name)
    calls = [
        ToolCall(f"{t}-{i}", f"p{t}", f"tool{t:03d}", "", 0.5 + (i * 7919 % 1000) / 100)
        for t in range(tools)
        for i in range(samples)
    ]
    for start in range(0, len(calls), 5000):
        plane.record_tool_calls(tenant, calls[start : start + 5000])
    return token


def test_never_read_streams_share_one_snapshot_within_the_send_budget(
    plane: ControlPlane, serve: Callable[..., AbstractContextManager[Any]]
) -> None:
    big = _fill(plane, "big", tools=100, samples=300)  # a snapshot of about 250 KB
    calm = _fill(plane, "calm", tools=2, samples=50)
    budgets = Budgets(
        send_bytes_per_tenant=BUDGET, streams_per_peer=2 * STREAMS, streams_per_tenant=2 * STREAMS
    )
    with serve(plane, budgets=budgets, watch_interval_s=0.1) as server:
        servicer = server.server._servicer
        written: list[object] = []
        write = servicer._write

        async def spy(method: str, tenant: Any, context: Any, item: object, closed: Any) -> bool:
            if method == "WatchSnapshots":
                written.append(item)
            return bool(await write(method, tenant, context, item, closed))

        servicer._write = spy
        # A client whose HTTP/2 windows never grow and which never reads.
        options = [("grpc.http2.bdp_probe", 0)]
        channels = [grpc.insecure_channel(server.target, options) for _ in range(2)]
        auth = (("authorization", f"Bearer {big}"),)
        request = model_pb2.WatchSnapshotsRequest()
        calls = [
            model_pb2_grpc.ModelServiceStub(channels[k % 2]).WatchSnapshots(  # type: ignore[no-untyped-call]
                request, metadata=auth
            )
            for k in range(STREAMS)
        ]
        try:
            _until(lambda: len(written) == STREAMS, 60.0, "every stream to have its snapshot")
            size = len(written[0])  # type: ignore[arg-type]
            assert size > 200_000
            # One encoding, one object, however many streams.
            assert len({id(item) for item in written}) == 1
            assert servicer.plane._payloads.encodings == 1
            # gRPC's copies: the budget's worth, not a snapshot per stream.
            assert servicer.snapshot_streams == STREAMS
            assert servicer.sends.held <= BUDGET + size
            assert servicer.sends.waiting >= STREAMS - (BUDGET // size + 1)
            # Another tenant's reading stream is served meanwhile.
            with ControlPlaneClient(server.target, calm) as reader:
                first = next(iter(reader.watch_snapshots(timeout_s=30)))
                assert first.version > 0
                assert len(first.models) >= 2
        finally:
            for call in calls:
                call.cancel()
            for channel in channels:
                channel.close()
        # What they held is given back once they end.
        _until(lambda: servicer.snapshot_streams == 0, 30.0, "the streams to end")
        _until(lambda: servicer.sends.held == servicer.sends.waiting == 0, 30.0, "the budget back")
        assert servicer.sends.abandoned == 0
        assert servicer.payload_bytes() == 0


def test_revoking_a_tenant_ends_its_streams_waiting_for_room(
    plane: ControlPlane, serve: Callable[..., AbstractContextManager[Any]]
) -> None:
    big = _fill(plane, "big", tools=100, samples=300)
    budgets = Budgets(send_bytes_per_tenant=BUDGET)
    with serve(plane, budgets=budgets, watch_interval_s=0.1) as server:
        servicer = server.server._servicer
        channel = grpc.insecure_channel(server.target, [("grpc.http2.bdp_probe", 0)])
        stub = model_pb2_grpc.ModelServiceStub(channel)  # type: ignore[no-untyped-call]
        auth = (("authorization", f"Bearer {big}"),)
        request = model_pb2.WatchSnapshotsRequest()
        calls = [stub.WatchSnapshots(request, metadata=auth) for _ in range(30)]
        try:
            _until(lambda: servicer.sends.waiting >= 20, 30.0, "streams waiting for room")
            plane.store.revoke_tenant("big", time.time())
            _until(lambda: servicer.snapshot_streams == 0, 10.0, "every stream to end")
            assert servicer.sends.waiting == 0
            assert servicer.sends.held + servicer.sends.abandoned <= 2 * BUDGET
        finally:
            for call in calls:
                call.cancel()
            channel.close()
        _until(lambda: servicer.sends.held == servicer.sends.abandoned == 0, 30.0, "room back")
