"""The parsers' bounds, without an engine: KV-hint envelopes (text and objects), flat
``vllm_xargs`` hints and the session middleware's body and headers. Every hostile value
is a ``HintError``/HTTP 400 naming its field with a short message, never a
``RecursionError``, ``OverflowError`` or a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from controlplane.kvhints import (
    MAX_DEPTH,
    MAX_TEXT_CHARS,
    RETENTION_ACTION,
    XARGS_KEY,
    HintError,
    loads_bounded,
    parse_kv_hints,
    quote,
)
from enginehook.hints.choice import MalformedRequestError, choose_session, read_headers
from enginehook.hints.flat import Hints, request_hints
from enginehook.hints.sessions import MAX_BODY_DEPTH, SessionIdMiddleware

CHAT = "/v1/chat/completions"


def _envelope(payload: Any) -> dict[str, Any]:
    action = {"action_id": "a", "action_type": RETENTION_ACTION, "action_version": "1"}
    return {"protocol_version": "1", "message_id": "m", "actions": [{**action, "payload": payload}]}


def _ttl_text(literal: str) -> str:
    return json.dumps(_envelope({"ttl_s": 0})).replace('"ttl_s": 0', f'"ttl_s": {literal}')


def _nested(depth: int) -> str:
    return json.dumps(_envelope({"x": 0})).replace("0", "[" * depth + "]" * depth, 1)


@pytest.mark.parametrize(
    ("text", "what"),
    [
        (_nested(100_000), f"must be at most {MAX_TEXT_CHARS} characters"),
        (_nested(5_000), f"must nest at most {MAX_DEPTH} deep"),
        (_nested(MAX_DEPTH - 3), f"must nest at most {MAX_DEPTH} deep"),
        (_ttl_text("9" * 400), "integer literal of 400 digits"),
        (_ttl_text("1e400"), "out of range"),
        (_ttl_text("NaN"), "NaN is not a JSON number"),
        (_ttl_text("-Infinity"), "-Infinity is not a JSON number"),
        (" " * MAX_TEXT_CHARS + "{}", f"must be at most {MAX_TEXT_CHARS} characters"),
        ("{not json", "must be a JSON object"),
    ],
)
def test_envelope_text_past_a_bound_is_a_hint_error(text: str, what: str) -> None:
    with pytest.raises(HintError, match=r"^kv_hints ") as caught:
        parse_kv_hints(text)
    assert what in str(caught.value)
    assert caught.value.field == "kv_hints"
    assert len(str(caught.value)) < 200


def test_envelope_text_within_the_bounds_parses() -> None:
    assert parse_kv_hints(_ttl_text("9" * 32)) is not None
    assert loads_bounded(_nested(MAX_DEPTH - 4), "kv_hints")["actions"][0]["payload"]["x"]
    # Brackets inside strings are no nesting.
    retention = parse_kv_hints(json.dumps(_envelope({"tool": "[" * 4000})))
    assert retention is not None
    assert retention.tool == "[" * 4000


@pytest.mark.parametrize(
    ("envelope", "what"),
    [
        (_envelope({"ttl_s": 10**400}), "kv_hints must hold integers of at most 32 digits"),
        (_envelope({"ttl_s": 10**40}), "must hold integers of at most 32 digits"),
        (_envelope({"ttl_s": float("inf")}), "must hold finite numbers only"),
        (_envelope({"x": json.loads("[" * 50 + "]" * 50)}), "must nest at most 16 deep"),
        (_envelope({"x": list(range(20_000))}), "must hold at most 16384 values"),
        (_envelope({"tool": "t" * 5_000_000}), "at most 4096 characters, got 5000000"),
    ],
)
def test_envelope_objects_past_a_bound_are_hint_errors(envelope: Any, what: str) -> None:
    with pytest.raises(HintError) as caught:
        parse_kv_hints(envelope)
    assert what in str(caught.value)
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"pin_ttl_s": 10**400}, "vllm_xargs.pin_ttl_s"),
        ({"pin_ttl_max_s": float("inf")}, "vllm_xargs.pin_ttl_max_s"),
        ({"pin_ttl_s": "1" * 1_000_000}, "vllm_xargs.pin_ttl_s"),
        ({"tool": "t" * 5_000_000}, "vllm_xargs.tool"),
        ({"last_turn": "maybe" * 1_000_000}, "vllm_xargs.last_turn"),
        ({"pin": list(range(100_000))}, "vllm_xargs.pin"),
        ({"parent_session_id": "p" * 257}, "vllm_xargs.parent_session_id"),
        ({"parent_session_id": "p\x9b"}, "vllm_xargs.parent_session_id"),
        ({XARGS_KEY: 5}, f"vllm_xargs.{XARGS_KEY}"),
        ({XARGS_KEY: _nested(100_000)}, "kv_hints"),
    ],
)
def test_flat_hints_past_a_bound_name_the_key(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(HintError) as caught:
        request_hints(extra)
    assert caught.value.field == field
    assert len(str(caught.value)) < 200


def test_printable_unicode_parent_ids_are_hints() -> None:
    assert Hints.from_extra_args({"parent_session_id": "会话-Zürich"}).parent_session_id


def test_quote_never_echoes_a_value_whole_nor_recurses() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    assert quote(deep) == "an array"
    assert len(quote("x" * 20_000_000)) < 80
    assert quote(10**5000).startswith("an integer of about")


async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"body": json.loads(body) if body else None})


@pytest.fixture(scope="module")
def app() -> TestClient:
    inner = Starlette(routes=[Route(CHAT, _echo, methods=["POST"])])
    return TestClient(SessionIdMiddleware(inner))


def _error(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, r.text[:300]
    assert len(r.text) < 2000
    return dict(r.json()["error"])


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"kv_hints": ' + "[" * 100_000 + "]" * 100_000 + "}", "body"),
        ('{"tools": ' + "[" * (MAX_BODY_DEPTH + 1) + "]" * (MAX_BODY_DEPTH + 1) + "}", "body"),
        ('{"kv_hints": ' + _ttl_text("9" * 400) + "}", "kv_hints"),
        ('{"kv_hints": ' + _ttl_text("1e400") + "}", "kv_hints"),
        (json.dumps({"vllm_xargs": {XARGS_KEY: _nested(100_000)}}), f"vllm_xargs.{XARGS_KEY}"),
        (json.dumps({"vllm_xargs": {XARGS_KEY: _ttl_text("9" * 400)}}), f"vllm_xargs.{XARGS_KEY}"),
        ('{"vllm_xargs": {"pin_ttl_s": ' + "9" * 400 + "}}", "vllm_xargs.pin_ttl_s"),
        (json.dumps({"vllm_xargs": {"tool": "t" * 5_000_000}}), "vllm_xargs.tool"),
    ],
)
def test_the_middleware_answers_a_hostile_body_with_a_400_naming_the_field(
    app: TestClient, body: str, field: str
) -> None:
    assert _error(app.post(CHAT, content=body))["param"] == field


def test_a_body_at_the_depth_bound_passes(app: TestClient) -> None:
    depth = MAX_BODY_DEPTH - 1
    r = app.post(CHAT, content='{"tools": ' + "[" * depth + "]" * depth + "}")
    assert r.status_code == 200


@pytest.mark.parametrize(
    "name", ["X-Session-ID", "X-Dynamo-Session-ID", "Session-Id", "X-Parent-Session-ID"]
)
def test_a_session_header_sent_twice_is_a_400_naming_it(app: TestClient, name: str) -> None:
    headers = [(name.encode(), b"first"), (name.lower().encode(), b"second")]
    r = app.post(CHAT, content="{}", headers=headers)
    assert _error(r)["param"] == name.lower()
    assert "at most once, got 2" in r.json()["error"]["message"]


def test_printable_unicode_ids_pass_and_reach_vllm_as_sent(app: TestClient) -> None:
    value = "Zürich-会话-€".encode()
    r = app.post(CHAT, content="{}", headers=[(b"x-dynamo-session-id", value)])
    assert r.status_code == 200
    r = app.post(CHAT, content='{"session_id": "セッション"}')
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (b"a\x7fb", "control characters"),
        ("a\u0085b".encode(), "control characters"),
        ("é".encode() * 129, "at most 256 bytes of UTF-8, got 258"),
    ],
)
def test_a_bad_header_id_is_a_400_saying_what(app: TestClient, value: bytes, what: str) -> None:
    r = app.post(CHAT, content="{}", headers=[(b"x-dynamo-session-id", value)])
    assert _error(r)["param"] == "x-dynamo-session-id"
    assert what in r.json()["error"]["message"]


def test_a_header_id_that_is_not_utf8_is_refused() -> None:
    headers = read_headers([(b"X-Dynamo-Session-ID", b"a\xff")])
    with pytest.raises(MalformedRequestError, match="x-dynamo-session-id must be UTF-8 text"):
        choose_session(headers, {})


def test_a_body_over_the_bound_still_has_its_vllm_header_checked() -> None:
    inner = Starlette(routes=[Route(CHAT, _echo, methods=["POST"])])
    small = TestClient(SessionIdMiddleware(inner, max_body_bytes=10))
    r = small.post(CHAT, content='{"model": "m"}', headers={"x-session-id": "h" * 300})
    assert _error(r)["param"] == "x-session-id"
    r = small.post(CHAT, content='{"model": "m"}', headers={"x-session-id": "fine"})
    assert r.status_code == 200
