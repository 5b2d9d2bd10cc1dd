"""The hook's endpoint against hostile clients (a real HTTP server on a port): clients that
send a byte at a time hold up no one and are cut off, early disconnects leave no
traceback, pin commands take their own token (never over plain HTTP from another host)
and TLS, command outcomes need the credential, and command ids are random."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehook.vllm.endpoint import EndpointAccess, serve_metrics
from enginehook.vllm.metrics import HookMetrics
from enginehook.vllm.pin_commands import PinCommands
from tests.controlplane.test_cli_tls_metrics import _pki


@pytest.fixture
def endpoint() -> Iterator[tuple[Any, int, PinCommands]]:
    commands = PinCommands()
    server, port = serve_metrics(
        HookMetrics(),
        "127.0.0.1:0",
        commands,
        access=EndpointAccess(token="pins-only"),
        timeout_s=1.5,
    )
    yield server, port, commands
    server.shutdown()
    server.server_close()


def _request(
    port: int, method: str, path: str, token: str = "", timeout: float = 2.0
) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    connection.request(method, path, headers=headers)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, body


def _trickle(port: int, stop: threading.Event, cut: list[float]) -> None:
    """A client that sends its request one byte every 0.3 s; records when it was cut."""
    started = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port))
    try:
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if stop.is_set():
                return
            s.sendall(bytes([byte]))
            time.sleep(0.3)
    except OSError:
        cut.append(time.monotonic() - started)
    finally:
        s.close()


def test_clients_sending_a_byte_at_a_time_block_nothing_and_are_cut_off(endpoint) -> None:
    server, port, _ = endpoint
    stop, cut = threading.Event(), list[float]()
    slow = [threading.Thread(target=_trickle, args=(port, stop, cut)) for _ in range(80)]
    for t in slow:
        t.start()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        status, body = _request(port, "GET", "/metrics")
        assert status == 200
        assert b"cachettl_pins_held" in body
        status, _ = _request(port, "POST", "/cachettl/pins/s1:drop", token="pins-only")
        assert status == 202
        assert time.monotonic() - started < 1.5  # answered while 80 slow clients are on
        deadline = time.monotonic() + 10
        while len(cut) < 80 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(cut) == 80, f"{len(cut)} of 80 slow clients cut off"
        assert max(cut) < 6.0
        assert server.timed_out >= 80
    finally:
        stop.set()
        for t in slow:
            t.join(10)


def test_early_disconnects_leave_no_traceback(endpoint, capfd, caplog) -> None:
    _, port, _ = endpoint
    for partial in (b"", b"GET /met", b"POST /cachettl/pins/s:drop HTTP/1.1\r\nContent-Le"):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(partial)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # reset, mid-request
    time.sleep(0.5)
    assert _request(port, "GET", "/metrics")[0] == 200
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_commands_and_their_outcomes_need_the_pin_command_token(endpoint) -> None:
    _, port, _ = endpoint
    assert _request(port, "POST", "/cachettl/pins/s1:drop")[0] == 403
    assert _request(port, "POST", "/cachettl/pins/s1:drop", token="control-plane")[0] == 403
    status, body = _request(port, "POST", "/cachettl/pins/secret-session:drop", token="pins-only")
    assert status == 202
    command = json.loads(body)["id"]
    status, body = _request(port, "GET", f"/cachettl/pins/commands/{command}")
    assert status == 403
    assert b"secret-session" not in body
    status, body = _request(port, "GET", f"/cachettl/pins/commands/{command}", token="pins-only")
    assert status == 200
    assert json.loads(body)["session"] == "secret-session"
    assert _request(port, "GET", "/metrics")[0] == 200  # scrapes need no token


def test_command_ids_are_random_and_tell_nothing_of_each_other() -> None:
    one, other = PinCommands(), PinCommands()
    ids = [c.submit("drop", f"s{i}", now=0.0)["id"] for c in (one, other) for i in range(50)]
    assert len(set(ids)) == 100  # never the same on two engines
    assert all(len(i) >= 33 for i in ids)
    assert ids[1] != "c2"


def _local_address() -> str | None:
    """An address of this host that is not on loopback (None: it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_token_over_plain_http_from_another_host_is_refused() -> None:
    access = EndpointAccess(token="pins-only")
    assert access.refusal("127.0.0.1", "http", "Bearer pins-only") is None
    why = access.refusal("10.1.2.3", "http", "Bearer pins-only")
    assert why is not None
    assert "plain HTTP" in why
    assert access.refusal("10.1.2.3", "https", "Bearer pins-only") is None
    assert (
        EndpointAccess(token="t", allow_plaintext=True).refusal("10.1.2.3", "http", "Bearer t")
        is None
    )
    assert EndpointAccess().refusal("10.1.2.3", "http", "") is not None  # no token: loopback only
    address = _local_address()
    if address is None:
        pytest.skip("this host has no address off loopback")
    server, port = serve_metrics(HookMetrics(), "0.0.0.0:0", PinCommands(), access=access)
    try:
        connection = http.client.HTTPConnection(address, port, timeout=5)
        connection.request(
            "POST", "/cachettl/pins/s:drop", headers={"Authorization": "Bearer pins-only"}
        )
        response = connection.getresponse()
        assert response.status == 403
        assert b"plain HTTP" in response.read()
    finally:
        server.shutdown()
        server.server_close()


def test_the_endpoint_serves_tls(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    access = EndpointAccess(
        token="pins-only", cert_file=str(pki["server"]), key_file=str(pki["server-key"])
    )
    server, port = serve_metrics(HookMetrics(), "127.0.0.1:0", PinCommands(), access=access)
    try:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        with urllib.request.urlopen(f"https://localhost:{port}/metrics", context=context) as r:
            assert r.status == 200
        connection = http.client.HTTPSConnection("localhost", port, timeout=5, context=context)
        connection.request(
            "POST", "/cachettl/pins/s:drop", headers={"Authorization": "Bearer pins-only"}
        )
        assert connection.getresponse().status == 202
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"https://localhost:{port}/metrics", timeout=5)
    finally:
        server.shutdown()
        server.server_close()


def test_bad_tls_material_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("not a certificate")
    access = EndpointAccess(
        cert_file=str(tmp_path / "cert.pem"), key_file=str(tmp_path / "cert.pem")
    )
    with pytest.raises(ValueError, match="endpoint_tls_cert_file"):
        serve_metrics(HookMetrics(), "127.0.0.1:0", access=access)


def test_a_router_never_sends_the_token_in_clear_to_another_host() -> None:
    from enginehook.routing.drops import PinDrops

    drops = PinDrops(token="pins-only", timeout_s=1.0)
    drops.escaped("p", "r1", endpoint="http://10.255.255.1:9400", expires_at=1.0)
    drops.close()
    assert drops.counts() == {"sent": 1, "insecure": 1}


# -- the door: caps, shedding, accept() failures, echoes ----------------------------------


class _Reconnecting:
    """``n`` clients (no token) that each send half a request and, when cut off,
    reconnect at once; run from one thread until ``stop()``."""

    def __init__(self, port: int, n: int, source: str = "127.0.0.1") -> None:
        self.port, self.n, self.source = port, n, source
        self.connects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), 2, (self.source, 0))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        except OSError:
            return None
        self.connects += 1
        s.setblocking(False)
        return s

    def _run(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        for _ in range(self.n):
            s = self._open()
            if s is not None:
                sel.register(s, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                held = key.fileobj
                assert isinstance(held, socket.socket)
                try:
                    gone = held.recv(4096) == b""
                except OSError:
                    gone = True
                if gone:
                    sel.unregister(held)
                    held.close()
                    fresh = self._open()
                    if fresh is not None:
                        sel.register(fresh, selectors.EVENT_READ)
            missing = self.n - len(sel.get_map())
            for _ in range(missing):
                fresh = self._open()
                if fresh is not None:
                    sel.register(fresh, selectors.EVENT_READ)
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _limits(**changes: Any) -> Any:
    from enginehook.vllm.endpoint import DoorLimits

    values: dict[str, Any] = {"max_connections": 32, "max_per_source": 32}
    values.update(changes)
    return DoorLimits(**values)


def test_reconnecting_slow_clients_deny_a_well_behaved_client_nothing() -> None:
    commands = PinCommands()
    access = EndpointAccess(token="pins-only")
    server, port = serve_metrics(
        HookMetrics(), "127.0.0.1:0", commands, access=access, limits=_limits()
    )
    slow = _Reconnecting(port, 300)
    try:
        while slow.connects < 300:
            time.sleep(0.05)
        scrapes = [_request(port, "GET", "/metrics", timeout=10)[0] for _ in range(15)]
        pins = [
            _request(port, "POST", f"/cachettl/pins/s{i}:drop", token="pins-only", timeout=10)[0]
            for i in range(15)
        ]
    finally:
        slow.stop()
        server.shutdown()
        server.server_close()
    assert scrapes == [200] * 15
    assert pins == [202] * 15
    assert server.shed > 0  # the slow clients made room for the well-behaved one
    assert len(server.door) <= 32


def test_a_connection_that_showed_the_token_is_never_shed() -> None:
    server, port = serve_metrics(
        HookMetrics(),
        "127.0.0.1:0",
        PinCommands(),
        access=EndpointAccess(token="pins-only"),
        limits=_limits(max_connections=16, max_per_source=16, header_timeout_s=30.0,
                       idle_timeout_s=30.0),
    )  # fmt: skip
    router = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": "Bearer pins-only"}
    idle: list[socket.socket] = []
    try:
        router.request("POST", "/cachettl/pins/s0:drop", headers=headers)
        first = router.getresponse()
        first.read()
        assert first.status == 202
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        while server.shed < 100 - 15:
            time.sleep(0.05)
        router.request("POST", "/cachettl/pins/s1:drop", headers=headers)  # same connection
        response = router.getresponse()
        assert response.status == 202
        response.read()
        assert server.refused == 0
    finally:
        router.close()
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()


def test_one_source_holds_at_most_its_share() -> None:
    server, port = serve_metrics(
        HookMetrics(), "127.0.0.1:0", limits=_limits(max_connections=32, max_per_source=4)
    )
    others: list[socket.socket] = []
    try:
        try:
            others = [
                socket.create_connection(("127.0.0.1", port), 2, ("127.0.0.2", 0))
                for _ in range(50)
            ]
        except OSError:
            pytest.skip("no 127.0.0.2 on this host")
        while server.shed < 50 - 4:
            time.sleep(0.05)
        assert len(server.door) <= 4  # the other address's connections, at most
        assert _request(port, "GET", "/metrics")[0] == 200
    finally:
        for s in others:
            s.close()
        server.shutdown()
        server.server_close()


_EMFILE_CHILD = """
import resource, sys, time, logging
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
from enginehook.vllm.endpoint import DoorLimits, serve_metrics
from enginehook.vllm.metrics import HookMetrics
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
limits = DoorLimits(max_connections=1000, max_per_source=1000, header_timeout_s=60.0,
                    idle_timeout_s=60.0, log_interval_s=60.0)
server, port = serve_metrics(HookMetrics(), "127.0.0.1:0", limits=limits)
print(port, flush=True)
sys.stdin.readline()
print(server.accept_errors.count, len(server.door), flush=True)
"""


def test_accept_failures_are_logged_once_per_interval_without_tracebacks() -> None:
    """A process at its descriptor limit (64 here, the door's cap set past it): the
    failing accept()s give one log line with their count, no traceback each."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert child.stdout is not None
    assert child.stdin is not None
    port = int(child.stdout.readline())
    held: list[socket.socket] = []
    try:
        for _ in range(120):  # within the backlog: no connect() waits
            held.append(socket.create_connection(("127.0.0.1", port), 5))
        time.sleep(3.0)  # asyncio retries a failed accept() every second
        child.stdin.write("\n")
        child.stdin.flush()
        failures, open_ = (int(x) for x in child.stdout.readline().split())
    finally:
        for s in held:
            s.close()
        child.kill()
        _, err = child.communicate(timeout=10)
    assert failures >= 2  # it did run out of descriptors, more than once
    assert open_ < 64
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "accept() failure" in line]
    assert len(lines) == 1, err[-2000:]
    assert "Errno 24" in lines[0]
    assert len(err.splitlines()) <= 3, err[-2000:]


def test_whole_ids_are_never_echoed(endpoint) -> None:
    _, port, commands = endpoint
    huge = "s" * 60_000
    status, body = _request(port, "POST", f"/cachettl/pins/{huge}:drop", token="pins-only")
    assert status == 400
    assert len(body) < 1_000
    assert b"[+59744 chars]" in body
    status, body = _request(port, "POST", f"/cachettl/pins/s1:{'a' * 60_000}", token="pins-only")
    assert status == 501
    assert len(body) < 1_500
    for command in commands.ids():
        assert len(json.dumps(commands.get(command))) < 1_500
