"""Streams and reports one tenant cannot turn against the server or another tenant, on a
real server: unread moves bounded per stream, tenant and server (coalesced per program, the
slowest reader dropped); streams ended by a revoked or rotated token; arrivals refused one
by one (a bad program id, a clock set ahead); moved pins counted; ids bounded."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import grpc
import pytest

from controlplane._gen.cachettl.v1 import cluster_pb2, cluster_pb2_grpc, model_pb2, model_pb2_grpc
from controlplane.records import Move, PinOutcome, ToolCall
from controlplane.rpc.auth import AuthOptions
from controlplane.rpc.client import ControlPlaneClient
from controlplane.rpc.coherence import AHEAD_S
from controlplane.rpc.gate import Budgets
from controlplane.rpc.moves import CoherenceHub
from controlplane.service import ControlPlane
from controlplane.storage import create_store


@pytest.fixture
def plane() -> Iterator[ControlPlane]:
    store = create_store("memory://")
    yield ControlPlane(store)
    store.close()


@pytest.fixture
def server(plane: ControlPlane, serve: Callable[..., AbstractContextManager[Any]]) -> Iterator[Any]:
    # Tokens looked up again every 0.2 s and streams rechecked every 0.1 s, so that a
    # revocation is seen within a second here.
    auth = AuthOptions(fresh_s=0.2, stale_s=300.0)
    with serve(plane, auth=auth, watch_interval_s=0.1) as running:
        yield running


class Follower:
    """Reads a server stream in a thread: items in ``items``, its end code in ``ended``."""

    def __init__(self, stream: Iterator[Any]) -> None:
        self.items: queue.Queue[Any] = queue.Queue()
        self.ended: queue.Queue[grpc.StatusCode | None] = queue.Queue()
        self._stream = stream
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        try:
            for item in self._stream:
                self.items.put(item)
            self.ended.put(None)
        except grpc.RpcError as error:
            self.ended.put(error.code())


def _hub(server: Any) -> CoherenceHub:
    hub: CoherenceHub = server.server._servicer.coherence
    return hub


def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)


def _ready(client: ControlPlaneClient, follower: Follower, engine_id: str) -> None:
    """Return once ``follower``'s WatchMoves stream of ``engine_id`` hears moves."""
    for attempt in range(50):
        probe = f"probe-{attempt}"
        client.report_arrivals(engine_id, [(probe, time.time())])
        client.report_arrivals("probe-engine", [(probe, time.time())])
        try:
            if follower.items.get(timeout=0.2).program_id == probe:
                return
        except queue.Empty:
            continue
    raise AssertionError("WatchMoves never delivered a probe move")


def _registered(server: Any, tenant: str, n: int) -> None:
    _until(lambda: len(_hub(server)._of_tenant.get(tenant, ())) == n, 5.0, f"{n} watchers")


def test_streams_that_never_read_hold_bounded_moves(plane: ControlPlane, server: Any) -> None:
    """Eight streams of one tenant that never read, 4,000 moves told to them: the unread
    moves stay within the tenant's bound, the slowest streams are dropped (counted), and
    another tenant's stream still hears its moves at once."""
    hub = CoherenceHub(stream_moves=64, tenant_moves=256, server_moves=1024)
    server.server._servicer.coherence = hub  # smaller bounds, before any call
    _, acme = plane.create_tenant("acme")
    _, other = plane.create_tenant("other")
    channel = grpc.insecure_channel(server.target)
    stub = cluster_pb2_grpc.PinCoherenceServiceStub(channel)  # type: ignore[no-untyped-call]
    auth = (("authorization", f"Bearer {acme}"),)
    calls = [
        stub.WatchMoves(cluster_pb2.WatchMovesRequest(engine_id=f"w{k}"), metadata=auth)
        for k in range(8)
    ]  # never read
    reader = ControlPlaneClient(server.target, other)
    heard = Follower(reader.watch_moves("engine-a"))
    client = ControlPlaneClient(server.target, acme)
    try:
        _registered(server, "acme", 8)
        _registered(server, "other", 1)
        peak = 0
        for k in range(8):
            programs = [f"w{k}-p{i}" for i in range(500)]
            for part in range(0, 500, 250):
                client.report_arrivals(f"w{k}", [(p, time.time()) for p in programs[part:][:250]])
                client.report_arrivals("x", [(p, time.time()) for p in programs[part:][:250]])
                peak = max(peak, hub.unread)
        assert peak <= 256
        assert hub.streams_dropped >= 1
        assert hub.moves_dropped > 0
        # The other tenant is unaffected: its move is told at once.
        reader.report_arrivals("engine-a", [("q1", time.time())])
        reader.report_arrivals("engine-b", [("q1", time.time())])
        assert heard.items.get(timeout=2.0).program_id == "q1"
    finally:
        for call in calls:
            call.cancel()
        channel.close()
        reader.close()
        client.close()


