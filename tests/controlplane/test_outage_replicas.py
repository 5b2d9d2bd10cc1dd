"""A database outage under two real ``cachettl serve`` replicas (subprocesses, real ports,
one real PostgreSQL schema): replica B reaches PostgreSQL through a TCP proxy this test
cuts and restores, replica A directly. Each failed before its fix: B's log held a
three-exception traceback per tail round (4,100 lines in 15 s), and a token revoked or
rotated just before the outage stayed valid from B's token cache for its whole stale age.

Also, without servers: the token changes every store reports in order, the token cache
applying them, and a loop's outage logged once at its start and once at its end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from controlplane.errors import StorageError
from controlplane.rpc.auth import AuthOptions, TenantCache
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import Store, create_store, hash_token
from controlplane.storage.outages import Outages

from .conftest import pg_url

ROOT = Path(__file__).resolve().parents[2]
#: Tail interval of the replicas, seconds (0.5 in production).
TAIL_S = 0.05
#: How long the database is cut.
OUTAGE_S = 2.0
#: How long a replica may take to start (imports, schema check).
START_S = 60.0


class CuttableProxy:
    """An asyncio TCP forwarder to ``target`` on its own thread; ``cut`` aborts every
    connection and refuses new ones (closed at once) until ``restore``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut_off = False
        self._transports: set[asyncio.WriteTransport] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer.transport, up_writer.transport}
        self._transports |= pair
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._transports -= pair
            for transport in pair:
                transport.abort()

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.transport.abort()

    async def _cut(self) -> None:
        self.cut_off = True
        for transport in list(self._transports):
            transport.abort()

    def cut(self) -> None:
        self._run(self._cut())

    def restore(self) -> None:
        self.cut_off = False

    def close(self) -> None:
        self.cut()
        self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    process: subprocess.Popen[str]
    target: str
    metrics_port: int
    log_path: Path

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            text = r.read().decode()
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert found, f"{name} not in /metrics"
        return float(found.group(1))


def start_replica(url: str, log_path: Path, auth_fresh_s: float, log: IO[str]) -> Replica:
    metrics_port = _free_port()
    command = [
        sys.executable,
        "-m",
        "controlplane",
        "serve",
        "--db",
        url,
        "--listen",
        "127.0.0.1:0",
        "--tail-interval",
        str(TAIL_S),
        "--snapshot-interval",
        "0.2",
        "--auth-fresh",
        str(auth_fresh_s),
        "--auth-stale",
        "120",
        "--metrics",
        f"127.0.0.1:{metrics_port}",
        "--min-samples",
        "1",
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1
    )
    assert process.stdout is not None
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"replica exited: {log_path.read_text()[-2000:]}")
        found = re.search(r"on port (\d+)", line)
        if found:
            return Replica(process, f"127.0.0.1:{found.group(1)}", metrics_port, log_path)
    raise AssertionError("replica did not start")


