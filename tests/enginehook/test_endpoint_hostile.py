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
