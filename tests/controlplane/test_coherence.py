"""Pin coherence on a real server: the engine a program left hears of the move at once,
per tenant; a bad report is refused whole, a bad arrival alone."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import grpc
import pytest

from controlplane.coherence import ProgramLocations
from controlplane.records import Move
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import create_store


class Watcher:
    """Follows ``WatchMoves`` of one engine in a thread; moves land in ``moves``."""

    def __init__(self, target: str, token: str, engine_id: str) -> None:
        self.client = ControlPlaneClient(target, token)
        self.moves: queue.Queue[tuple[str, str]] = queue.Queue()
        self._stream = self.client.watch_moves(engine_id)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for moved in self._stream:
                self.moves.put((moved.program_id, moved.to_engine_id))
        except grpc.RpcError:
            pass

    def ready(self, reporter: ControlPlaneClient, engine_id: str) -> None:
        """Return once the stream is registered: probe moves until one comes through."""
        for attempt in range(50):
            probe = f"probe-{attempt}"
            reporter.report_arrivals(engine_id, [(probe, time.time())])
            reporter.report_arrivals("probe-engine", [(probe, time.time())])
            try:
                if self.moves.get(timeout=0.2)[0] == probe:
                    return
            except queue.Empty:
                continue
        raise AssertionError("WatchMoves never delivered a probe move")

    def close(self) -> None:
        self.client.close()  # cancels the stream; the thread ends


@pytest.fixture
def plane() -> Iterator[ControlPlane]:
    store = create_store("memory://")
    yield ControlPlane(store)
    store.close()


@pytest.fixture
def server(plane: ControlPlane, serve: Callable[..., AbstractContextManager[Any]]) -> Iterator[Any]:
    with serve(plane) as running:
        yield running


def test_the_engine_a_program_left_hears_of_the_move_within_a_second(
    plane: ControlPlane, server: Any
) -> None:
    _, token = plane.create_tenant("acme")
    engine_a = ControlPlaneClient(server.target, token)
    engine_b = ControlPlaneClient(server.target, token)
    watcher = Watcher(server.target, token, "engine-a")
    try:
        watcher.ready(engine_a, "engine-a")
        assert engine_a.report_arrivals("engine-a", [("p1", time.time()), ("p2", time.time())]) == 0
        assert engine_a.report_arrivals("engine-a", [("p1", time.time())]) == 0  # stayed
        sent = time.monotonic()
        assert engine_b.report_arrivals("engine-b", [("p1", time.time())]) == 1
        assert watcher.moves.get(timeout=1.0) == ("p1", "engine-b")
        assert time.monotonic() - sent < 1.0
        assert watcher.moves.empty()  # p2 did not move
    finally:
        watcher.close()
        engine_a.close()
        engine_b.close()


def test_moves_stay_within_the_tenant(plane: ControlPlane, server: Any) -> None:
    _, acme = plane.create_tenant("acme")
    _, other = plane.create_tenant("other")
    watcher = Watcher(server.target, other, "engine-a")
    client = ControlPlaneClient(server.target, other)
    intruder = ControlPlaneClient(server.target, acme)
    try:
        watcher.ready(client, "engine-a")
        client.report_arrivals("engine-a", [("p1", time.time())])
        # Another tenant's program of the same id arriving elsewhere is no move of ours.
        assert intruder.report_arrivals("engine-b", [("p1", time.time())]) == 0
        # A move of the tenant's own comes through, and it is the first thing that does.
        client.report_arrivals("engine-b", [("p1", time.time())])
        assert watcher.moves.get(timeout=1.0) == ("p1", "engine-b")
    finally:
        watcher.close()
        client.close()
        intruder.close()


@pytest.mark.parametrize(
    ("engine", "arrivals", "field"),
    [
        ("", [("p1", 1.0)], "engine_id"),
        ("e" * 65, [("p1", 1.0)], "engine_id"),
        ("engine\n", [("p1", 1.0)], "engine_id"),
        ("engine-b", [], "arrivals"),
        ("engine-b", [("ok", 1.0)] * 1001, "arrivals"),
    ],
)
def test_a_bad_report_is_refused_whole_naming_the_field(
    plane: ControlPlane, server: Any, engine: str, arrivals: list[tuple[str, float]], field: str
) -> None:
    _, token = plane.create_tenant("acme")
    client = ControlPlaneClient(server.target, token)
    try:
        client.report_arrivals("engine-a", [("ok", 1.0)])
        with pytest.raises(grpc.RpcError) as refused:
            client.report_arrivals(engine, arrivals)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"{field}:")
        # Nothing of the refused report was applied: "ok" is still on engine-a.
        assert client.report_arrivals("engine-a", [("ok", 2.0)]) == 0
    finally:
        client.close()


def test_a_report_without_a_token_is_refused(server: Any) -> None:
    client = ControlPlaneClient(server.target, "not-a-token")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.report_arrivals("engine-a", [("p1", 1.0)])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        client.close()


def test_locations_are_bounded_per_tenant_least_recent_first() -> None:
    where = ProgramLocations(max_programs=3)
    for i in range(5):
        where.arrived("acme", "engine-a", f"p{i}", float(i))
    assert len(where) == 3
    assert where.where("acme", "p0") is None  # forgotten: its next arrival counts as new
    assert where.arrived("acme", "engine-b", "p0", 9.0) is None
    assert where.arrived("acme", "engine-b", "p4", 9.0) == Move("p4", "engine-a", "engine-b", 9.0)
    with pytest.raises(ValueError, match="max_programs must be >= 1"):
        ProgramLocations(max_programs=0)


def test_per_engine_counts_kept_as_locations_change_equal_a_recount() -> None:
    import random
    from collections import Counter

    rng = random.Random(7)
    where = ProgramLocations(max_programs=50)
    for step in range(5_000):  # moves, late reports and the bound's evictions
        tenant = rng.choice(("acme", "other"))
        program = f"p{rng.randrange(80)}"
        at = step + rng.uniform(-30.0, 0.0)
        where.arrived(tenant, rng.choice(("a", "b", "c")), program, at)
    for tenant in ("acme", "other"):
        programs = where._tenants[tenant]
        recount = Counter(location.engine_id for location in programs.values())
        assert where.engines(tenant) == recount
        assert sum(recount.values()) == len(programs) == 50
    assert where.engines("nobody") == Counter()
