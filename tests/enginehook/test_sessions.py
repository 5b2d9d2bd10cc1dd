"""Session ids and KV-hint envelopes over HTTP: :class:`SessionIdMiddleware` in front of a
real ASGI app (what the app receives), then in front of a real ``vllm serve`` with the hook,
driven by the ``openai`` client (what the hook makes of it: programs, TTLs, releases)."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from controlplane.kvhints import RETENTION_ACTION, XARGS_KEY
from enginehook.hints.choice import PATHS
from enginehook.hints.sessions import SessionIdMiddleware
from tests.enginehook.processes import free_port, start_vllm_server, vllm_healthy, wait_for

CHAT = "/v1/chat/completions"


def _envelope(payload: Any, kind: str = RETENTION_ACTION, version: str = "1") -> dict[str, Any]:
    action = {"action_id": "a", "action_type": kind, "action_version": version, "payload": payload}
    return {"protocol_version": "1", "message_id": "m", "actions": [action]}


# -- the middleware in front of a real ASGI app ----------------------------------------------


def test_docstring_examples() -> None:
    import doctest

    import enginehook.hints.choice

    result = doctest.testmod(enginehook.hints.choice, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


async def _echo(request: Request) -> JSONResponse:
    raw = await request.body()
    return JSONResponse(
        {
            "session": request.headers.get("x-session-id"),
            "raw": raw.decode(),
            "length": request.headers.get("content-length"),
        }
    )


def _client(**options: Any) -> TestClient:
    routes = [Route(path, _echo, methods=["POST", "GET"]) for path in [*PATHS, "/other"]]
    middleware = [Middleware(SessionIdMiddleware, **options)]
    return TestClient(Starlette(routes=routes, middleware=middleware))


@pytest.fixture(scope="module")
def app() -> Iterator[TestClient]:
    with _client() as client:
        yield client


def _seen(app: TestClient, body: Any, headers: dict[str, str] | None = None, path: str = CHAT):
    r = app.post(path, content=json.dumps(body), headers=headers or {})
    assert r.status_code == 200, r.text
    seen = r.json()
    assert int(seen["length"]) == len(seen["raw"].encode())
    return seen["session"], json.loads(seen["raw"])


DYNAMO = {"x-dynamo-session-id": "dyn"}
CLAUDE = {"x-claude-code-session-id": "claude"}


@pytest.mark.parametrize(
    ("headers", "body", "header_out", "xargs_session"),
    [
        ({**DYNAMO, **CLAUDE}, {"prompt_cache_key": "pck"}, "dyn", None),
        (CLAUDE, {"prompt_cache_key": "pck"}, "claude", None),
        ({"session-id": "codex", "session_id": "old"}, {"prompt_cache_key": "c"}, "codex", None),
        ({"session_id": "old-codex"}, {"prompt_cache_key": "c"}, "old-codex", None),
        ({**CLAUDE, "session-id": "codex"}, {}, "claude", None),
        ({}, {"prompt_cache_key": "pck", "vllm_xargs": {"pin": 0}}, None, "pck"),
        ({"x-dynamo-session-id": ""}, {"prompt_cache_key": "pck"}, None, "pck"),  # empty: absent
        ({"x-session-id": "vllm-h", **DYNAMO}, {}, "vllm-h", None),  # vLLM reads it itself
    ],
)
def test_the_first_source_present_reaches_vllm_as_a_source_it_reads(
    app: TestClient, headers: dict[str, str], body: Any, header_out: str | None, xargs_session: Any
) -> None:
    session, seen = _seen(app, {"model": "m", **body}, headers)
    assert session == header_out
    assert seen.get("vllm_xargs", {}).get("session_id") == xargs_session
    seen.pop("vllm_xargs", None)
    assert seen == {"model": "m", **{k: v for k, v in body.items() if k != "vllm_xargs"}}


@pytest.mark.parametrize(
    "body", [{"session_id": "own"}, {"vllm_xargs": {"session_id": "own", "last_turn": 1}}]
)
def test_vllms_own_sources_win_and_the_request_is_passed_on_byte_for_byte(
    app: TestClient, body: dict[str, Any]
) -> None:
    raw = json.dumps({"model": "m", **body, "prompt_cache_key": "pck"}, indent=3)
    r = app.post(CHAT, content=raw, headers={**DYNAMO, **CLAUDE})
    assert r.json() == {"session": None, "raw": raw, "length": str(len(raw))}


def test_on_the_messages_endpoint_a_body_session_id_is_no_source(app: TestClient) -> None:
    session, _ = _seen(app, {"session_id": "ignored-by-vllm"}, CLAUDE, path="/v1/messages")
    assert session == "claude"
    session, _ = _seen(app, {"session_id": "s"}, CLAUDE, path="/v1/completions")
    assert session is None  # vLLM reads the body's there


SUB = {**CLAUDE, "x-claude-code-agent-id": "explore-2"}
PARENT = "x-parent-session-id"


def test_a_sub_agent_of_a_claude_code_session_is_its_own_program(app: TestClient) -> None:
    assert _seen(app, {"model": "m"}, CLAUDE)[0] == "claude"  # the parent
    session, seen = _seen(app, {"model": "m"}, SUB)
    # ... whose parent's place in the program order it keeps
    assert (session, seen) == (
        "claude/explore-2",
        {"model": "m", "vllm_xargs": {"parent_session_id": "claude"}},
    )
    # Whichever source carries that session's id, the sub-agent's id qualifies it there.
    session, seen = _seen(app, {"session_id": "claude"}, SUB)
    assert (session, seen["session_id"]) == (None, "claude/explore-2")
    session, _ = _seen(app, {}, {**SUB, "x-session-id": "claude"})
    assert session == "claude/explore-2"
    session, seen = _seen(app, {"vllm_xargs": {"session_id": "claude"}}, SUB)
    assert (session, seen["vllm_xargs"]["session_id"]) == (None, "claude/explore-2")
    # Another session's id is not qualified by this session's sub-agent header.
    raw = json.dumps({"model": "m", "session_id": "own"})
    assert app.post(CHAT, content=raw, headers=SUB).json()["raw"] == raw


def test_a_parent_session_header_becomes_the_parent_hint(app: TestClient) -> None:
    session, seen = _seen(app, {"model": "m"}, {"x-session-id": "child", PARENT: "root"})
    assert (session, seen["vllm_xargs"]) == ("child", {"parent_session_id": "root"})
    _, seen = _seen(app, {"model": "m"}, {"x-session-id": "root", PARENT: "root"})
    assert seen == {"model": "m"}  # its own session: no parent
    _, seen = _seen(app, {"model": "m"}, {PARENT: "root"})
    assert seen == {"model": "m"}  # no session: nothing to order
    r = app.post(CHAT, content="{}", headers={"x-session-id": "child", PARENT: "r" * 300})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == PARENT


def test_a_sessions_own_header_survives_a_body_the_middleware_changes(app: TestClient) -> None:
    session, seen = _seen(
        app, {"kv_hints": _envelope({"ttl_s": 3})}, {"x-session-id": "kept", **DYNAMO}
    )
    assert session == "kept"
    assert XARGS_KEY in seen["vllm_xargs"]


@pytest.mark.parametrize(
    ("agent", "what"),
    [("a\x01", "must not contain control characters"), ("a" * 250, "makes the program id 257")],
)
def test_a_malformed_sub_agent_id_is_a_400_naming_its_header(
    app: TestClient, agent: str, what: str
) -> None:
    r = app.post(CHAT, content="{}", headers={**CLAUDE, "x-claude-code-agent-id": agent})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "x-claude-code-agent-id"
    assert what in error["message"]


@pytest.mark.parametrize(
    ("headers", "body", "field", "what"),
    [
        ({"x-dynamo-session-id": "a" * 257}, {}, "x-dynamo-session-id", "at most 256 characters"),
        ({"x-claude-code-session-id": "a\tb"}, {}, "x-claude-code-session-id", "control char"),
        ({}, {"prompt_cache_key": "k\x01"}, "prompt_cache_key", "control characters"),
        ({}, {"session_id": "s" * 300}, "session_id", "at most 256 characters"),
        ({"session_id": "s" * 300}, {}, "header session_id", "at most 256 characters"),
        ({}, {"vllm_xargs": {"session_id": "x\n"}}, "vllm_xargs.session_id", "control"),
    ],
)
def test_a_malformed_winning_id_is_a_400_naming_its_source(
    app: TestClient, headers: dict[str, str], body: Any, field: str, what: str
) -> None:
    r = app.post(CHAT, content=json.dumps(body), headers=headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field} must")
    assert what in error["message"]


def test_a_malformed_id_that_does_not_win_is_not_looked_at(app: TestClient) -> None:
    session, _ = _seen(app, {"prompt_cache_key": "\x01" * 400}, DYNAMO)
    assert session == "dyn"


def test_a_body_envelope_moves_into_vllm_xargs_as_text(app: TestClient) -> None:
    envelope = _envelope({"ttl_s": 30, "release": True})
    _, seen = _seen(app, {"kv_hints": envelope, "vllm_xargs": {"tool": "bash"}})
    assert "kv_hints" not in seen
    assert seen["vllm_xargs"]["tool"] == "bash"
    assert json.loads(seen["vllm_xargs"][XARGS_KEY]) == envelope
    _, seen = _seen(app, {"kv_hints": envelope, "vllm_xargs": {XARGS_KEY: "older"}})
    assert json.loads(seen["vllm_xargs"][XARGS_KEY]) == envelope  # the body's field wins
    _, seen = _seen(app, {"kv_hints": _envelope({"anything": 1}, kind="kv.fetch")})
    assert json.loads(seen["vllm_xargs"][XARGS_KEY])["actions"][0]["action_type"] == "kv.fetch"


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"kv_hints": _envelope({"ttl_s": -1})}, "kv_hints", "kv_hints.actions[0].payload.ttl_s"),
        ({"kv_hints": "text"}, "kv_hints", "kv_hints must be an object"),
        ({"kv_hints": _envelope({}), "vllm_xargs": [1]}, "vllm_xargs", "must be an object"),
        (
            {"vllm_xargs": {XARGS_KEY: json.dumps(_envelope({"pin": "yes"}))}},
            f"vllm_xargs.{XARGS_KEY}",
            f"vllm_xargs.{XARGS_KEY}.actions[0].payload.pin must be true or false",
        ),
    ],
)
def test_a_malformed_envelope_is_a_400_naming_the_field_path(
    app: TestClient, body: Any, field: str, message: str
) -> None:
    r = app.post(CHAT, content=json.dumps(body))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field
    assert message in r.json()["error"]["message"]


def test_dynamos_session_final_header_is_the_release_hint(app: TestClient) -> None:
    final = {"x-dynamo-session-final": "True", **DYNAMO}
    session, seen = _seen(app, {"vllm_xargs": {"last_turn": 0}}, final)
    assert (session, seen["vllm_xargs"]) == ("dyn", {"last_turn": 0, "release": True})
    _, seen = _seen(app, {"model": "m"}, {"x-dynamo-session-final": "false"})
    assert seen == {"model": "m"}
    r = app.post(CHAT, content="{}", headers={"x-dynamo-session-final": "soon"})
    assert r.status_code == 400
    assert (
        r.json()["error"]["message"] == "x-dynamo-session-final must be true or false, got 'soon'"
    )


def test_what_it_does_not_understand_passes_through_untouched() -> None:
    with _client(max_body_bytes=64) as small:
        big = json.dumps({"prompt_cache_key": "p", "pad": "x" * 100})
        r = small.post(CHAT, content=big, headers=DYNAMO)  # over the limit (content-length)
        assert r.json() == {"session": None, "raw": big, "length": str(len(big))}

        def chunks() -> Iterator[bytes]:
            yield big[:50].encode()
            yield big[50:].encode()

        r = small.post(CHAT, content=chunks(), headers=DYNAMO)  # over it, streamed
        assert (r.json()["session"], r.json()["raw"]) == (None, big)
        for path, content in [("/other", "{}"), (CHAT, "not json"), (CHAT, "[1, 2]")]:
            r = small.post(path, content=content, headers=DYNAMO)
            assert (r.json()["session"], r.json()["raw"]) == (None, content)
        r = small.get(CHAT, headers=DYNAMO)
        assert r.json()["session"] is None
        small_body = json.dumps({"kv_hints": _envelope({"ttl_s": -1})})[:60]
        r = small.post(CHAT, content=small_body, headers=DYNAMO)  # truncated JSON: vLLM's 400
        assert r.status_code == 200


# -- a real vllm serve with the middleware and the hook -----------------------------------


@dataclass
class Server:
    base_url: str
    model: str
    event_log: Path
    metrics_port: int

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)

    def events(self) -> list[dict[str, Any]]:
        if not self.event_log.exists():
            return []
        return [json.loads(line) for line in self.event_log.read_text().splitlines()]

    def metrics(self) -> dict[str, str]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))


_MIDDLEWARE = ("--middleware", "enginehook.sessions.SessionIdMiddleware")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("sessions")
    event_log, metrics_port = work / "events.jsonl", free_port()
    hook = {
        "policy": "fixed",
        "policy_params": {"ttl_s": 60.0, "skip_slow_tools": False},
        "event_log": str(event_log),
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    }
    port = free_port()
    proc = start_vllm_server(tiny_model, port, hook, work / "vllm.log", _MIDDLEWARE)
    try:
        wait_for(lambda: vllm_healthy(proc, port, work / "vllm.log"), 600, "the vLLM server")
        yield Server(f"http://127.0.0.1:{port}/v1", str(tiny_model), event_log, metrics_port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _words(seed: int, n: int) -> str:
    import random

    from enginehook.tools.tinymodel import random_words

    return random_words(random.Random(seed), n)


def _chat(
    server: Server,
    messages: list[dict[str, Any]],
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    last: bool = False,
) -> Any:
    xargs = {**body.get("vllm_xargs", {}), **({"last_turn": 1} if last else {})}
    return server.client().chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={**body, "vllm_xargs": xargs, "ignore_eos": True},
        extra_headers=headers or {},
    )


def _ended(server: Server, programs: set[str]) -> list[dict[str, Any]]:
    def done() -> bool:
        ends = {e["program_id"] for e in server.events() if e["kind"] == "program_end"}
        return programs <= ends

    wait_for(done, 60, f"the end of {sorted(programs)}")
    return server.events()


def _tool_call(server: Server, program: str, first: dict[str, Any], seed: int) -> dict[str, Any]:
    """Two turns of ``program``: a ``bash`` call (``first`` merged into its body), then the
    last turn; the finished tool call's event."""
    messages = [
        {"role": "system", "content": _words(seed, 40)},
        {"role": "user", "content": _words(seed + 1, 450)},
    ]
    xargs = {"tool": "bash", "tool_args": "ls", **first.pop("vllm_xargs", {})}
    r = _chat(server, messages, {"session_id": program, "vllm_xargs": xargs, **first})
    messages += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": _words(seed + 2, 30)},
    ]
    _chat(server, messages, {"session_id": program}, last=True)
    events = _ended(server, {program})
    (call,) = [e for e in events if e["kind"] == "tool_call" and e["program_id"] == program]
    return call