def stop(replica: Replica) -> None:
    replica.process.terminate()
    try:
        replica.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        replica.process.kill()
        replica.process.wait()


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def until(condition: Callable[[], bool], within_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > within_s:
            raise AssertionError(f"not within {within_s} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def replicas(
    pg_schemas: Callable[[], str], tmp_path: Path
) -> Iterator[tuple[Replica, Replica, CuttableProxy, str, dict[str, str]]]:
    schema = pg_schemas()
    direct = pg_url(schema)
    store = create_store(direct)  # creates the schema at the head revision
    plane = ControlPlane(store)
    tokens = {name: plane.create_tenant(name)[1] for name in ("acme", "beta", "gamma")}
    store.close()
    proxy = CuttableProxy(("127.0.0.1", 5432))
    proxied = direct.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    started: list[Replica] = []
    with (tmp_path / "a.log").open("w") as log_a, (tmp_path / "b.log").open("w") as log_b:
        try:
            # A fresh age of 30 s: without the tail's token changes a cached token would be
            # answered as it was for 30 s, revoked or not, database up or down.
            started.append(start_replica(direct, tmp_path / "a.log", 30.0, log_a))
            started.append(start_replica(proxied, tmp_path / "b.log", 30.0, log_b))
            yield started[0], started[1], proxy, direct, tokens
        finally:
            for replica in started:
                stop(replica)
            proxy.close()


def _cli(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip()


def test_an_outage_is_logged_twice_and_a_revocation_before_it_holds_on_every_replica(
    replicas: tuple[Replica, Replica, CuttableProxy, str, dict[str, str]],
) -> None:
    a, b, proxy, url, tokens = replicas
    clients = {
        (r.target, name): ControlPlaneClient(r.target, token)
        for r in (a, b)
        for name, token in tokens.items()
    }
    try:

        def decide(replica: Replica, name: str) -> Callable[[], object]:
            return lambda: clients[replica.target, name].decide_ttl("bash", "ls", 100)

        for replica in (a, b):  # every token cached on both replicas
            for name in tokens:
                assert code_of(decide(replica, name)) is grpc.StatusCode.OK
        # While the database answers: acme revoked, beta's token replaced.
        _cli("tenants", "revoke", "acme", "--db", url)
        new_beta = _cli("tenants", "rotate", "beta", "--db", url)
        denied, unknown = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED

        def refused(replica: Replica, name: str, code: grpc.StatusCode) -> Callable[[], bool]:
            return lambda: code_of(decide(replica, name)) is code

        for replica in (a, b):  # through the tail, well before the 30 s fresh age
            until(refused(replica, "acme", denied), 5.0, "acme refused")
            until(refused(replica, "beta", unknown), 5.0, "beta refused")
        assert b.metric("cachettl_database_reachable") == 1.0

        before = len(b.log_lines())
        proxy.cut()
        cut_at = time.monotonic()
        until(lambda: b.metric("cachettl_database_reachable") == 0.0, 5.0, "B sees the outage")
        while time.monotonic() - cut_at < OUTAGE_S:  # B answers from memory meanwhile
            assert code_of(decide(b, "acme")) is denied
            assert code_of(decide(b, "beta")) is unknown
            assert code_of(decide(b, "gamma")) is grpc.StatusCode.OK
            time.sleep(0.1)
        during = b.log_lines()[before:]
        proxy.restore()
        until(
            lambda: any("reachable again" in line for line in b.log_lines()[before:]),
            10.0,
            "recovery logged",
        )
        time.sleep(5 * TAIL_S)  # a few more good rounds: nothing more may be logged
        lines = b.log_lines()[before:]

        _assert_logged_once(a, b, during, lines)

        # After the outage: the new token works on B, the revoked one stays refused.
        with ControlPlaneClient(b.target, new_beta) as beta:
            assert beta.decide_ttl("bash", "ls", 100).ttl_s >= 0
        assert code_of(decide(b, "acme")) is denied
    finally:
        for client in clients.values():
            client.close()


def _assert_logged_once(a: Replica, b: Replica, during: list[str], lines: list[str]) -> None:
    """B logged the outage once at its start and once at recovery, with a count, and
    counted it; A, which never lost the database, logged nothing about it."""
    # At most a few lines for the whole outage: one per loop at its start.
    assert 1 <= len(during) <= 3, during
    assert all("Traceback" not in line for line in lines), lines
    tail_down = [line for line in lines if "tail of the event log: database unreachable" in line]
    assert len(tail_down) == 1, lines
    tail_up = [line for line in lines if "tail of the event log: database reachable again" in line]
    assert len(tail_up) == 1, lines
    found = re.search(r"after (\d+\.\d) s \((\d+) failed rounds\)", tail_up[0])
    assert found, tail_up[0]
    assert float(found.group(1)) >= OUTAGE_S - 0.5
    assert int(found.group(2)) >= 5  # about OUTAGE_S / TAIL_S rounds failed, logged once
    assert len(lines) <= 6, lines  # two per loop (tail, snapshot) and some room
    assert b.metric('cachettl_database_outages_total{loop="tail"}') == 1.0
    assert b.metric('cachettl_database_failed_rounds_total{loop="tail"}') >= 5
    assert b.metric("cachettl_database_reachable") == 1.0
    # A never lost the database: nothing logged about it.
    assert not any("database unreachable" in line for line in a.log_lines())


# -- without servers ---------------------------------------------------------------------


@pytest.mark.parametrize("db_url", ["memory", "sqlite", "postgres"], indirect=True)
def test_every_store_reports_token_changes_in_order(store: Store) -> None:
    assert store.tenant_changes(-1) == []
    store.create_tenant("acme", False, "h1", 1.0)
    store.create_tenant("beta", False, "h2", 2.0)
    first = store.tenant_changes(-1)
    assert [(c.tenant.name, c.token_hash) for c in first] == [("acme", "h1"), ("beta", "h2")]
    seen = first[-1].seq
    assert store.tenant_changes(seen) == []
    store.revoke_tenant("acme", 5.0)
    store.revoke_tenant("acme", 6.0)  # already revoked: no change
    store.rotate_token("beta", "h3")
    changes = store.tenant_changes(seen)
    assert [(c.tenant.name, c.token_hash, c.tenant.revoked_at) for c in changes] == [
        ("acme", "h1", 5.0),
        ("beta", "h3", None),
    ]
    assert changes[0].seq > seen
    assert changes[1].seq > changes[0].seq
    store.rotate_token("acme", "h4")  # active again, newest position
    (last,) = store.tenant_changes(changes[-1].seq)
    assert (last.tenant.name, last.token_hash, last.tenant.revoked_at) == ("acme", "h4", None)


class _Flaky:
    """A store's lookup that fails while ``down``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.down = False

    def __call__(self, token_hash: str) -> Any:
        if self.down:
            raise StorageError("database error: connection refused")
        return self.store.tenant_by_token_hash(token_hash)


def test_the_token_cache_answers_a_change_it_was_told_for_the_stale_age() -> None:
    store = create_store("memory://")
    plane = ControlPlane(store)
    _, acme = plane.create_tenant("acme")
    _, beta = plane.create_tenant("beta")
    lookup = _Flaky(store)
    now = [0.0]
    cache = TenantCache(lookup, AuthOptions(fresh_s=1.0, stale_s=100.0), clock=lambda: now[0])

    async def run() -> None:
        for token in (acme, beta):
            tenant = await cache.tenant(token)
            assert tenant is not None
            assert tenant.revoked_at is None
        seen = store.tenant_changes(-1)[-1].seq
        store.revoke_tenant("acme", 9.0)
        new_beta = plane.rotate_token("beta")[1]
        assert cache.apply(store.tenant_changes(seen)) == 2
        lookup.down = True  # the outage starts right after the tail read the changes
        for t in (0.5, 50.0, 99.0):
            now[0] = t
            revoked = await cache.tenant(acme)
            assert revoked is not None
            assert revoked.revoked_at == 9.0
            assert await cache.tenant(beta) is None  # replaced: unknown, not UNAVAILABLE
        with pytest.raises(StorageError):
            await cache.tenant(new_beta)  # never looked up: the store must answer
        lookup.down = False
        active = await cache.tenant(new_beta)
        assert active is not None
        assert active.name == "beta"
        assert cache.revoked_by_changes == 2

    asyncio.run(run())
    cache.close()


def test_a_lookup_that_began_before_a_change_is_not_remembered() -> None:
    store = create_store("memory://")
    plane = ControlPlane(store)
    _, acme = plane.create_tenant("acme")
    cache = TenantCache(store.tenant_by_token_hash, AuthOptions(fresh_s=1.0, stale_s=100.0))
    stale = store.tenant_by_token_hash(hash_token(acme))
    assert stale is not None
    began = 0  # the count of changes when the lookup began
    store.revoke_tenant("acme", 3.0)
    cache.apply(store.tenant_changes(-1))
    assert not cache._remember(hash_token(acme), stale, began)  # read before the revocation

    async def run() -> None:
        tenant = await cache.tenant(acme)
        assert tenant is not None
        assert tenant.revoked_at == 3.0

    asyncio.run(run())
    cache.close()


def test_an_outage_of_a_loop_is_logged_at_its_start_and_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    outages = Outages(clock=lambda: now[0])
    log = logging.getLogger("cachettl.test.outage")
    caplog.set_level(logging.INFO, logger=log.name)
    health = outages.loop("tail", "tail of the event log", log, "tried again every 0.05 s")
    health.succeeded()
    try:
        try:
            raise ConnectionRefusedError("connection refused\n\tIs the server running?")
        except OSError as cause:
            raise StorageError("database error: connection failed") from cause
    except StorageError as error:
        for _ in range(300):
            now[0] += 0.05
            health.failed(error)
    assert not outages.reachable
    now[0] += 0.05
    health.succeeded()
    health.succeeded()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert (
        "tail of the event log: database unreachable (database error: connection failed)"
        in (messages[0])
    )
    assert "\n" not in messages[0]
    assert caplog.records[0].exc_info is None
    assert messages[1] == (
        "tail of the event log: database reachable again after 15.0 s (300 failed rounds)"
    )
    assert outages.reachable
    assert outages.opened["tail"] == 1
    assert outages.failed_rounds["tail"] == 300
    # At debug level each failed round is logged with its traceback.
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger=log.name)
    health.failed(ValueError("a bug"))  # not the database's: a traceback, once
    health.failed(ValueError("a bug"))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].exc_info is not None
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2
    assert outages.reachable  # a bug is no outage
