"""Hostile requests against a real vLLM OpenAI server with the hook: the cases (every field
a client can send, past every bound), a raw HTTP client that can send what well-behaved
clients cannot (duplicate headers, bodies of any bytes), and a seeded fuzzer of KV-hint
payloads."""

from __future__ import annotations

import http.client
import json
import random
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.kvhints import RETENTION_ACTION, XARGS_KEY
from tests.enginehook.processes import free_port, start_vllm_server, vllm_healthy, wait_for

__all__ = ["CASES", "Case", "Engine", "fuzz_body", "running_engine"]

CHAT = "/v1/chat/completions"
DEEP = 100_000


@dataclass
class Engine:
    """A running server: ``post`` sends raw requests, ``serves`` checks a normal one."""

    port: int
    model: str
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_port: int

    def post(
        self, body: bytes, headers: Sequence[tuple[str, str | bytes]] = (), path: str = CHAT
    ) -> tuple[int, str]:
        """``(status, response text)``; the connection's own failures propagate."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.putrequest("POST", path)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            for name, value in headers:
                conn.putheader(name, value)
            conn.endheaders(body)
            response = conn.getresponse()
            return response.status, response.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def chat(self, **fields: Any) -> dict[str, Any]:
        """A one-token chat body with ``fields`` laid over it."""
        messages = [{"role": "user", "content": "hello there"}]
        return {"model": self.model, "messages": messages, "max_tokens": 1, **fields}

    def serves(self) -> None:
        """The engine is alive and answers a normal request with a completion."""
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        status, text = self.post(json.dumps(self.chat(session_id="healthy")).encode())
        assert status == 200, text[:500]
        assert json.loads(text)["choices"], text[:500]
        assert self.proc.poll() is None, self.log.read_text()[-3000:]

    def metrics(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()


def running_engine(model: Path, work: Path, middleware: bool) -> Iterator[Engine]:
    """A server on the tiny model (with or without the session middleware), stopped after."""
    metrics_port, port = free_port(), free_port()
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": 60.0, "skip_slow_tools": False},
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    }
    extra = ("--middleware", "enginehook.sessions.SessionIdMiddleware") if middleware else ()
    log = work / "vllm.log"
    proc = start_vllm_server(model, port, hook, log, extra)
    try:
        wait_for(lambda: vllm_healthy(proc, port, log), 600, "the vLLM server")
        yield Engine(port, str(model), proc, log, metrics_port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _envelope(payload: Any) -> dict[str, Any]:
    action = {
        "action_id": "a",
        "action_type": RETENTION_ACTION,
        "action_version": "1",
        "payload": payload,
    }
    return {"protocol_version": "1", "message_id": "m", "actions": [action]}


def _ttl_text(ttl: str) -> str:
    """An envelope's JSON text whose ``ttl_s`` is the literal ``ttl``."""
    return json.dumps(_envelope({"ttl_s": 0})).replace('"ttl_s": 0', f'"ttl_s": {ttl}')


def _deep_text(depth: int) -> str:
    """An envelope's JSON text whose payload nests ``depth`` arrays deep."""
    return json.dumps(_envelope({"x": 0})).replace("0", "[" * depth + "]" * depth, 1)


@dataclass(frozen=True)
class Case:
    """One hostile request: ``fields`` laid over a normal chat body (``raw``: JSON text
    spliced in as the value of ``raw[0]``), its ``headers``, and the field a middleware's
    400 names (``None``: the middleware lets it through)."""

    name: str
    field: str | None
    fields: dict[str, Any]
    headers: tuple[tuple[str, str | bytes], ...] = ()
    raw: tuple[str, str] | None = None

    def body(self, engine: Engine) -> bytes:
        # A body session_id would win over the headers and fields under test.
        fields = dict(self.fields)
        if not self.headers and not {"session_id", "prompt_cache_key"} & fields.keys():
            fields["session_id"] = f"hostile-{self.name}"
        body = engine.chat(**fields)
        text = json.dumps(body)
        if self.raw is not None:
            key, literal = self.raw
            text = text[:-1] + f', "{key}": {literal}' + "}"
        return text.encode()