@pytest.mark.slow
def test_each_session_source_is_the_program_and_the_first_present_wins(server: Server) -> None:
    cases: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        ("src-body", {"session_id": "src-body"}, {}),
        ("src-header", {}, {"X-Session-ID": "src-header"}),
        ("src-xargs", {"vllm_xargs": {"session_id": "src-xargs"}}, {}),
        ("src-dynamo", {}, {"X-Dynamo-Session-ID": "src-dynamo"}),
        ("src-claude", {}, {"X-Claude-Code-Session-Id": "src-claude"}),
        ("src-codex", {"prompt_cache_key": "lose-8"}, {"Session-Id": "src-codex"}),
        ("src-cache-key", {"prompt_cache_key": "src-cache-key"}, {}),
        (
            "win-body",
            {"session_id": "win-body", "prompt_cache_key": "lose-1"},
            {"X-Dynamo-Session-ID": "lose-2", "X-Claude-Code-Session-Id": "lose-3"},
        ),
        (
            "win-xargs",
            {"vllm_xargs": {"session_id": "win-xargs"}},
            {"X-Dynamo-Session-ID": "lose-4"},
        ),
        (
            "win-dynamo",
            {"prompt_cache_key": "lose-5"},
            {"X-Dynamo-Session-ID": "win-dynamo", "X-Claude-Code-Session-Id": "lose-6"},
        ),
        ("win-claude", {"prompt_cache_key": "lose-7"}, {"X-Claude-Code-Session-Id": "win-claude"}),
    ]
    for i, (_, body, headers) in enumerate(cases):
        messages = [{"role": "user", "content": _words(100 + i, 40)}]
        _chat(server, messages, body, headers, last=True)
    server.client().completions.create(
        model=server.model,
        prompt=_words(99, 40),
        max_tokens=4,
        extra_body={"vllm_xargs": {"last_turn": 1}},
        extra_headers={"X-Dynamo-Session-ID": "completions-dynamo"},
    )
    expected = {program for program, _, _ in cases} | {"completions-dynamo"}
    programs = {e["program_id"] for e in _ended(server, expected)}
    assert expected <= programs
    assert not {p for p in programs if p.startswith("lose-")}


