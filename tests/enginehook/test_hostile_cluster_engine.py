"""A real engine (tiny model, session middleware, the hook's endpoint with a pin-command
token) against hostile clients and as a cluster operator meets it: session ids in a BOM'd
or UTF-16 body are checked like any other, the engine checks ids the middleware never
read, a UTF-8 header id is keyed as sent (a router's drop by the real id finds the pin),
slow and vanishing clients cost the endpoint nothing and log no traceback, pin commands
and their outcomes need the pin-command token, the API port names the hook's endpoint,
and the hook says at start what it is linked to and that its cold start cannot pin."""

from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehook.tools.tinymodel import random_words
from tests.enginehook.hostile import Engine
from tests.enginehook.processes import free_port, start_vllm_server, vllm_healthy, wait_for

pytestmark = pytest.mark.slow

PIN_TOKEN = "pin-commands-only-7f3a"


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    work = tmp_path_factory.mktemp("hostile-cluster")
    (work / "pin-token").write_text(PIN_TOKEN + "\n")
    metrics_port, port = free_port(), free_port()
    hook = {
        "policy": "cachettl",
        "metrics_listen": f"127.0.0.1:{metrics_port}",
        "pin_command_token_file": str(work / "pin-token"),
    }
    log = work / "vllm.log"
    middleware = ("--middleware", "enginehook.sessions.SessionIdMiddleware")
    proc = start_vllm_server(tiny_model, port, hook, log, middleware)
    try:
        wait_for(lambda: vllm_healthy(proc, port, log), 600, "the vLLM server")
        yield Engine(port, str(tiny_model), proc, log, metrics_port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _hook(
    engine: Engine, method: str, path: str, token: str = "", body: bytes | None = None
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", engine.metrics_port, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        text = response.read().decode()
        return response.status, json.loads(text) if text.startswith("{") else text
    finally:
        conn.close()


def _metric(engine: Engine, name: str) -> float:
    for line in engine.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def _pinned_turn(engine: Engine, headers: list[tuple[str, str | bytes]]) -> None:
    """One turn long enough to pin (whole blocks), ending in a tool call with a client TTL."""
    rng = random.Random(7)
    body = engine.chat(
        messages=[{"role": "user", "content": random_words(rng, 300)}],
        vllm_xargs={"tool": "bash", "pin_ttl_s": 120},
    )
    status, text = engine.post(json.dumps(body).encode(), headers)
    assert status == 200, text[:500]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le"])
@pytest.mark.parametrize(
    ("session", "message"),
    [("s" * 300, "at most 256 characters"), ("tab\there", "control characters")],
    ids=["long", "control"],
)
def test_an_id_in_a_bom_or_utf16_body_is_checked_like_any_other(
    engine: Engine, encoding: str, session: str, message: str
) -> None:
    body = json.dumps(engine.chat(session_id=session)).encode(encoding)
    status, text = engine.post(body)
    assert status == 400, text[:300]
    error = json.loads(text)["error"]
    assert error["param"] == "session_id"
    assert message in error["message"]
    good = json.dumps(engine.chat(session_id="bom-ok")).encode(encoding)
    assert engine.post(good)[0] == 200  # such bodies are served, only checked


def test_the_engine_checks_an_id_the_middleware_never_read(engine: Engine) -> None:
    """Past 32 MiB the middleware passes a body on unread; the engine refuses its 300-char
    id itself (counted) and serves the request without a session."""
    before = _metric(engine, "cachettl_session_ids_refused_total")
    body = engine.chat(session_id="x" * 300, pad="p" * (33 * 2**20))
    status, text = engine.post(json.dumps(body).encode())
    assert status == 200, text[:300]
    assert _metric(engine, "cachettl_session_ids_refused_total") == before + 1
    engine.serves()


def test_a_utf8_header_id_is_keyed_as_sent_so_a_drop_by_it_finds_the_pin(engine: Engine) -> None:
    session = "Zürich-会话-€-1"
    _pinned_turn(engine, [("X-Session-ID", session.encode())])
    path = f"/cachettl/pins/{urllib.parse.quote(session, safe='')}:drop"
    status, answer = _hook(engine, "POST", path, token=PIN_TOKEN)
    assert status == 202, answer
    deadline = time.monotonic() + 20
    while answer["state"] == "accepted" and time.monotonic() < deadline:
        time.sleep(0.2)
        _, answer = _hook(engine, "GET", f"/cachettl/pins/commands/{answer['id']}", PIN_TOKEN)
    assert answer["state"] == "applied", answer
    assert answer["session"] == session


def test_pin_commands_and_outcomes_need_the_pin_command_token(engine: Engine) -> None:
    assert _hook(engine, "POST", "/cachettl/pins/s:drop")[0] == 403
    status, answer = _hook(engine, "POST", "/cachettl/pins/private-7:drop", token=PIN_TOKEN)
    assert status == 202
    status, text = _hook(engine, "GET", f"/cachettl/pins/commands/{answer['id']}")
    assert status == 403
    assert "private-7" not in json.dumps(text)
    assert len(answer["id"]) >= 33  # random, not c1, c2, ...


def _trickle(port: int, stop: threading.Event, cut: list[float]) -> None:
    started, s = time.monotonic(), socket.create_connection(("127.0.0.1", port))
    try:
        for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 200:
            if stop.is_set():
                return
            s.sendall(bytes([byte]))
            time.sleep(0.5)
    except OSError:
        cut.append(time.monotonic() - started)
    finally:
        s.close()


def test_slow_and_vanishing_clients_cost_the_endpoint_nothing(engine: Engine) -> None:
    stop, cut = threading.Event(), list[float]()
    slow = [
        threading.Thread(target=_trickle, args=(engine.metrics_port, stop, cut)) for _ in range(70)
    ]
    for t in slow:
        t.start()
    try:
        time.sleep(1.0)
        started = time.monotonic()
        assert "cachettl_pins_held" in engine.metrics()
        assert _hook(engine, "POST", "/cachettl/pins/slow-1:drop", token=PIN_TOKEN)[0] == 202
        assert time.monotonic() - started < 3.0
        for partial in (b"", b"GET /metr", b"POST /cachettl/pins/x:drop HTTP/1.1\r\nContent-L"):
            s = socket.create_connection(("127.0.0.1", engine.metrics_port))
            s.sendall(partial)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        wait_for(lambda: len(cut) == 70, 20, "the slow clients cut off")
    finally:
        stop.set()
        for t in slow:
            t.join(15)
    time.sleep(0.5)
    assert "Traceback" not in engine.log.read_text(errors="replace")
    engine.serves()


def test_the_api_port_names_the_hooks_endpoint(engine: Engine) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=10)
    conn.request("GET", "/.well-known/cachettl")
    found = json.loads(conn.getresponse().read())
    conn.close()
    url = f"http://127.0.0.1:{engine.metrics_port}"
    assert found["hook_endpoint"] == url
    assert found["pin_command_token"] is True
    assert found["tls"] is False
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=60)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(engine.chat(session_id="named")),
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    response.read()
    conn.close()
    assert response.getheader("x-cachettl-hook") == url


def test_the_hook_says_at_start_what_it_is_linked_to_and_that_cold_start_cannot_pin(
    engine: Engine,
) -> None:
    log = engine.log.read_text(errors="replace")
    linked = [line for line in log.splitlines() if "CacheTTL hook " in line]
    assert len(linked) == 1, linked
    line = linked[0]
    assert "control plane none" in line
    assert f"endpoint http://127.0.0.1:{engine.metrics_port}/metrics" in line
    assert "pin commands with pin_command_token" in line
    assert "tenant 'default'" in line
    assert PIN_TOKEN not in log
    assert "cannot pin on this engine at its cold start" in log