_XK = f"vllm_xargs.{XARGS_KEY}"
_BIG = "9" * 400
CASES = [
    Case("xargs-envelope-deep", _XK, {"vllm_xargs": {XARGS_KEY: _deep_text(DEEP)}}),
    Case("xargs-envelope-ttl-400-digits", _XK, {"vllm_xargs": {XARGS_KEY: _ttl_text(_BIG)}}),
    Case("xargs-envelope-ttl-1e400", _XK, {"vllm_xargs": {XARGS_KEY: _ttl_text("1e400")}}),
    Case("xargs-envelope-ttl-nan", _XK, {"vllm_xargs": {XARGS_KEY: _ttl_text("NaN")}}),
    Case("xargs-envelope-1mb", _XK, {"vllm_xargs": {XARGS_KEY: " " * 2**20 + "{}"}}),
    Case(
        "xargs-envelope-tool-5mb",
        _XK,
        {"vllm_xargs": {XARGS_KEY: json.dumps(_envelope({"tool": "t" * 5 * 2**20}))}},
    ),
    Case(
        "xargs-pin-ttl-400-digits",
        "vllm_xargs.pin_ttl_s",
        {},
        raw=("vllm_xargs", '{"pin_ttl_s": ' + _BIG + "}"),
    ),
    Case(
        "xargs-pin-ttl-max-1e400",
        "vllm_xargs.pin_ttl_max_s",
        {},
        raw=("vllm_xargs", '{"pin_ttl_max_s": 1e400}'),
    ),
    Case(
        "xargs-pin-ttl-long-text",
        "vllm_xargs.pin_ttl_s",
        {"vllm_xargs": {"pin_ttl_s": "1" * 2**20}},
    ),
    Case("xargs-tool-5mb", "vllm_xargs.tool", {"vllm_xargs": {"tool": "t" * 5 * 2**20}}),
    Case(
        "xargs-last-turn-junk",
        "vllm_xargs.last_turn",
        {"vllm_xargs": {"last_turn": "maybe" * 2**18}},
    ),
    Case("xargs-pin-list", "vllm_xargs.pin", {"vllm_xargs": {"pin": list(range(10_000))}}),
    Case(
        "xargs-parent-300",
        "vllm_xargs.parent_session_id",
        {"vllm_xargs": {"parent_session_id": "p" * 300}},
    ),
    Case(
        "xargs-parent-control",
        "vllm_xargs.parent_session_id",
        {"vllm_xargs": {"parent_session_id": "p\x07"}},
    ),
    Case("body-kv-hints-deep", "body", {}, raw=("kv_hints", "[" * DEEP + "]" * DEEP)),
    Case("body-kv-hints-ttl-400-digits", "kv_hints", {}, raw=("kv_hints", _ttl_text(_BIG))),
    Case("body-kv-hints-ttl-1e400", "kv_hints", {}, raw=("kv_hints", _ttl_text("1e400"))),
    Case("body-kv-hints-nested-payload", "kv_hints", {"kv_hints": json.loads(_deep_text(100))}),
    Case("body-other-field-deep", "body", {}, raw=("tools", "[" * 5000 + "]" * 5000)),
    Case("body-session-id-1mb", "session_id", {"session_id": "s" * 2**20}),
    Case("body-prompt-cache-key-control", "prompt_cache_key", {"prompt_cache_key": "k\x1b"}),
    Case("header-session-10k", "x-session-id", {}, (("X-Session-ID", "h" * 10_000),)),
    Case(
        "header-session-twice",
        "x-session-id",
        {},
        (("X-Session-ID", "a"), ("X-Session-ID", "b" * 10_000)),
    ),
    Case(
        "header-dynamo-twice",
        "x-dynamo-session-id",
        {},
        (("X-Dynamo-Session-ID", "a"), ("X-Dynamo-Session-ID", "b")),
    ),
    Case(
        "header-dynamo-control",
        "x-dynamo-session-id",
        {},
        (("X-Dynamo-Session-ID", "a\u0085b".encode()),),
    ),
    Case(
        "header-dynamo-not-utf8",
        "x-dynamo-session-id",
        {},
        (("X-Dynamo-Session-ID", b"a\xff\xfe"),),
    ),
    Case(
        "header-agent-10k",
        "x-claude-code-agent-id",
        {},
        (("X-Claude-Code-Session-Id", "c"), ("X-Claude-Code-Agent-Id", "g" * 10_000)),
    ),
    Case(
        "header-parent-10k",
        "x-parent-session-id",
        {},
        (("X-Session-ID", "c"), ("X-Parent-Session-ID", "p" * 10_000)),
    ),
    Case(
        "header-final-junk",
        "x-dynamo-session-final",
        {},
        (("X-Dynamo-Session-Final", "z" * 10_000),),
    ),
]


