"""What vllm-router 0.1.17 hands a worker on ``/v1/responses`` (the real router in front
of a recording worker): no request header at all, so a session in ``X-Session-ID`` (or any
session header) never reaches the engine there, while the body goes on verbatim; its
``session_id`` is what the session middleware and vLLM read. Chat and completions keep
their headers. Behind this router, a Responses client names its session in the body."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from enginehook.hints.choice import choose_session, read_headers
from enginehook.tools.cluster import Router

pytestmark = pytest.mark.slow


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]]

    def _answer(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        raw = [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        self.seen.append({"path": self.path, "headers": raw, "body": json.loads(body)})
        self._answer({"id": "r", "object": "response", "output": [], "choices": []})

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, list[Any]]]:
    seen: list[dict[str, Any]] = []
    worker = ThreadingHTTPServer(("127.0.0.1", 0), type("R", (_Recorder,), {"seen": seen}))
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{worker.server_address[1]}"
    router = Router("consistent_hash", [url], tmp_path_factory.mktemp("router"))
    router.start()
    try:
        yield router, seen
    finally:
        router.stop()
        worker.shutdown()


def _post(router: Router, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    request = urllib.request.Request(
        f"{router.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        reply.read()


def test_responses_lose_every_header_and_keep_the_body(routed: tuple[Router, list[Any]]) -> None:
    router, seen = routed
    seen.clear()
    headers = {"X-Session-ID": "hdr-1", "Session-Id": "hdr-2", "X-Dynamo-Session-ID": "hdr-3"}
    _post(router, "/v1/responses", {"model": "m", "input": "hi"}, headers)
    _post(router, "/v1/responses", {"model": "m", "input": "hi", "session_id": "body-1"}, {})
    _post(router, "/v1/chat/completions", {"model": "m", "messages": []}, {"X-Session-ID": "c-1"})
    header_only, in_body, chat = seen
    assert header_only["path"] == in_body["path"] == "/v1/responses"
    assert choose_session(read_headers(header_only["headers"]), header_only["body"]) is None
    found = choose_session(read_headers(in_body["headers"]), in_body["body"], "/v1/responses")
    assert found is not None
    assert found.session_id == "body-1"
    found = choose_session(read_headers(chat["headers"]), chat["body"])
    assert found is not None
    assert found.session_id == "c-1"
