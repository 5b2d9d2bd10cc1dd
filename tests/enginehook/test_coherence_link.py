"""The engine's pin-coherence link against a real control plane on a port: two engines'
links, one program moving between them, the one it left told within a second."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from controlplane.rpc.client import ControlPlaneClient
from controlplane.rpc.gate import Budgets
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from enginehook.link.coherence import CoherenceLink, Moved
from tests.support import ServerThread, running


@pytest.fixture
def cluster() -> Iterator[tuple[ServerThread, str]]:
    store = create_store("memory://")
    plane = ControlPlane(store)
    _, token = plane.create_tenant("acme")
    with running(plane) as server:
        yield server, token
    store.close()


def _link(server: ServerThread, token: str, engine: str, woken: list[str]) -> CoherenceLink:
    client = ControlPlaneClient(server.target, token)
    return CoherenceLink(client, engine, on_moved=lambda: woken.append(engine))


def _moved_within(link: CoherenceLink, seconds: float) -> list[Moved]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if moved := link.moved():
            return moved
        time.sleep(0.01)
    return []


def _until_watching(a: CoherenceLink, b: CoherenceLink) -> None:
    """Move a probe program from ``a`` to ``b`` until ``a`` hears of it (the watch stream
    is registered), so the test's own move cannot race the stream's start; then wait for
    ``b`` to count its probes reported (the move can reach ``a`` before ``b`` reads the
    answer to its report), so a test counting ``b``'s reports counts its own."""
    for attempt in range(50):
        probe = f"probe-{attempt}"
        a.arrived(probe, time.time())
        time.sleep(0.1)
        b.arrived(probe, time.time())
        if any(program == probe for program, _ in _moved_within(a, 0.3)):
            deadline = time.monotonic() + 5
            while b.reported < attempt + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            return
    raise AssertionError("engine-a never heard a probe move")


def test_the_engine_a_program_left_hears_of_it_within_a_second(
    cluster: tuple[ServerThread, str],
) -> None:
    server, token = cluster
    woken: list[str] = []
    a, b = _link(server, token, "engine-a", woken), _link(server, token, "engine-b", woken)
    try:
        _until_watching(a, b)
        a.arrived("p1", 100.0)
        a.arrived("p2", 100.0)
        time.sleep(0.2)  # both reported from engine-a first
        moved_at = time.monotonic()
        b.arrived("p1", 104.5)
        assert _moved_within(a, 1.0) == [("p1", 104.5)]
        assert time.monotonic() - moved_at < 1.0
        assert "engine-a" in woken  # the host was asked to wake its engine loop
        assert b.moved() == []  # nothing left engine-b
        assert a.dropped == 0
        assert a.reported >= 2
    finally:
        a.close()
        b.close()


def test_arrivals_are_dropped_and_counted_while_the_control_plane_is_down() -> None:
    client = ControlPlaneClient("127.0.0.1:9", "token", timeout_s=0.2)  # nothing listens
    link = CoherenceLink(client, "engine-a", max_pending=4, retry_s=0.1)
    try:
        for i in range(10):
            link.arrived(f"p{i}", 1.0)
        deadline = time.monotonic() + 5.0
        while link.dropped < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.dropped == 10  # 6 over the bound at once, the rest when sending failed
        assert link.reported == 0
        assert link.moved() == []
    finally:
        link.close()