@pytest.mark.slow
def test_a_claude_code_sub_agent_keeps_its_parents_pin(server: Server) -> None:
    """The parent calls its Agent tool; the sub-agent runs two turns under the parent's
    session id with its own agent id; the parent comes back to its pin."""
    session = {"X-Claude-Code-Session-Id": "cc-run"}
    sub = {**session, "X-Claude-Code-Agent-Id": "explore-1"}
    parent = [
        {"role": "system", "content": _words(60, 40)},
        {"role": "user", "content": _words(61, 450)},
    ]
    r = _chat(server, parent, {"vllm_xargs": {"tool": "Agent"}}, session)
    child = [
        {"role": "system", "content": _words(62, 40)},
        {"role": "user", "content": _words(63, 300)},
    ]
    c = _chat(server, child, {"vllm_xargs": {"tool": "bash", "tool_args": "ls"}}, sub)
    child += [
        {"role": "assistant", "content": c.choices[0].message.content},
        {"role": "user", "content": _words(64, 30)},
    ]
    _chat(server, child, {}, sub, last=True)
    parent += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": _words(65, 30)},
    ]
    _chat(server, parent, {}, session, last=True)
    events = _ended(server, {"cc-run", "cc-run/explore-1"})
    calls = {e["program_id"]: e for e in events if e["kind"] == "tool_call"}
    assert (calls["cc-run"]["tool"], calls["cc-run"]["pin_outcome"]) == ("Agent", "hit")
    assert (calls["cc-run/explore-1"]["tool"], calls["cc-run/explore-1"]["pin_outcome"]) == (
        "bash",
        "hit",
    )
    # The parent's Agent call lasted the sub-agent's whole run.
    ends = {e["program_id"]: e for e in events if e["kind"] == "program_end"}
    child_call = calls["cc-run/explore-1"]
    assert calls["cc-run"]["duration_s"] > child_call["duration_s"]
    assert ends["cc-run/explore-1"]["total_turns"] == 2
    assert ends["cc-run"]["total_turns"] == 2


