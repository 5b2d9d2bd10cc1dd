"""The console's bounds against a real control plane and console on real ports: idle
connections past the door's cap leave logged-in viewers served, one tenant's logins end
only its own oldest sessions, and logins past their rates are answered 429 with
Retry-After."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.console.bench import Client
from controlplane.console.host import Console, ConsoleOptions
from controlplane.console.sessions import DeniedError, RateLimit, SessionLimits
from controlplane.doors import DoorLimits
from controlplane.rpc.client import ControlPlaneClient
from controlplane.rpc.server import ServerOptions
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from tests.console.conftest import ADMIN
from tests.support import ServerThread

FAST = RateLimit(1_000_000, 1e9)


@dataclass
class Small:
    thread: ServerThread
    console: Console
    tokens: dict[str, str]

    def login(self, token: str) -> tuple[int, dict[str, str], Client]:
        client = Client(self.console.port)
        client.cookies["cttl_login"] = "x" * 32  # the double-submit pair
        status, headers, _ = client.request("POST", "/login", {"login": "x" * 32, "token": token})
        return status, headers, client


def _small(tmp: Path, door: DoorLimits, sessions: SessionLimits) -> Iterator[Small]:
    store = create_store(f"sqlite:///{tmp / 'cp.sqlite3'}")
    plane = ControlPlane(store)
    tokens = {name: plane.create_tenant(name, False)[1] for name in ("a", "b")}
    thread = ServerThread(plane, ServerOptions(listen="127.0.0.1:0"))
    console = Console(thread.server, ConsoleOptions("127.0.0.1:0", ADMIN, 60.0, 10, door, sessions))
    thread.run(console.start())
    try:
        yield Small(thread, console, tokens)
    finally:
        thread.run(console.stop())
        thread.stop()
        store.close()


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Small]:
    door = DoorLimits(max_connections=24, max_per_source=24, header_timeout_s=30.0)
    limits = SessionLimits(
        per_tenant=5, admin=3, logins_per_source=FAST, logins_per_tenant=FAST,
        failures_per_source=RateLimit(5, 1.0),
    )  # fmt: skip
    yield from _small(tmp_path, door, limits)


def test_idle_connections_past_the_cap_leave_viewers_and_rpcs_served(small: Small) -> None:
    status, _, viewer = small.login(small.tokens["a"])
    assert status == 303
    idle = [socket.create_connection(("127.0.0.1", small.console.port)) for _ in range(400)]
    try:
        door = small.console.door
        for _ in range(3):
            status, _ = viewer.get("/tools")
            assert status == 200
        status, _, later = small.login(small.tokens["b"])  # a new viewer gets in too
        assert status == 303
        assert later.get("/tools")[0] == 200
        assert len(door) <= 24
        assert door.shed >= 400 - 24
        with ControlPlaneClient(small.thread.target, small.tokens["b"]) as rpc:
            assert rpc.decide_ttl("bash", "ls", 1000).ttl_s >= 0.0
    finally:
        for s in idle:
            s.close()


def test_a_tenants_logins_end_only_its_own_oldest_sessions(small: Small) -> None:
    _, _, b = small.login(small.tokens["b"])
    _, _, admin = small.login(ADMIN)
    sessions = small.console.sessions
    sids = [small.thread.run(sessions.login(small.tokens["a"], "10.0.0.1")) for _ in range(10_001)]
    assert sessions.sessions_of("a") == 5
    assert [sessions.known(s) for s in sids[-5:]] == [True] * 5
    assert not sessions.known(sids[0])
    assert b.get("/tools")[0] == 200  # the other tenant's session holds
    assert admin.get("/tenants")[0] == 200  # and the admin's
    assert sessions.sessions_of("b") == 1
    assert sessions.sessions_of(None) == 1


def test_failed_logins_from_one_source_get_429_and_cost_no_lookup(small: Small) -> None:
    answers = [small.login("not-a-token-" + str(i)) for i in range(8)]
    statuses = [status for status, _, _ in answers]
    assert statuses[:5] == [401] * 5
    assert statuses[5:] == [429] * 3
    assert int(answers[-1][1]["retry-after"]) >= 1
    status, headers, _ = small.login(small.tokens["a"])  # over budget: not looked up either
    assert status == 429
    assert "retry-after" in headers


def test_a_tenants_logins_past_its_rate_get_429(tmp_path: Path) -> None:
    door = DoorLimits(max_connections=24, max_per_source=24)
    limits = SessionLimits(logins_per_source=FAST, logins_per_tenant=RateLimit(3, 1.0))
    for small in _small(tmp_path, door, limits):
        statuses = [small.login(small.tokens["a"])[0] for _ in range(5)]
        assert statuses == [303, 303, 303, 429, 429]
        assert small.login(small.tokens["b"])[0] == 303  # another tenant's rate is its own
        with pytest.raises(DeniedError) as denied:
            small.thread.run(small.console.sessions.login(small.tokens["a"], "10.9.9.9"))
        assert denied.value.status == 429
        assert denied.value.retry_after is not None