def test_a_newer_move_of_a_program_supersedes_its_unread_one() -> None:
    async def scenario() -> None:
        hub = CoherenceHub(stream_moves=4, tenant_moves=16, server_moves=16)
        stream = hub.watch("acme", "w")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # registered, waiting
        hub.tell("acme", [Move("p1", "w", "x", 1.0)])
        assert (await first).program_id == "p1"
        for i in range(10):  # nobody reads meanwhile
            hub.tell("acme", [Move("p2", "w", f"x{i}", 2.0 + i)])
        assert hub.unread == 1
        assert hub.moves_coalesced == 9
        latest = await anext(stream)
        assert (latest.program_id, latest.to_engine_id) == ("p2", "x9")
        for i in range(5):  # five distinct programs unread: past the stream's bound
            hub.tell("acme", [Move(f"q{i}", "w", "x", 20.0)])
        assert hub.streams_dropped == 1
        assert hub.unread == 0
        with pytest.raises(Exception, match="dropped"):
            await anext(stream)

    asyncio.run(scenario())


def test_moves_kept_for_engines_away_count_toward_the_bounds_and_give_way_first() -> None:
    async def scenario() -> None:
        hub = CoherenceHub(stream_moves=64, tenant_moves=8, server_moves=64)
        for engine in ("a", "b"):  # each engine's stream opens, then ends: engines away
            stream = hub.watch("acme", engine)
            waiting = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator
        now = time.time()
        hub.tell("acme", [Move(f"p{i}", "a", "x", now) for i in range(6)])
        hub.tell("acme", [Move(f"q{i}", "b", "x", now) for i in range(6)])
        assert hub.kept == 8  # the tenant's bound, not 12
        assert hub.moves_dropped == 4
        watching = hub.watch("acme", "w")  # a live stream that does not read (yet)
        first = asyncio.ensure_future(anext(watching))
        await asyncio.sleep(0)
        hub.tell("acme", [Move(f"r{i}", "w", "x", now) for i in range(5)])
        assert hub.streams_dropped == 0  # kept moves were freed, no stream dropped
        assert (hub.unread, hub.kept) == (5, 3)
        assert (await first).program_id == "r0"
        # the oldest kept went first: p0..p4 of engine a; engine b still has q0 and q1
        back = hub.watch("acme", "b")  # engine b returns: it reads what is kept for it
        assert [(await anext(back)).program_id for _ in range(2)] == ["q0", "q1"]
        assert hub.kept == 1  # p5, for engine a

    asyncio.run(scenario())


def _churn(big: ControlPlaneClient, small: ControlPlaneClient, stop: threading.Event) -> None:
    """New models until ``stop``: ``big``'s of 300 tools (whole snapshots of about a
    megabyte), ``small``'s of one."""
    for i in itertools.count():
        if stop.is_set():
            return
        calls = [
            ToolCall(f"e{i}-{k}", f"p{i}", f"tool{(i * 7 + k) % 300}", f"a{k % 5}", 1.5)
            for k in range(200)
        ]
        big.record_tool_calls(calls)
        small.record_tool_calls([ToolCall(f"c{i}", f"p{i}", "bash", "ls", 0.2)])


