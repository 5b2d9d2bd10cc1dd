"""What was pinned, in the reply: the middleware's header logic in front of a real ASGI app,
then a real ``vllm serve`` with the hook and the middleware, driven by the ``openai``
client (the reply's headers and ``kv_transfer_params`` against the hook's event log)."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from enginehook.hints.replies import REPLY_KEY, pin_reply
from enginehook.hints.sessions import SessionIdMiddleware
from enginehook.tools.tinymodel import random_words
from tests.enginehook.processes import (
    free_port,
    settled_events,
    start_vllm_server,
    vllm_healthy,
    wait_for,
)

CHAT = "/v1/chat/completions"
PIN_HEADERS = (
    "x-cachettl-pinned",
    "x-cachettl-pin-ttl",
    "x-cachettl-pin-expires-at",
    "x-cachettl-pin-tokens",
)
PINNED = {REPLY_KEY: pin_reply("e1", 30.0, 1767225600.125, 96)}

# -- the middleware's header logic in front of a real ASGI app --------------------------------


async def _reply(request: Request) -> Response:
    """Answers as the request's ``kind`` says: a JSON reply carrying ``params`` (whole, in
    chunks, or as an error), or a stream."""
    ask = await request.json()
    kind, params = ask["kind"], ask.get("params")
    body = {"id": "x", "kv_transfer_params": params, "pad": "p" * ask.get("pad", 0)}
    if kind == "json":
        return JSONResponse(body)
    if kind == "error":
        return JSONResponse(body, status_code=400)
    raw = json.dumps(body).encode()

    async def chunks() -> AsyncIterator[bytes]:
        if kind == "chunked":
            for i in range(0, len(raw), 7):
                yield raw[i : i + 7]
        else:
            yield b'data: {"choices": []}\n\n'
            yield f"data: {json.dumps(body)}\n\n".encode()
            yield b"data: [DONE]\n\n"

    media = "application/json" if kind == "chunked" else "text/event-stream"
    return StreamingResponse(chunks(), media_type=media)


@pytest.fixture(scope="module")
def app() -> Iterator[TestClient]:
    middleware = [Middleware(SessionIdMiddleware, max_body_bytes=4096)]
    routes = [Route(path, _reply, methods=["POST"]) for path in (CHAT, "/v1/completions", "/o")]
    with TestClient(Starlette(routes=routes, middleware=middleware)) as client:
        yield client


def _ask(app: TestClient, kind: str, params: Any, path: str = CHAT, pad: int = 0) -> Any:
    return app.post(path, json={"kind": kind, "params": params, "pad": pad})


def _pin(r: Any) -> dict[str, str]:
    return {h: r.headers[h] for h in PIN_HEADERS if h in r.headers}


@pytest.mark.parametrize("kind", ["json", "chunked"])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_a_json_reply_carrying_a_pin_names_it_in_headers(
    app: TestClient, kind: str, path: str
) -> None:
    r = _ask(app, kind, PINNED, path)
    assert r.status_code == 200
    assert _pin(r) == {
        "x-cachettl-pinned": "true",
        "x-cachettl-pin-ttl": "30",
        "x-cachettl-pin-expires-at": "1767225600.125",
        "x-cachettl-pin-tokens": "96",
    }
    assert r.json()["kv_transfer_params"] == PINNED  # the body is passed on as it was
    assert r.headers["x-cachettl-engine"]


def test_a_decision_not_to_pin_says_so_and_nothing_else(app: TestClient) -> None:
    r = _ask(app, "json", {"other": 1, REPLY_KEY: pin_reply("e1")})
    assert _pin(r) == {"x-cachettl-pinned": "false"}


@pytest.mark.parametrize(
    "params",
    [
        None,
        {"do_remote_prefill": False},
        {REPLY_KEY: "yes"},
        {REPLY_KEY: {"pinned": "true"}},
        {REPLY_KEY: {**PINNED[REPLY_KEY], "ttl_s": -1}},
        {REPLY_KEY: {**PINNED[REPLY_KEY], "tokens": True}},
        {REPLY_KEY: {"pinned": True}},
    ],
)
def test_a_reply_without_a_well_formed_decision_gets_no_pin_header(
    app: TestClient, params: Any
) -> None:
    r = _ask(app, "json", params)
    assert r.status_code == 200
    assert _pin(r) == {}
    assert r.json()["kv_transfer_params"] == params


def test_errors_streams_other_paths_and_long_bodies_pass_as_they_come(app: TestClient) -> None:
    assert _pin(_ask(app, "error", PINNED)) == {}
    assert _pin(_ask(app, "json", PINNED, path="/o")) == {}
    stream = _ask(app, "stream", PINNED)
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert _pin(stream) == {}
    assert stream.text.endswith("data: [DONE]\n\n")
    assert json.loads(stream.text.split("data: ")[2])["kv_transfer_params"] == PINNED
    for kind in ("json", "chunked"):
        long = _ask(app, kind, PINNED, pad=5000)  # over max_body_bytes: not held
        assert _pin(long) == {}
        assert long.json()["pad"] == "p" * 5000


def test_a_body_at_the_limit_is_still_read(app: TestClient) -> None:
    base = len(json.dumps({"id": "x", "kv_transfer_params": PINNED, "pad": ""}).encode())
    r = _ask(app, "chunked", PINNED, pad=4096 - base)
    assert len(r.content) == 4096
    assert _pin(r)["x-cachettl-pinned"] == "true"


# -- a real vLLM server with the hook and the middleware ---------------------------------------

TTL_S = 45.0


@dataclass
class Server:
    base_url: str
    model: str
    event_log: Path
    hook_metrics: str

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)

    def events(self, kind: str, program: str) -> list[dict[str, Any]]:
        records = settled_events(self.event_log)
        return [e for e in records if e["kind"] == kind and e["program_id"] == program]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("pin-reply")
    metrics_port = free_port()
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": TTL_S, "skip_slow_tools": False},
        "event_log": str(work / "events.jsonl"),
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    }
    port, log = free_port(), work / "vllm.log"
    middleware = ("--middleware", "enginehook.sessions.SessionIdMiddleware")
    proc = start_vllm_server(tiny_model, port, hook, log, middleware)
    try:
        wait_for(lambda: vllm_healthy(proc, port, log), 600, "the vLLM server")
        yield Server(
            f"http://127.0.0.1:{port}/v1",
            str(tiny_model),
            work / "events.jsonl",
            f"http://127.0.0.1:{metrics_port}/metrics",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _messages(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"role": "system", "content": random_words(rng, 40)},
        {"role": "user", "content": random_words(rng, 450)},
    ]


def _turn(
    server: Server, program: str, messages: list[dict[str, Any]], xargs: dict[str, Any]
) -> Any:
    """One non-streaming chat turn of ``program``: the raw reply (headers and body)."""
    return server.client().chat.completions.with_raw_response.create(
        model=server.model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"session_id": program, "vllm_xargs": xargs, "ignore_eos": True},
    )


@pytest.mark.slow
def test_a_tool_calls_reply_names_the_pin_the_event_log_records(server: Server) -> None:
    program, messages = "reply-pin", _messages(1)
    raw = _turn(server, program, messages, {"tool": "bash", "tool_args": "ls"})
    reply = raw.parse()
    decided = reply.kv_transfer_params[REPLY_KEY]
    headers = {h: raw.headers.get(h) for h in PIN_HEADERS}
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": random_words(random.Random(2), 30)},
    ]
    last = _turn(server, program, messages, {"last_turn": 1})
    wait_for(lambda: bool(server.events("program_end", program)), 60, "the program's end")
    (call,) = server.events("tool_call", program)
    assert call["pin_outcome"] == "hit"
    assert decided["pinned"] is True
    assert decided["ttl_s"] == call["chosen_ttl_s"] == TTL_S
    assert decided["expires_at"] == pytest.approx(call["finished_at"] + TTL_S, abs=1e-6)
    assert decided["tokens"] > 0
    assert decided["tokens"] % 32 == 0
    assert decided["tokens"] <= reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert last.parse().usage.prompt_tokens_details.cached_tokens >= decided["tokens"]
    assert headers == {
        "x-cachettl-pinned": "true",
        "x-cachettl-pin-ttl": f"{TTL_S:g}",
        "x-cachettl-pin-expires-at": f"{decided['expires_at']:.3f}",
        "x-cachettl-pin-tokens": str(decided["tokens"]),
    }
    # the engine as its hook names it: the API server's host:port, then this start's id
    assert re.fullmatch(r"127\.0\.0\.1:\d+#[0-9a-f]{6}", decided["engine"])
    assert last.parse().kv_transfer_params == {
        REPLY_KEY: {"engine": decided["engine"], "pinned": False}
    }
    assert {h: last.headers.get(h) for h in PIN_HEADERS} == {
        "x-cachettl-pinned": "false",
        "x-cachettl-pin-ttl": None,
        "x-cachettl-pin-expires-at": None,
        "x-cachettl-pin-tokens": None,
    }


@pytest.mark.slow
def test_a_turn_without_a_session_carries_nothing(server: Server) -> None:
    raw = server.client().chat.completions.with_raw_response.create(
        model=server.model, messages=_messages(3), max_tokens=4, temperature=0
    )
    assert raw.parse().kv_transfer_params is None
    assert not any(h in raw.headers for h in PIN_HEADERS)
    assert raw.headers["x-cachettl-engine"]


@pytest.mark.slow
def test_a_completions_reply_names_the_pin_too(server: Server) -> None:
    program = "reply-completions"
    raw = server.client().completions.with_raw_response.create(
        model=server.model,
        prompt=random_words(random.Random(4), 300),
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": program, "vllm_xargs": {"tool": "bash"}},
    )
    decided = raw.parse().kv_transfer_params[REPLY_KEY]
    assert decided["pinned"] is True
    assert decided["ttl_s"] == TTL_S
    assert raw.headers["x-cachettl-pin-tokens"] == str(decided["tokens"])


@pytest.mark.slow
def test_a_streamed_tool_call_is_pinned_but_its_reply_cannot_say_so(server: Server) -> None:
    """vLLM 0.32's stream generators drop the final output's ``kv_transfer_params``: the
    hook pins the streamed turn, no header or chunk says so (enginehook/README.md,
    *Cluster*, "Not done"); from 0.33 the chunk with ``finish_reason`` carries it."""
    from vllm import __version__ as vllm_version

    program = "reply-stream"
    stream = server.client().chat.completions.with_raw_response.create(
        model=server.model,
        messages=_messages(5),
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"session_id": program, "vllm_xargs": {"tool": "bash"}, "ignore_eos": True},
    )
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert not any(h in stream.headers for h in PIN_HEADERS)
    chunks = [c.model_dump() for c in stream.parse()]
    carried = [c["kv_transfer_params"] for c in chunks if c.get("kv_transfer_params")]
    if vllm_version.startswith("0.32."):
        assert chunks
        assert carried == []
    else:
        assert [c[REPLY_KEY]["pinned"] for c in carried] == [True]
    pinned = server.client().chat.completions.with_raw_response.create(
        model=server.model,
        messages=_messages(5),
        max_tokens=8,
        temperature=0,
        extra_body={"session_id": program, "vllm_xargs": {"last_turn": 1}, "ignore_eos": True},
    )
    assert pinned.headers["x-cachettl-pinned"] == "false"
    wait_for(lambda: bool(server.events("program_end", program)), 60, "the program's end")
    (call,) = server.events("tool_call", program)
    assert (call["chosen_ttl_s"], call["pin_outcome"]) == (TTL_S, "hit")


def _responses(server: Server, program: str, xargs: dict[str, Any], stream: bool) -> Any:
    import httpx

    body = {
        "model": server.model,
        "input": random_words(random.Random(6), 300),
        "max_output_tokens": 8,
        "temperature": 0,
        "stream": stream,
        "session_id": program,
        "vllm_xargs": xargs,
        "ignore_eos": True,
    }
    return httpx.post(f"{server.base_url}/responses", json=body, timeout=120)


@pytest.mark.slow
def test_a_streamed_responses_turn_names_its_pin_in_its_completed_event(server: Server) -> None:
    """The Responses API's stream ends with ``response.completed``, whose ``response`` is
    the whole reply, ``kv_transfer_params`` included (vLLM's own field): the one stream
    that carries the pin."""
    program = "reply-responses"
    r = _responses(server, program, {"tool": "bash"}, stream=True)
    assert r.status_code == 200, r.text
    assert not any(h in r.headers for h in PIN_HEADERS)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    (done,) = [e for e in events if e["type"] == "response.completed"]
    decided = done["response"]["kv_transfer_params"][REPLY_KEY]
    assert decided["pinned"] is True
    assert decided["ttl_s"] == TTL_S
    last = _responses(server, program, {"last_turn": 1}, stream=False)
    assert last.json()["kv_transfer_params"][REPLY_KEY]["pinned"] is False
    assert last.headers["x-cachettl-pinned"] == "false"
    wait_for(lambda: bool(server.events("program_end", program)), 60, "the program's end")
    (call,) = server.events("tool_call", program)
    assert call["pin_outcome"] == "hit"
    assert decided["expires_at"] == pytest.approx(call["finished_at"] + TTL_S, abs=1e-6)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _gauge(text: str, name: str) -> float:
    """The value of the one sample of ``name`` in a Prometheus text exposition."""
    (value,) = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(value)


@pytest.mark.slow
def test_routers_read_pinned_blocks_as_free_and_the_pinned_share_beside_it(
    server: Server,
) -> None:
    """With only pins in the pool and nothing running, vllm:kv_cache_usage_perc (what a
    router admits by) reads 0 while the hook's cachettl_kv_pinned_perc is the pins'
    blocks over the pool vLLM reports; the next turn still hits its pin."""
    program, messages = "usage-pin", _messages(7)
    reply = _turn(server, program, messages, {"tool": "bash", "tool_args": "ls"}).parse()
    tokens = reply.kv_transfer_params[REPLY_KEY]["tokens"]
    engine = _scrape(server.base_url.removesuffix("/v1") + "/metrics")
    blocks = re.search(r'^vllm:cache_config_info{[^}]*num_gpu_blocks="(\d+)"', engine, re.M)
    assert blocks is not None
    pool = int(blocks.group(1)) - 1  # vLLM's usage leaves out its null block
    assert _gauge(engine, "vllm:kv_cache_usage_perc") == 0.0
    hook = _scrape(server.hook_metrics)
    # Every pin's blocks (this module's other programs may still hold theirs; none of
    # their prompts shares a block with another's), this one's among them.
    pinned_blocks = _gauge(hook, "cachettl_pinned_blocks")
    assert pinned_blocks >= tokens // 32 > 0
    assert _gauge(hook, "cachettl_kv_pinned_perc") == pytest.approx(pinned_blocks / pool, rel=1e-4)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": random_words(random.Random(8), 30)},
    ]
    last = _turn(server, program, messages, {"last_turn": 1}).parse()
    assert last.usage.prompt_tokens_details.cached_tokens >= tokens
