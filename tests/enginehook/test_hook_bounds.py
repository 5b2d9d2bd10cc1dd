"""The hook's own bounds: per-program state over many session ids (the controller and its
trackers, the same objects the vLLM hook hosts), and the metrics endpoint under many
concurrent connections (a real HTTP server on a port)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.programs import MAX_PROGRAMS
from enginehook.core.rules import SchedulingRules
from enginehook.tools.servers import PORT_FLOOR, _ephemeral_floor, free_port
from enginehook.vllm.endpoint import METRICS_MAX_CONNECTIONS, METRICS_THREADS, serve_metrics
from enginehook.vllm.metrics import HookMetrics
from tests.enginehook.hosts import MinimalHost
from tests.enginehook.test_rules import _Fixed

SESSIONS = 50_000


def _controller(max_programs: int = MAX_PROGRAMS) -> PinController[str]:
    return PinController(
        SchedulingRules(),
        MinimalHost(),
        pool_blocks=100,
        decider=_Fixed(5.0),
        engine_id="t",
        max_programs=max_programs,
    )


def _chat(controller: PinController[str], program: str, now: float) -> None:
    """One session whose only turn ends without a tool call (and without saying so)."""
    controller.arrived(program, now, now)
    controller.admitted(program, now)
    controller.finished(FinishedTurn(program, None, None, 160), now + 0.1, lambda: (1, program))


def _entries(controller: PinController[str]) -> int:
    tracker = controller.tracker("default")
    return max(controller.programs, len(tracker), len(tracker._pending), len(controller.arrivals))


def test_sessions_without_a_tool_call_are_bounded_by_the_program_bound() -> None:
    controller = _controller(max_programs=5_000)
    for i in range(SESSIONS):
        _chat(controller, f"s{i}", float(i))
    assert _entries(controller) <= 5_000
    assert controller.evicted == SESSIONS - 5_000
    _chat(controller, "s49999", 60_000.0)  # the most recent session is still known
    assert controller.tracker("default").turns_served("s49999") == 2
    assert MAX_PROGRAMS == 65_536


def test_sessions_without_a_tool_call_are_freed_once_idle() -> None:
    controller = _controller()
    for i in range(SESSIONS):
        _chat(controller, f"s{i}", 0.0)
    assert _entries(controller) == SESSIONS  # below the bound: kept while they may go on
    assert controller.forget_idle(10.0, idle_s=3600.0) == []
    assert controller.forget_idle(4000.0, idle_s=3600.0) == []  # no end reported
    assert _entries(controller) == 0
    assert controller.evicted == 0


def test_a_pinned_program_is_never_evicted() -> None:
    controller = _controller(max_programs=3)
    controller.arrived("pinned", 0.0, 0.0)
    controller.admitted("pinned", 0.0)
    finish = controller.finished(FinishedTurn("pinned", "bash", None, 160), 0.1, lambda: (1, "h"))
    assert finish.pinned
    for i in range(10):
        _chat(controller, f"s{i}", 1.0 + i)
    assert "pinned" in controller.pins
    assert controller.tracker("default").turns_served("pinned") == 1
    assert controller.programs == 3


def _get(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return int(r.status)


def test_the_metrics_endpoint_holds_a_bounded_number_of_threads_and_connections() -> None:
    server, port = serve_metrics(HookMetrics(), "127.0.0.1:0")
    before = threading.active_count()
    idle = []
    try:
        for _ in range(300):  # connections that never send a request
            s = socket.create_connection(("127.0.0.1", port))
            idle.append(s)
        # All from one address: past its per-source cap each new one sheds the oldest idle.
        held = server.limits.max_per_source
        assert held <= METRICS_MAX_CONNECTIONS
        deadline = time.monotonic() + 20
        while server.shed < 300 - held and time.monotonic() < deadline:
            assert threading.active_count() - before <= METRICS_THREADS
            time.sleep(0.05)
        assert threading.active_count() - before <= METRICS_THREADS
        assert (server.shed, server.refused) == (300 - held, 0)
        assert len(server.door) <= held
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    results: list[int] = []

    def scrape() -> None:
        results.append(_get(port))

    scrapers = [threading.Thread(target=scrape) for _ in range(40)]
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join(30)
    assert results == [200] * 40  # concurrent scrapes within the bound are all answered
    assert threading.active_count() - before <= METRICS_THREADS
    server.shutdown()
    server.server_close()


def test_a_metrics_port_in_use_is_refused_by_name_and_leaves_no_thread() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = set(threading.enumerate())
        with pytest.raises(OSError, match=r"metrics_listen: cannot listen on '127\.0\.0\.1:\d+'"):
            serve_metrics(HookMetrics(), f"127.0.0.1:{port}")
        # Threads of earlier tests may end meanwhile; what matters is that none was started.
        assert set(threading.enumerate()) - before == set()


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    ceiling = _ephemeral_floor()
    if ceiling - PORT_FLOOR >= 1_000:  # Linux: the kernel's range is known
        assert all(PORT_FLOOR <= p < ceiling for p in ports)
    for port in ports:  # each one free: a server can bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