def test_a_snapshot_stream_whose_client_stops_reading_is_ended(
    plane: ControlPlane, serve: Callable[..., AbstractContextManager[Any]]
) -> None:
    """gRPC's flow control stops a stream's writes once its client's window is full; a
    write that waits past the slow-reader timeout ends the stream, and the other tenant's
    stream, read, goes on."""
    _, slow_token = plane.create_tenant("slow")
    _, calm_token = plane.create_tenant("calm")
    budgets = Budgets(slow_reader_s=1.0)
    with serve(plane, budgets=budgets, watch_interval_s=0.1) as server:
        slow = ControlPlaneClient(server.target, slow_token)
        calm = ControlPlaneClient(server.target, calm_token)
        channel = grpc.insecure_channel(server.target)
        stub = model_pb2_grpc.ModelServiceStub(channel)  # type: ignore[no-untyped-call]
        unread = stub.WatchSnapshots(  # whole snapshots, never read
            model_pb2.WatchSnapshotsRequest(),
            metadata=(("authorization", f"Bearer {slow_token}"),),
        )
        reading = Follower(calm.watch_snapshots())
        registry = server.server._servicer.metrics.registry
        stop = threading.Event()
        feeding = threading.Thread(target=_churn, args=(slow, calm, stop), daemon=True)
        feeding.start()
        try:
            _until(
                lambda: (
                    registry.get_sample_value(
                        "cachettl_slow_streams_dropped_total", {"method": "WatchSnapshots"}
                    )
                    == 1.0
                ),
                60.0,
                "the unread stream to be ended",
            )
            with pytest.raises(grpc.RpcError) as ended:
                for _ in unread:
                    pass
            assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "took no message for 1 s" in (ended.value.details() or "")
            assert reading.ended.empty()  # the reading stream goes on
            assert reading.items.qsize() >= 1
        finally:
            stop.set()
            feeding.join()
            unread.cancel()
            channel.close()
            slow.close()
            calm.close()


def test_revoking_a_tenant_ends_its_streams(plane: ControlPlane, server: Any) -> None:
    _, token = plane.create_tenant("acme")
    client = ControlPlaneClient(server.target, token)
    try:
        moves = Follower(client.watch_moves("engine-a"))
        snapshots = Follower(client.watch_snapshots())
        _ready(client, moves, "engine-a")
        plane.store.revoke_tenant("acme", time.time())
        assert moves.ended.get(timeout=5.0) == grpc.StatusCode.PERMISSION_DENIED
        assert snapshots.ended.get(timeout=5.0) == grpc.StatusCode.PERMISSION_DENIED
        assert server.server._servicer.gate.streams_revoked >= 1
    finally:
        client.close()


def test_rotating_a_token_ends_the_old_tokens_streams(plane: ControlPlane, server: Any) -> None:
    _, old = plane.create_tenant("acme")
    client = ControlPlaneClient(server.target, old)
    try:
        moves = Follower(client.watch_moves("engine-a"))
        _ready(client, moves, "engine-a")
        _, new = plane.rotate_token("acme")
        assert moves.ended.get(timeout=5.0) == grpc.StatusCode.UNAUTHENTICATED
        with ControlPlaneClient(server.target, new) as fresh:
            assert fresh.report_arrivals("engine-a", [("p1", time.time())]) == 0
        with pytest.raises(grpc.RpcError) as refused:
            client.report_arrivals("engine-a", [("p1", time.time())])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        client.close()


def test_a_bad_arrival_is_refused_alone(plane: ControlPlane, server: Any) -> None:
    """A bad program id among good ones: the good ones are stored (their moves told), the
    bad one named; and the server counts the refusals."""
    _, token = plane.create_tenant("acme")
    client = ControlPlaneClient(server.target, token)
    try:
        now = time.time()
        arrivals = [("p1", now), ("p" * 65_000, now), ("p2", now), ("", now), ("p3", now)]
        answer = client.report_arrivals_answer("engine-a", arrivals)
        assert answer.refused == 2
        reasons = {r.index: r.reason for r in answer.refusals}
        assert set(reasons) == {1, 3}
        assert reasons[1].startswith("arrivals[1].program_id:")
        assert len(reasons[1]) < 200  # the id is not echoed
        assert reasons[3].startswith("arrivals[3].program_id:")
        # The good arrivals were stored: each one's next arrival elsewhere is a move.
        assert client.report_arrivals("engine-b", [("p1", now), ("p2", now), ("p3", now)]) == 3
        assert _hub(server).arrivals_refused == 2
    finally:
        client.close()


