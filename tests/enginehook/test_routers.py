"""The end of a session reaches the routers: a request with ``last_turn`` or ``release``
(flat, in an envelope, or Dynamo's final header) is reported to ``/finish_session`` of a
real HTTP server once answered; other requests are not, and an unreachable router costs
nothing but a log line."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from controlplane.kvhints import Retention, retention_envelope
from enginehook.hints.routers import ENV, RouterNotifier
from enginehook.hints.sessions import SessionIdMiddleware


class _Router(ThreadingHTTPServer):
    finished: list[str]


class _Handler(BaseHTTPRequestHandler):
    server: _Router

    def do_POST(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/finish_session":
            self.server.finished.append(query.removeprefix("session_id="))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def router() -> Iterator[_Router]:
    server = _Router(("127.0.0.1", 0), _Handler)
    server.finished = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def _ok(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


def _app(notifier: RouterNotifier) -> TestClient:
    middleware = [Middleware(SessionIdMiddleware, routers=notifier)]
    routes = [Route("/v1/chat/completions", _ok, methods=["POST"])]
    return TestClient(Starlette(routes=routes, middleware=middleware))


def _finished(router: _Router, count: int) -> list[str]:
    deadline = time.monotonic() + 5
    while len(router.finished) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # nothing more arrives
    return router.finished


def test_ended_sessions_reach_the_router_once_answered(router: _Router) -> None:
    notifier = RouterNotifier([f"http://127.0.0.1:{router.server_port}"])
    envelope = retention_envelope(Retention(last_turn=True), message_id="m")
    with _app(notifier) as app:
        chat = "/v1/chat/completions"
        assert app.post(chat, json={"session_id": "going-on"}).status_code == 200
        assert app.post(chat, json={"vllm_xargs": {"tool": "ls"}}).status_code == 200
        ends: list[tuple[dict[str, Any], dict[str, str]]] = [
            ({"session_id": "flat", "vllm_xargs": {"last_turn": 1}}, {}),
            ({"vllm_xargs": {"release": True}}, {"X-Session-ID": "released"}),
            ({"session_id": "enveloped", "kv_hints": envelope}, {}),
            ({}, {"X-Dynamo-Session-ID": "dynamo", "X-Dynamo-Session-Final": "true"}),
        ]
        for body, headers in ends:
            assert app.post(chat, content=json.dumps(body), headers=headers).status_code == 200
    notifier.close()
    assert sorted(_finished(router, 4)) == ["dynamo", "enveloped", "flat", "released"]
    assert (notifier.sent, notifier.failed) == (4, 0)


def test_an_unreachable_router_costs_a_log_line_not_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    notifier = RouterNotifier(["http://127.0.0.1:9"])  # nothing listens
    with _app(notifier) as app:
        for i in range(3):
            body = {"session_id": f"s{i}", "vllm_xargs": {"last_turn": 1}}
            assert app.post("/v1/chat/completions", json=body).status_code == 200
    notifier.close()
    assert notifier.failed == 3
    assert len([r for r in caplog.records if "finish_session failed" in r.message]) == 1


def test_router_urls_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, " http://a:30000/ ,https://b:1")
    assert RouterNotifier().urls == ["http://a:30000", "https://b:1"]
    monkeypatch.setenv(ENV, "ftp://x")
    with pytest.raises(ValueError, match=r"\$CACHETTL_ROUTER_URLS: 'ftp://x' is not an http"):
        RouterNotifier()
    monkeypatch.delenv(ENV)
    assert RouterNotifier().urls == []


def test_every_answer_names_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    with _app(RouterNotifier([])) as app:
        r = app.post("/v1/chat/completions", json={"session_id": "s"})
        assert r.headers["x-cachettl-engine"] == "testserver:80"  # the server's host:port
    monkeypatch.setenv("CACHETTL_ENGINE_NAME", "gpu-node-3")
    with _app(RouterNotifier([])) as app:
        r = app.post("/v1/chat/completions", json={"session_id": "s"})
        assert r.headers["x-cachettl-engine"] == "gpu-node-3"
        bad = app.post("/v1/chat/completions", json={"vllm_xargs": {"pin_ttl_s": -1}})
        assert bad.status_code == 400  # refused before any engine ran it: no engine named
        assert "x-cachettl-engine" not in bad.headers