@pytest.mark.slow
def test_a_malformed_id_or_envelope_is_a_400_naming_the_field(server: Server) -> None:
    import openai

    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(server, messages, {}, {"X-Dynamo-Session-ID": "x" * 300})
    assert "x-dynamo-session-id must be at most 256 characters, got 300" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(server, messages, {"session_id": "bad-env", "kv_hints": _envelope({"ttl_s": -1})})
    assert "kv_hints.actions[0].payload.ttl_s must be a finite number >= 0, got -1" in str(
        caught.value
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("program", "first", "ttl"),
    [
        ("ttl-envelope", {"kv_hints": _envelope({"ttl_s": 7})}, 7.0),
        ("ttl-ceiling", {"kv_hints": _envelope({"ttl_ceiling_s": 5})}, 5.0),  # the policy says 60
        ("ttl-flat-ceiling", {"vllm_xargs": {"pin_ttl_max_s": 4}}, 4.0),
        (
            "ttl-envelope-wins",
            {
                "vllm_xargs": {"pin_ttl_s": 50, "pin_ttl_max_s": 100},
                "kv_hints": _envelope({"ttl_ceiling_s": 3}),
            },
            3.0,
        ),
        (
            "ttl-unknown-actions",
            {
                "vllm_xargs": {"pin_ttl_s": 9},
                "kv_hints": {
                    "protocol_version": "1",
                    "message_id": "m",
                    "actions": [
                        _envelope({"block_ids": [1]}, kind="kv.fetch")["actions"][0],
                        _envelope({"ttl_s": -1}, version="2")["actions"][0],
                    ],
                },
            },
            9.0,
        ),
    ],
)
def test_retention_actions_bound_the_pins_ttl(
    server: Server, program: str, first: dict[str, Any], ttl: float
) -> None:
    call = _tool_call(server, program, first, seed=len(program))
    assert (call["chosen_ttl_s"], call["pin_outcome"]) == (ttl, "hit")