def _hostile_value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, biased to what breaks parsers: huge numbers, deep nesting,
    long or control-laden strings, wrong types."""
    pick = rng.randrange(12)
    if pick == 0:
        return 10 ** rng.randrange(1, 500) * rng.choice((1, -1))
    if pick == 1:
        return rng.choice((1e308, -1e308, 5e-324, 0.0, -0.0, 1.5))
    if pick == 2:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(0, 64)))
    if pick == 3:
        return "x" * rng.choice((0, 255, 256, 257, 4096, 4097, 70_000))
    if pick == 4 and depth < 6:
        return [_hostile_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if pick == 5 and depth < 6:
        return {str(_hostile_value(rng, 6))[:20]: _hostile_value(rng, depth + 1) for _ in range(3)}
    if pick == 6:
        return rng.choice((True, False, None, "true", "0", "yes", 2, -1))
    return rng.choice((0, 1, 30, 300.5, "30", "", "1e400", "nan"))


def _hostile_literal(rng: random.Random) -> str:
    """JSON text the stdlib encoder would not write: deep nesting, NaN, huge literals."""
    pick = rng.randrange(5)
    if pick == 0:
        depth = rng.choice((17, 200, 5000, DEEP))
        return "[" * depth + "]" * depth
    if pick == 1:
        return rng.choice(("NaN", "Infinity", "-Infinity", "1e400", "-1e400"))
    if pick == 2:
        return "9" * rng.choice((33, 400, 5000))
    if pick == 3:
        return '{"a": ' * 50 + "1" + "}" * 50
    return json.dumps(_hostile_value(rng))


def fuzz_body(engine: Engine, rng: random.Random) -> bytes:
    """One random chat body whose hints (flat keys, the envelope as ``vllm_xargs`` text or
    as a body ``kv_hints``) are hostile."""
    keys = ("ttl_s", "ttl_ceiling_s", "last_turn", "tool", "tool_args", "pin", "release")
    payload = {rng.choice(keys): _hostile_value(rng) for _ in range(rng.randrange(1, 4))}
    envelope = _envelope(payload)
    if rng.random() < 0.3:
        envelope[rng.choice(("actions", "message_id", "protocol_version"))] = _hostile_value(rng)
    text = json.dumps(envelope)
    if rng.random() < 0.5:
        text = text.replace(json.dumps(payload), '{"ttl_s": ' + _hostile_literal(rng) + "}")
    flat = (
        "pin_ttl_s",
        "pin_ttl_max_s",
        "last_turn",
        "tool",
        "pin",
        "release",
        "parent_session_id",
    )
    xargs: dict[str, Any] = {}
    for _ in range(rng.randrange(0, 3)):
        value = _hostile_value(rng)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            xargs[rng.choice(flat)] = value
    where = rng.randrange(3)
    if where == 0:
        xargs[XARGS_KEY] = text
    body = json.dumps(engine.chat(session_id=f"fuzz-{rng.randrange(50)}", vllm_xargs=xargs))
    if where == 1:
        body = body[:-1] + f', "kv_hints": {text}' + "}"
    return body.encode()
