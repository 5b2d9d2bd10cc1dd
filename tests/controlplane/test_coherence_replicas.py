"""Pin coherence behind two replicas on one PostgreSQL schema: a move reported through one
replica reaches the watchers of the engine left on both, once each; a return to the same
engine, a refused report and a forgotten program tell nothing; the locations table stays
bounded, a full batch of the longest ids fits the notification limit, a lost listening
connection is re-established (logged once), and a listener that fails otherwise is logged and
started again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from controlplane.records import Move
from controlplane.rpc.client import ControlPlaneClient
from controlplane.rpc.moves import CoherenceHub
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from controlplane.storage.locations import Published, SharedLocations, channel_of
from controlplane.storage.sql import SqlStore

from .conftest import pg_url
from .test_coherence import Watcher

#: A move reaches the other replica's watcher within this: about a second, with room for a
#: loaded machine.
TOLD_WITHIN_S = 2.0
#: How long a watcher waits for a move whose order, not speed, is checked.
WAIT_S = 10.0


@dataclass
class Replica:
    """One ``cachettl serve`` replica: its plane, server, and a reporting client."""

    plane: ControlPlane
    server: Any
    client: ControlPlaneClient

    def watcher(self, token: str, engine_id: str) -> Watcher:
        return Watcher(self.server.target, token, engine_id)


@dataclass
class Cluster:
    a: Replica
    b: Replica
    token: str
    url: str


Serve = Callable[..., AbstractContextManager[Any]]


def start_cluster(stack: ExitStack, url: str, serve: Serve) -> Cluster:
    """Two replicas on the schema of ``url`` and tenant ``acme``, stopped with ``stack``."""
    planes = []
    for _ in range(2):
        store = create_store(url)
        stack.callback(store.close)
        planes.append(ControlPlane(store))
    _, token = planes[0].create_tenant("acme")
    replicas = []
    for plane in planes:
        server = stack.enter_context(serve(plane))
        client = ControlPlaneClient(server.target, token)
        stack.callback(client.close)
        replicas.append(Replica(plane, server, client))
    return Cluster(replicas[0], replicas[1], token, url)


@pytest.fixture
def cluster(pg_schemas: Callable[[], str], serve: Serve) -> Iterator[Cluster]:
    with ExitStack() as stack:
        yield start_cluster(stack, pg_url(pg_schemas()), serve)


def settle(watcher: Watcher, reporter: ControlPlaneClient, name: str) -> None:
    """Send a marker move through ``reporter`` and read the watcher's moves up to it: what
    came before along the same path is consumed, and nothing else may come first."""
    reporter.report_arrivals("engine-a", [(name, time.time())])
    reporter.report_arrivals("engine-z", [(name, time.time())])
    assert watcher.moves.get(timeout=WAIT_S) == (name, "engine-z")


def drain(watcher: Watcher, reporter: ControlPlaneClient, name: str) -> None:
    """Read the watcher's moves up to a marker sent through ``reporter`` (all that came
    before it along the same path is consumed)."""
    reporter.report_arrivals("engine-a", [(name, time.time())])
    reporter.report_arrivals("engine-z", [(name, time.time())])
    while watcher.moves.get(timeout=WAIT_S) != (name, "engine-z"):
        pass


def next_move(watcher: Watcher) -> tuple[str, str]:
    return watcher.moves.get(timeout=WAIT_S)


def located(url: str, program: str) -> str | None:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            query = text("SELECT engine_id FROM program_locations WHERE program_id = :p")
            return c.execute(query, {"p": program}).scalar()
    finally:
        engine.dispose()


def test_a_move_through_one_replica_reaches_watchers_on_both_once(cluster: Cluster) -> None:
    a, b = cluster.a, cluster.b
    with ExitStack() as stack:
        on_a = a.watcher(cluster.token, "engine-a")
        stack.callback(on_a.close)
        on_a.ready(b.client, "engine-a")  # through B: A's listener is up
        on_b = b.watcher(cluster.token, "engine-a")
        stack.callback(on_b.close)
        on_b.ready(a.client, "engine-a")  # through A: B's listener is up
        # Each watcher also heard the other's probes, from its own replica: drain them.
        drain(on_a, b.client, "sync-1")  # on_b holds sync-1, from B at once
        drain(on_b, a.client, "sync-2")  # on_a holds sync-2, from A at once
        assert next_move(on_a) == ("sync-2", "engine-z")
        assert a.client.report_arrivals("engine-a", [("p1", time.time())]) == 0  # new
        sent = time.monotonic()
        assert b.client.report_arrivals("engine-b", [("p1", time.time())]) == 1
        assert next_move(on_a) == ("p1", "engine-b")  # from B, through PostgreSQL
        assert time.monotonic() - sent < TOLD_WITHIN_S
        assert next_move(on_b) == ("p1", "engine-b")  # B's own watcher, at once
        assert located(cluster.url, "p1") == "engine-b"
        # B hears its own notification of p1 before A's of the marker: it must skip it.
        settle(on_b, a.client, "after-b")
        assert next_move(on_a) == ("after-b", "engine-z")  # A told its watcher at once
        # The same the other way: A tells its watcher, then skips its own notification.
        a.client.report_arrivals("engine-a", [("p2", time.time())])
        assert a.client.report_arrivals("engine-c", [("p2", time.time())]) == 1
        assert next_move(on_a) == ("p2", "engine-c")
        assert next_move(on_b) == ("p2", "engine-c")
        settle(on_a, b.client, "after-a")
        assert next_move(on_b) == ("after-a", "engine-z")
        assert on_a.moves.empty()
        assert on_b.moves.empty()


def _watching(replica: Replica, engine: str) -> int:
    hub = replica.server.server.servicer.coherence
    return int(replica.server.run(_streams_of(hub, engine)))


async def _streams_of(hub: CoherenceHub, engine: str) -> int:
    return hub.watching("acme").get(engine, 0)


def test_a_move_told_between_two_streams_of_the_engine_reaches_the_next_one(
    cluster: Cluster,
) -> None:
    """engine-a's stream on A ends (its connection broke) and engine-a reconnects a moment
    later: the move reported through B meanwhile is the first thing its new stream reads
    (it used to be lost, its pin held until its TTL)."""
    a, b = cluster.a, cluster.b
    on_a = a.watcher(cluster.token, "engine-a")
    on_a.ready(b.client, "engine-a")  # through B: A's listener is up
    assert a.client.report_arrivals("engine-a", [("p1", time.time())]) == 0
    on_a.close()
    deadline = time.monotonic() + WAIT_S
    while _watching(a, "engine-a") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _watching(a, "engine-a") == 0  # the stream ended on A
    assert b.client.report_arrivals("engine-b", [("p1", time.time())]) == 1
    time.sleep(0.5)  # the notification reaches A while engine-a has no stream there
    again = a.watcher(cluster.token, "engine-a")
    try:
        assert next_move(again) == ("p1", "engine-b")
        settle(again, b.client, "after-resume")
        assert again.moves.empty()
    finally:
        again.close()


def test_a_return_to_the_same_engine_or_a_refused_arrival_tells_nothing(
    cluster: Cluster,
) -> None:
    a, b = cluster.a, cluster.b
    on_a = a.watcher(cluster.token, "engine-a")
    try:
        on_a.ready(b.client, "engine-a")
        assert a.client.report_arrivals("engine-a", [("p1", time.time())]) == 0
        # Back on engine-a, reported through the other replica: no move.
        assert b.client.report_arrivals("engine-a", [("p1", time.time()), ("p1", 1.0)]) == 0
        answer = b.client.report_arrivals_answer("engine-c", [("", time.time())])
        assert (answer.moved, answer.refused) == (0, 1)
        assert answer.refusals[0].reason.startswith("arrivals[0].program_id:")
        assert located(cluster.url, "p1") == "engine-a"  # the refused arrival stored nothing
        settle(on_a, b.client, "marker")  # nothing came before the marker
        assert a.client.report_arrivals("engine-a", [("p1", time.time())]) == 0
    finally:
        on_a.close()


def test_a_late_report_keeps_the_later_location_and_tells_its_engine(cluster: Cluster) -> None:
    """engine-a's report of a turn comes after the program's next turn on engine-b was
    reported (tried again after a failure, say): the location stays engine-b and engine-a
    is told its program went there, through its own replica and through the other."""
    a, b = cluster.a, cluster.b
    on_a = a.watcher(cluster.token, "engine-a")
    try:
        on_a.ready(b.client, "engine-a")
        drain(on_a, a.client, "sync")
        now = time.time()
        for program, late_via in (("late-1", a.client), ("late-2", b.client)):
            assert b.client.report_arrivals("engine-b", [(program, now)]) == 0  # new
            assert late_via.report_arrivals("engine-a", [(program, now - 3.0)]) == 1
            assert next_move(on_a) == (program, "engine-b")
            assert located(cluster.url, program) == "engine-b"
            # engine-b's own next turn there is no move
            assert a.client.report_arrivals("engine-b", [(program, now + 1.0)]) == 0
        settle(on_a, b.client, "after-late")
        assert on_a.moves.empty()
    finally:
        on_a.close()


def test_a_full_batch_of_the_longest_ids_is_split_under_the_notify_limit(
    cluster: Cluster,
) -> None:
    """1,000 moves of 256-character ids that JSON escapes to 6 bytes a character, between
    64-character engine ids that escape to 2: one payload would be ~1.6 MB."""
    a, b = cluster.a, cluster.b
    left, went = "a" + '"' * 63, "b" + "\\" * 63
    programs = [f"{i:04d}" + "\x01" * 252 for i in range(1000)]
    on_a = a.watcher(cluster.token, left)
    try:
        on_a.ready(b.client, left)
        assert a.client.report_arrivals(left, [(p, 5.0) for p in programs]) == 0
        assert b.client.report_arrivals(went, [(p, 6.0) for p in programs]) == 1000
        told = [on_a.moves.get(timeout=WAIT_S) for _ in programs]
        assert sorted(told) == [(p, went) for p in programs]
    finally:
        on_a.close()


def _rows(store: SqlStore) -> int:
    with store.engine.connect() as c:
        return int(c.execute(text("SELECT count(*) FROM program_locations")).scalar_one())


def test_the_locations_table_is_pruned_by_age_off_the_report_path(
    pg_schemas: Callable[[], str],
) -> None:
    store = SqlStore(pg_url(pg_schemas()))
    try:
        tenant = store.create_tenant("acme", False, "h", 0.0)
        shared = SharedLocations(store.engine, keep_s=60.0, prune_every_s=30.0, batch=7)
        old = [(f"p{i}", 1.0) for i in range(50)]
        assert shared.report(tenant, "engine-a", old, "r1", now=1000.0) == []
        assert shared.report(tenant, "engine-a", [("q", 2.0)], "r1", now=1061.0) == []
        assert _rows(store) == 51  # a report never prunes: the replica's upkeep does
        assert shared.maintain(1061.0) == 50  # in batches of 7
        assert _rows(store) == 1
        assert shared.report(tenant, "engine-a", [("r", 3.0)], "r1", now=1070.0) == []
        assert shared.maintain(1090.0) == 0  # 29 s since the last pruning: none due
        assert shared.report(tenant, "engine-a", [("s", 4.0)], "r1", now=1125.0) == []
        # A forgotten program arriving elsewhere is new there: no move.
        assert shared.report(tenant, "engine-b", [("p7", 5.0)], "r1", now=1126.0) == []
        moved = shared.report(tenant, "engine-b", [("s", 6.0)], "r2", now=1127.0)
        assert [(m.program_id, m.from_engine, m.to_engine) for m in moved] == [
            ("s", "engine-a", "engine-b")
        ]
        assert shared.prune(10_000.0) == 4
        assert _rows(store) == 0
        with pytest.raises(ValueError, match="keep_s must be > 0"):
            SharedLocations(store.engine, keep_s=0.0)
    finally:
        store.close()


def test_a_tenant_keeps_at_most_its_bound_of_locations(pg_schemas: Callable[[], str]) -> None:
    """One tenant reporting many programs is trimmed to its bound, least recently seen
    first, in batches, by the replica's upkeep; another tenant's rows are untouched."""
    store = SqlStore(pg_url(pg_schemas()))
    try:
        flood = store.create_tenant("flood", False, "h1", 0.0)
        quiet = store.create_tenant("quiet", False, "h2", 0.0)
        shared = SharedLocations(store.engine, max_programs=300, trim_check=200, batch=50)
        shared.report(quiet, "engine-a", [(f"q{i}", 1.0) for i in range(20)], "r1", now=100.0)
        for n in range(10):
            programs = [(f"p{n}-{i}", 1.0) for i in range(100)]
            shared.report(flood, "engine-a", programs, "r1", now=100.0 + n)
            shared.maintain(100.0 + n)
        with store.engine.connect() as c:
            counts: dict[int, int] = dict(
                c.execute(
                    text("SELECT tenant_id, count(*) FROM program_locations GROUP BY tenant_id")
                ).all()
            )
            kept = {
                row[0]
                for row in c.execute(
                    text("SELECT program_id FROM program_locations WHERE tenant_id = :t"),
                    {"t": flood.id},
                )
            }
        assert counts[flood.id] <= 300 + 200  # the bound, plus what arrives between looks
        assert counts[quiet.id] == 20
        assert {f"p9-{i}" for i in range(100)} <= kept  # the newest are kept
        assert shared.trimmed >= 500
    finally:
        store.close()


def test_a_sqlite_store_has_no_shared_locations(tmp_path: Any) -> None:
    store = SqlStore(f"sqlite:///{tmp_path / 'c.sqlite3'}")
    try:
        with pytest.raises(ValueError, match="need PostgreSQL, got sqlite"):
            SharedLocations(store.engine)
    finally:
        store.close()


def test_a_lost_listening_connection_is_reestablished_and_logged_once(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = cluster.a, cluster.b
    on_a = a.watcher(cluster.token, "engine-a")
    caplog.set_level(logging.INFO, logger="controlplane.storage.locations")
    schema = cluster.url.rsplit("%3D", 1)[1]
    kill = text(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE application_name = 'cachettl-moves' AND query LIKE :listen"
    )
    engine = create_engine(cluster.url)
    try:
        on_a.ready(b.client, "engine-a")
        with engine.connect() as c:
            listen = f'LISTEN "{channel_of(schema)}"%'
            assert c.execute(kill, {"listen": listen}).scalar() == 1
        on_a.ready(b.client, "engine-a")  # heard again through the new connection
        lost = [r for r in caplog.records if "database unreachable" in r.getMessage()]
        assert len(lost) == 1
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        engine.dispose()
        on_a.close()


def test_a_listener_that_cannot_connect_logs_once_and_keeps_trying(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens on port 1: every attempt fails; one warning for the outage."""
    dead = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/test")
    shared = SharedLocations(dead)
    caplog.set_level(logging.WARNING, logger="controlplane.storage.locations")
    heard: queue.Queue[object] = queue.Queue()

    async def follow() -> None:
        async for published in shared.listen():
            heard.put(published)

    async def run_a_while() -> None:
        task = asyncio.create_task(follow())
        await asyncio.sleep(1.0)  # attempts at 0, 0.1, 0.3, 0.7 s
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run_a_while())
    dead.dispose()
    lost = [r for r in caplog.records if "database unreachable" in r.getMessage()]
    assert len(lost) == 1
    assert heard.empty()