@pytest.mark.slow
def test_a_release_action_frees_the_sessions_pin_at_once(server: Server) -> None:
    def closed() -> int:
        return int(server.metrics().get('cachettl_pin_releases_total{reason="closed"}', 0))

    before = closed()
    messages = [
        {"role": "system", "content": _words(7, 40)},
        {"role": "user", "content": _words(8, 450)},
    ]
    body = {"session_id": "released", "vllm_xargs": {"tool": "bash", "tool_args": "ls"}}
    r = _chat(server, messages, body)
    assert int(server.metrics()["cachettl_pins_held"]) == 1
    messages += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": _words(9, 30)},
    ]
    _chat(server, messages, {"session_id": "released", "kv_hints": _envelope({"release": True})})
    events = _ended(server, {"released"})
    assert closed() == before + 1  # released on arrival, not handed over as a hit
    assert int(server.metrics()["cachettl_pins_held"]) == 0
    calls = [e for e in events if e["kind"] == "tool_call" and e["program_id"] == "released"]
    assert [c["pin_outcome"] for c in calls] == ["unspecified"]
    # Dynamo's mark of a session's last request does the same.
    dynamo = {"X-Dynamo-Session-ID": "released-dynamo"}
    r = _chat(server, messages[:2], {"vllm_xargs": {"tool": "bash"}}, dynamo)
    assert int(server.metrics()["cachettl_pins_held"]) == 1
    _chat(server, messages, {}, {**dynamo, "X-Dynamo-Session-Final": "true"})
    _ended(server, {"released-dynamo"})
    assert closed() == before + 2
    assert int(server.metrics()["cachettl_pins_held"]) == 0