@pytest.mark.parametrize(
    "poison", ["p" * 300, "nul\x00id", "lone-\udc80-surrogate"], ids=["long", "nul", "surrogate"]
)
def test_one_refused_program_id_costs_the_other_arrivals_nothing(
    cluster: tuple[ServerThread, str], poison: str
) -> None:
    """Four programs move from a to b; b's batch also holds an id the control plane
    refuses. a hears of all four moves, b counts one refusal, and /metrics shows it."""
    server, token = cluster
    woken: list[str] = []
    a, b = _link(server, token, "engine-a", woken), _link(server, token, "engine-b", woken)
    try:
        _until_watching(a, b)
        programs = [f"mover-{i}" for i in range(4)]
        for program in programs:
            a.arrived(program, time.time())
        time.sleep(0.3)
        for program in programs[:2]:
            b.arrived(program, time.time())
        b.arrived(poison, time.time())
        for program in programs[2:]:
            b.arrived(program, time.time())
        heard: set[str] = set()
        deadline = time.monotonic() + 5
        while heard < set(programs) and time.monotonic() < deadline:
            heard |= {program for program, _ in _moved_within(a, 0.2)}
        assert heard >= set(programs)
        assert b.refused == 1
        counters = dict((name, value) for name, _, value in b.counters())
        assert counters["cachettl_coherence_arrivals_refused_total"] == 1
        assert counters["cachettl_coherence_arrivals_dropped_total"] == 0
        assert counters["cachettl_coherence_arrivals_reported_total"] >= 4
    finally:
        a.close()
        b.close()


def test_an_arrival_the_server_refuses_alone_is_counted_and_the_rest_move(
    cluster: tuple[ServerThread, str],
) -> None:
    """b's batch holds an arrival stamped a minute ahead of the control plane's clock (a
    clock set wrong): the server refuses that arrival alone; a hears of the others' moves,
    b counts the refusal (apart from the ids it refuses itself) and does not count it as
    reported."""
    server, token = cluster
    woken: list[str] = []
    a, b = _link(server, token, "engine-a", woken), _link(server, token, "engine-b", woken)
    try:
        _until_watching(a, b)
        reported = b.reported
        programs = ["mover-1", "mover-2", "ahead"]
        for program in programs:
            a.arrived(program, time.time())
        time.sleep(0.3)
        b.arrived("mover-1", time.time())
        b.arrived("ahead", time.time() + 60.0)
        b.arrived("mover-2", time.time())
        heard: set[str] = set()
        deadline = time.monotonic() + 5
        while heard < {"mover-1", "mover-2"} and time.monotonic() < deadline:
            heard |= {program for program, _ in _moved_within(a, 0.2)}
        assert heard == {"mover-1", "mover-2"}
        counters = dict((name, value) for name, _, value in b.counters())
        assert counters["cachettl_coherence_arrivals_refused_by_server_total"] == 1
        assert counters["cachettl_coherence_arrivals_refused_total"] == 0
        assert b.reported - reported == 2
    finally:
        a.close()
        b.close()


def test_a_report_refused_for_the_moment_is_tried_again_and_its_move_told() -> None:
    """The control plane refuses a report over the tenant's arrival rate (RESOURCE_EXHAUSTED,
    nothing applied): the link tries the batch once more a moment later instead of dropping
    it, so the program's location is known and its move is told."""
    store = create_store("memory://")
    plane = ControlPlane(store)
    _, token = plane.create_tenant("acme")
    with running(plane, budgets=Budgets(arrivals_per_tenant_s=20)) as server:
        filler = ControlPlaneClient(server.target, token)
        woken: list[str] = []
        a = CoherenceLink(
            ControlPlaneClient(server.target, token), "engine-a", retry_s=0.5, interval_s=0.05
        )
        b = _link(server, token, "engine-b", woken)
        try:
            _until_watching(a, b)
            time.sleep(1.0)  # the bucket refills
            reported = a.reported
            filler.report_arrivals("engine-x", [(f"f{i}", time.time()) for i in range(20)])
            a.arrived("p1", time.time())  # over the rate: refused once, then tried again
            deadline = time.monotonic() + 5
            while a.reported == reported and not a.dropped and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (a.reported - reported, a.dropped) == (1, 0)
            b.arrived("p1", time.time())
            assert [p for p, _ in _moved_within(a, 3.0)] == ["p1"]
        finally:
            a.close()
            b.close()
            filler.close()
    store.close()