def test_replicas_of_another_schema_hear_nothing(
    cluster: Cluster, pg_schemas: Callable[[], str], serve: Serve
) -> None:
    """Another schema of the same database has its own channel: its replicas are not told
    of this schema's moves, even for a tenant and engine of the same names."""
    with ExitStack() as stack:
        other = start_cluster(stack, pg_url(pg_schemas()), serve)
        watcher = other.a.watcher(other.token, "engine-a")
        try:
            watcher.ready(other.b.client, "engine-a")
            cluster.b.client.report_arrivals("engine-a", [("p1", time.time())])
            assert cluster.b.client.report_arrivals("engine-b", [("p1", time.time())]) == 1
            # On one channel, p1's notification would come before this marker's.
            settle(watcher, other.b.client, "marker")
        finally:
            watcher.close()


class _FailsOnce(SharedLocations):
    """Shared locations whose first listener fails with an error nobody planned for; the
    second hears one move from another replica."""

    def __init__(self) -> None:  # no database: only ``listen`` is used
        self.listens = 0

    async def listen(self) -> AsyncIterator[Published]:
        self.listens += 1
        if self.listens == 1:
            raise RuntimeError("a listener bug")
        yield Published("other", "acme", (Move("p1", "engine-a", "engine-b", 5.0),))
        await asyncio.sleep(3600)


def test_a_listener_that_fails_unexpectedly_is_logged_and_started_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shared = _FailsOnce()
    hub = CoherenceHub(shared=shared, replica="here")
    caplog.set_level(logging.ERROR, logger="controlplane.rpc.moves")

    async def first_move() -> Any:
        # asyncio.run closes the stream and cancels the listener when this returns
        return await asyncio.wait_for(anext(hub.watch("acme", "engine-a")), WAIT_S)

    moved = asyncio.run(first_move())
    assert (moved.program_id, moved.to_engine_id) == ("p1", "engine-b")
    assert shared.listens == 2
    failed = [r for r in caplog.records if "the listener failed" in r.getMessage()]
    assert len(failed) == 1
    assert "a listener bug" in (failed[0].exc_text or "")