def test_an_arrival_from_a_clock_set_ahead_is_refused(plane: ControlPlane, server: Any) -> None:
    """``now + 20 h`` would reach the engine told of the move as a 72,000 s tool call: it is
    refused, naming the field; a little ahead is told as the server's now."""
    _, token = plane.create_tenant("acme")
    client = ControlPlaneClient(server.target, token)
    watcher = Follower(client.watch_moves("engine-a"))
    try:
        _ready(client, watcher, "engine-a")
        now = time.time()
        client.report_arrivals("engine-a", [("p1", now), ("p2", now)])
        answer = client.report_arrivals_answer(
            "engine-b", [("p1", now + 72_000.0), ("p2", now + AHEAD_S / 2)]
        )
        assert answer.refused == 1
        assert answer.refusals[0].index == 0
        assert answer.refusals[0].reason.startswith("arrivals[0].arrived_at:")
        assert "ahead of the server's clock" in answer.refusals[0].reason
        moved = watcher.items.get(timeout=2.0)
        assert moved.program_id == "p2"
        assert moved.arrived_at.ToNanoseconds() / 1e9 <= time.time()
        assert watcher.items.empty()
    finally:
        client.close()


def test_a_moved_pin_is_an_outcome_counted_per_tool(plane: ControlPlane, server: Any) -> None:
    _, token = plane.create_tenant("acme")
    with ControlPlaneClient(server.target, token) as client:
        calls = [
            ToolCall(f"e{i}", "p1", "bash", "", 1.5, time.time(), i, 10.0, outcome)
            for i, outcome in enumerate((PinOutcome.MOVED, PinOutcome.HIT, PinOutcome.MOVED))
        ]
        assert client.record_tool_calls(calls).accepted == 3
        _until(lambda: bool(client.list_tools().tools), 5.0, "the calls learned")
        (tool,) = client.list_tools().tools
        assert (tool.pins.moved, tool.pins.hits, tool.pins.hit_rate) == (2, 1, 1.0)


LONG = "x" * 65_000


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.report_arrivals(LONG, [("p", time.time())]), "engine_id"),
        (lambda c: next(c.watch_moves(LONG, timeout_s=5.0)), "engine_id"),
        (lambda c: c.decide_ttl(LONG), "tool_name"),
        (lambda c: c.tool_distribution(LONG), "tool_name"),
        (
            lambda c: c.record_tool_calls([ToolCall(LONG, "p", "bash", "", 1.0)]),
            "events[0].event_id",
        ),
        (
            lambda c: c.record_tool_calls([ToolCall("e", LONG, "bash", "", 1.0)]),
            "events[0].program_id",
        ),
    ],
)
def test_a_huge_id_is_refused_naming_the_field_without_echoing_it(
    plane: ControlPlane, server: Any, call: Callable[[ControlPlaneClient], Any], field: str
) -> None:
    _, token = plane.create_tenant("acme")
    with ControlPlaneClient(server.target, token) as client:
        with pytest.raises(grpc.RpcError) as refused:
            call(client)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"{field}:")
        assert len(refused.value.details()) < 300


def test_a_tenant_reporting_too_many_arrivals_is_refused_alone(
    plane: ControlPlane, serve: Callable[..., AbstractContextManager[Any]]
) -> None:
    _, flood = plane.create_tenant("flood")
    _, quiet = plane.create_tenant("quiet")
    # a second's worth of burst: the first batch takes it whole, the second would need a
    # second of refill (on a loaded machine the first report alone may take a third)
    with (
        serve(plane, budgets=Budgets(arrivals_per_tenant_s=1000)) as server,
        ControlPlaneClient(server.target, flood) as loud,
        ControlPlaneClient(server.target, quiet) as calm,
    ):
        batch = [(f"p{i}", time.time()) for i in range(1000)]
        assert loud.report_arrivals("engine-a", batch) == 0
        with pytest.raises(grpc.RpcError) as refused:
            loud.report_arrivals("engine-b", batch)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "arrivals of this tenant" in refused.value.details()
        assert calm.report_arrivals("engine-a", batch) == 0  # another tenant's own rate