# -- vllm-router's agentic_context ---------------------------------------------------------


def test_vllm_routers_agentic_context_becomes_the_hooks_keys(app: TestClient) -> None:
    context = {"program_id": "prog-1", "parent_program_id": "root", "step_id": 2}
    session, seen = _seen(app, {"vllm_xargs": {"agentic_context": context, "tool": "bash"}})
    assert session is None
    assert seen["vllm_xargs"] == {
        "tool": "bash",
        "session_id": "prog-1",
        "parent_session_id": "root",
    }
    r = app.post(CHAT, json={"vllm_xargs": {"agentic_context": {"kv_retention_ttl_seconds": "x"}}})
    assert r.status_code == 400
    assert "vllm_xargs.agentic_context.kv_retention_ttl_seconds" in r.text


@pytest.mark.slow
def test_a_program_named_by_agentic_context_is_pinned_for_its_ttl(server: Server) -> None:
    program = "agentic-prog"
    messages = [
        {"role": "system", "content": _words(77, 40)},
        {"role": "user", "content": _words(78, 450)},
    ]
    context = {"program_id": program, "session_id": "router-session", "step_id": 1}
    first = {"tool": "bash", "tool_args": "ls", "agentic_context": context}
    first["agentic_context"] = {**context, "kv_retention_ttl_seconds": 6.5}
    r = _chat(server, messages, {"vllm_xargs": first})
    messages += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": _words(79, 30)},
    ]
    _chat(server, messages, {"vllm_xargs": {"agentic_context": context}}, last=True)
    events = _ended(server, {program})
    (call,) = [e for e in events if e["kind"] == "tool_call" and e["program_id"] == program]
    assert (call["chosen_ttl_s"], call["pin_outcome"]) == (6.5, "hit")
