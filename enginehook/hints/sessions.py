"""Session ids as agent stacks send them, and KV-hint envelopes in HTTP bodies, for vLLM's
OpenAI server: ``vllm serve ... --middleware enginehook.sessions.SessionIdMiddleware``.

Which id wins, its limits and sub-agents' programs: :mod:`enginehook.hints.choice`.

A body's ``kv_hints`` (a ``KvHintsEnvelope`` as a JSON object, SGLang's and Dynamo's
field) is checked (:func:`controlplane.kvhints.parse_kv_hints`; HTTP 400 with the field path
when malformed) and moved into ``vllm_xargs`` under :data:`controlplane.kvhints.XARGS_KEY`
as JSON text, which vLLM 0.32 carries to the engine (``vllm_xargs`` values may be
strings) while it does not carry ``kv_hints``. An envelope already given as that key's
text is checked the same way; given both, the body's ``kv_hints`` wins.

vllm-router's program identity, ``vllm_xargs.agentic_context`` (an object vLLM itself
refuses), is taken out before vLLM validates the body and translated into the flat keys the
hook reads (:mod:`enginehook.hints.agentic`: the program as ``vllm_xargs.session_id``, its
parent, ``kv_retention_ttl_seconds`` as ``pin_ttl_s``); a malformed one is HTTP 400 naming
the key.

Every answer to a request the middleware reads names the engine that gave it in the
``X-CacheTTL-Engine`` header (``$CACHETTL_ENGINE_NAME``, else the server's ``host:port``), so
that a client behind a router sees where each turn ran; a non-streaming JSON reply also says
what the engine pinned (:mod:`enginehook.hints.replies`: ``X-CacheTTL-Pinned`` and the pin's
TTL, expiry and tokens).

A request that ends its session (a ``last_turn`` or ``release`` hint, flat or in its
envelope, or the Dynamo header below) is reported, once answered, to the routers named in
``$CACHETTL_ROUTER_URLS`` (vllm-router's ``/finish_session``), so that a finished session
stops counting as a router's load (:mod:`enginehook.hints.routers`).

``X-Dynamo-Session-Final: true`` (Dynamo's mark of a session's last request, sent so that
per-session state can be released at once) becomes the flat ``release`` hint in
``vllm_xargs``: the session's pin goes when the request arrives (an envelope's ``release``
still wins over it, as over every flat hint).

``vllm_xargs``' flat hint keys are checked as the engine reads them (a bad value is HTTP
400 naming ``vllm_xargs.<key>``); a session's turn index is added (:mod:`.turns`).

Only ``POST`` to :data:`PATHS` is looked at. A body is decoded as vLLM decodes it (JSON's
encoding detection: UTF-8 with or without a BOM, UTF-16, UTF-32), so an id in such a body
is checked like any other; the engine checks ids again itself
(:mod:`enginehook.hints.ids`), for bodies the middleware does not read.

Finding a worker's hook: every answer to a request the middleware reads carries
``X-CacheTTL-Hook`` (:data:`HOOK_HEADER`) naming the hook's endpoint, and ``GET``
:data:`DISCOVERY_PATH` on the API port answers it as JSON (:func:`hook_endpoint`: the
endpoint, its ``/metrics`` and pin-command URLs, whether it is TLS and whether pin
commands need a token), from the engine's own ``--additional-config``. A body nested deeper than
:data:`MAX_BODY_DEPTH` is HTTP 400 naming ``body`` (checked by a linear scan before it is
parsed). A body over ``max_body_bytes`` (default 32 MiB) or one that is not a JSON object
passes through with only its headers checked (duplicates, and the ``X-Session-ID`` vLLM
reads itself: length, control characters); every other request passes through
untouched. Error messages quote at most a short prefix of a value. Unit-testable without
vLLM (plain ASGI).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from controlplane.kvhints import XARGS_KEY, HintError, parse_kv_hints, quote, within_depth
from enginehook.hints import agentic
from enginehook.hints.choice import (
    PATHS,
    MalformedRequestError,
    check_id,
    choose_session,
    parent_session,
    read_headers,
    session_final,
)
from enginehook.hints.flat import Hints, request_hints
from enginehook.hints.replies import pin_headers_send
from enginehook.hints.routers import RouterNotifier
from enginehook.hints.turns import carry_turn_index

__all__ = [
    "DISCOVERY_PATH",
    "ENGINE_HEADER",
    "HOOK_HEADER",
    "MAX_BODY_DEPTH",
    "SessionIdMiddleware",
    "carry_kv_hints",
    "ended_session",
    "hook_endpoint",
]

logger = logging.getLogger("enginehook")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The response header naming the engine that answered (``$CACHETTL_ENGINE_NAME``, else the
#: server's ``host:port``): a client or router behind a load balancer sees where a turn ran.
ENGINE_HEADER = b"x-cachettl-engine"
ENGINE_ENV = "CACHETTL_ENGINE_NAME"
#: The response header naming this worker's hook endpoint (``http(s)://host:port``), and
#: the path on the API port that answers where it is (:func:`hook_endpoint`).
HOOK_HEADER = b"x-cachettl-hook"
DISCOVERY_PATH = "/.well-known/cachettl"
_MAX_BODY = 32 * 1024 * 1024
#: ``_rewrite``'s answer for "drop the request's X-Session-ID, add none".
_DROP = b""
#: The deepest nesting of objects and arrays accepted in a body (tool schemas included).
MAX_BODY_DEPTH = 128


def carry_kv_hints(body: dict[str, Any]) -> bool:
    """Check the body's envelope and move it into ``vllm_xargs`` (in place); ``True`` when
    the body changed. Raises :class:`MalformedRequestError` naming the field path."""
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        if "kv_hints" not in body:
            return False  # vLLM answers for its own field
        raise MalformedRequestError("vllm_xargs", "must be an object to carry kv_hints")
    if xargs:
        _checked_flat(xargs)
    carried = (xargs or {}).get(XARGS_KEY)
    if "kv_hints" not in body:
        if carried is not None:
            _checked_envelope(carried, f"vllm_xargs.{XARGS_KEY}")
        return False
    envelope = body.pop("kv_hints")
    if envelope is None:
        return True
    _checked_envelope(envelope, "kv_hints")
    xargs = body["vllm_xargs"] = dict(xargs or {})
    xargs[XARGS_KEY] = json.dumps(envelope, separators=(",", ":"))
    return True


def _checked_flat(xargs: Mapping[str, Any]) -> None:
    """The flat hint keys of ``vllm_xargs``, checked as the engine will read them."""
    try:
        Hints.from_extra_args(xargs)
    except HintError as exc:
        raise MalformedRequestError(exc.field, str(exc)) from None


def _checked_envelope(envelope: Any, where: str) -> None:
    if where == "kv_hints" and not isinstance(envelope, Mapping):
        raise MalformedRequestError(where, f"must be an object, got {quote(envelope)}")
    try:
        parse_kv_hints(envelope, where)
    except HintError as exc:
        raise MalformedRequestError(where, str(exc)) from None


class SessionIdMiddleware:
    """ASGI middleware: session ids from agent stacks' headers and fields, KV-hint
    envelopes from bodies (see the module docstring)."""

    def __init__(
        self, app: App, max_body_bytes: int = _MAX_BODY, routers: RouterNotifier | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.routers = routers if routers is not None else RouterNotifier()
        self.engine = os.environ.get(ENGINE_ENV, "").strip().encode("ascii", "replace")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http" and scope.get("path") == DISCOVERY_PATH:
            await _json_answer(send, 200, hook_endpoint(scope))
            return
        looks = self._looks_at(scope)
        if looks is None:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        changed, header = False, None
        try:
            headers = read_headers(scope["headers"])
            raw = None
            if looks:  # else over the body limit: only the header vLLM reads is checked
                messages, raw = await self._read(receive)
            body = _json_object(raw)
            if body is None:
                _vllms_header(headers)
            else:
                changed, header = _rewrite(headers, body, scope["path"])
        except MalformedRequestError as exc:
            await _bad_request(send, exc)
            return
        send = _naming_engine(send, self.engine or _server(scope), _hook_header(scope))
        send = pin_headers_send(send, self.max_body_bytes)
        if body is None or not (changed or header is not None):
            await self.app(scope, _replay(messages, receive), send)
        else:
            if changed or raw is None:
                raw = json.dumps(body).encode()
            scope = dict(scope)
            scope["headers"] = _headers(scope["headers"], len(raw), header)
            await self.app(scope, _replay([_body_message(raw)], receive), send)
        if body is not None and self.routers.urls:
            ended = ended_session(headers, body, scope["path"])
            if ended is not None:
                self.routers.finish(ended)

    def _looks_at(self, scope: Scope) -> bool | None:
        """``None``: not a request the middleware reads; ``False``: one whose body is over
        the limit (its headers are still checked); ``True``: read it."""
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return None
        if scope.get("path") not in PATHS:
            return None
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length":
                try:
                    return int(value) <= self.max_body_bytes
                except ValueError:
                    return False
        return True

    async def _read(self, receive: Receive) -> tuple[list[Message], bytes | None]:
        """The request's messages as received, and its whole body (``None``: over the
        limit or the client left; the messages are then replayed untouched)."""
        messages: list[Message] = []
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request":
                return messages, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                logger.debug("session ids: body over %d bytes passes untouched", size)
                return messages, None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return messages, b"".join(chunks)


def _rewrite(
    headers: Mapping[str, str], body: dict[str, Any], path: str
) -> tuple[bool, bytes | None]:
    """Check the request and edit ``body`` in place for vLLM: whether the body changed,
    and the ``X-Session-ID`` to send in place of the request's (``None``: keep it).
    Raises :class:`MalformedRequestError` naming the header or field."""
    changed = _agentic(body)
    changed = carry_kv_hints(body) or changed
    choice = choose_session(headers, body, path)
    final = session_final(headers)
    parent = parent_session(headers, choice)
    changed = (choice is not None and carry_turn_index(body, path)) or changed
    header = None
    if choice is not None and choice.header and not choice.session_id.isascii():
        # vLLM reads header bytes as Latin-1: the engine would key "ZÃ¼rich" for "Zürich"
        # and a router's drop by the real id would find no pin. The body carries it as text.
        if PATHS.get(path, True):
            body["session_id"], changed = choice.session_id, True
        else:
            changed = _set_xargs(body, "session_id", choice.session_id) or changed
        header = _DROP
    elif choice is not None and not choice.vllm_reads:
        if choice.source == "session_id" and not choice.header:  # vLLM's own, qualified
            body["session_id"], changed = choice.session_id, True
        elif choice.header:
            header = choice.session_id.encode("utf-8", "surrogateescape")  # as received
        else:
            changed = _set_xargs(body, "session_id", choice.session_id) or changed
    if final:
        changed = _set_xargs(body, "release", True) or changed
    if parent is not None:
        changed = _set_xargs(body, "parent_session_id", parent) or changed
    return changed, header


def _server(scope: Scope) -> bytes:
    host, port = scope.get("server") or ("", None)
    return f"{host}:{port}".encode("ascii", "replace") if port is not None else b""


def _naming_engine(send: Send, engine: bytes, hook: bytes = b"") -> Send:
    """``send`` that adds :data:`ENGINE_HEADER` (and :data:`HOOK_HEADER`, given ``hook``)
    to the response's headers."""
    added = [(ENGINE_HEADER, engine)] if engine else []
    if hook:
        added.append((HOOK_HEADER, hook))
    if not added:
        return send

    async def named(message: Message) -> None:
        if message.get("type") == "http.response.start":
            message = dict(message)
            message["headers"] = [*message.get("headers", ()), *added]
        await send(message)

    return named


def hook_endpoint(scope: Scope) -> dict[str, Any]:
    """Where this worker's hook serves ``/metrics`` and pin commands, read from the
    engine's ``--additional-config`` (vLLM keeps it in ``app.state.vllm_config``): the
    answer to ``GET`` :data:`DISCOVERY_PATH`. A wildcard listen address (``0.0.0.0``,
    ``::``) is named by the host the caller reached this server at."""
    app = scope.get("app")
    vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
    if vllm_config is None:
        return {"hook_endpoint": None, "detail": "not a vLLM server with its config"}
    try:
        raw = (getattr(vllm_config, "additional_config", None) or {}).get("cachettl") or {}
        listen = str(raw.get("metrics_listen") or "")
        tls = bool(raw.get("endpoint_tls_cert_file"))
        token = bool(raw.get("pin_command_token") or raw.get("pin_command_token_file"))
    except Exception as exc:  # a config vLLM took is the engine's to refuse
        return {"hook_endpoint": None, "detail": f"unreadable config: {type(exc).__name__}"}
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or port == "0":
        why = "metrics_listen is not set" if not listen else f"metrics_listen {listen!r}"
        return {"hook_endpoint": None, "detail": f"{why}: no fixed endpoint to name"}
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        reached = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        host = reached.rpartition(":")[0] if ":" in reached else reached
        host = host or (scope.get("server") or ("127.0.0.1",))[0]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    return {
        "hook_endpoint": url,
        "metrics": f"{url}/metrics",
        "pin_commands": f"{url}/cachettl/pins/",
        "tls": tls,
        "pin_command_token": token,
    }


def _hook_header(scope: Scope) -> bytes:
    url = hook_endpoint(scope).get("hook_endpoint")
    return url.encode("ascii", "replace") if url else b""


async def _json_answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def ended_session(headers: Mapping[str, str], body: Mapping[str, Any], path: str) -> str | None:
    """The session a checked, rewritten request ends (a ``last_turn`` or ``release`` hint,
    flat or in its envelope), or ``None``: the one the routers are told of."""
    xargs = body.get("vllm_xargs")
    hints = request_hints(xargs if isinstance(xargs, Mapping) else None)
    if not (hints.last_turn or hints.release):
        return None
    choice = choose_session(headers, body, path)
    return None if choice is None else choice.session_id


def _agentic(body: dict[str, Any]) -> bool:
    """vllm-router's ``vllm_xargs.agentic_context`` taken out and translated
    (:mod:`enginehook.hints.agentic`); ``True`` when the body had one."""
    try:
        return agentic.translate(body) is not None
    except HintError as exc:
        raise MalformedRequestError(exc.field, str(exc)) from None


def _vllms_header(headers: Mapping[str, str]) -> None:
    """Check the ``X-Session-ID`` vLLM reads itself, on a body the middleware passes on."""
    if value := headers.get("x-session-id"):
        check_id("x-session-id", value, header=True)


def _json_object(raw: bytes | None) -> dict[str, Any] | None:
    """The body as a JSON object (``None``: not one; vLLM answers for it). Raises
    :class:`MalformedRequestError` naming ``body`` when it nests deeper than
    :data:`MAX_BODY_DEPTH`, checked before any recursive parse."""
    if not raw:
        return None
    try:  # as vLLM reads it (json.loads on bytes): a BOM, UTF-16 or UTF-32 is decoded too
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except (UnicodeDecodeError, LookupError):
        return None
    text = text.removeprefix("\ufeff")
    if not within_depth(text, MAX_BODY_DEPTH):
        raise MalformedRequestError("body", f"must nest at most {MAX_BODY_DEPTH} deep")
    try:
        body = json.loads(text)
    except ValueError:
        return None  # vLLM answers for a body it cannot parse
    return body if isinstance(body, dict) else None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def _body_message(raw: bytes) -> Message:
    return {"type": "http.request", "body": raw, "more_body": False}


def _set_xargs(body: dict[str, Any], key: str, value: Any) -> bool:
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        return False  # vLLM answers for its own field
    body["vllm_xargs"] = {**(xargs or {}), key: value}
    return True


def _headers(
    headers: list[tuple[bytes, bytes]], length: int, session: bytes | None
) -> list[tuple[bytes, bytes]]:
    """The headers with the body's new length and, given ``session``, that X-Session-ID
    (the request's own, if any, dropped; :data:`_DROP`: dropped only)."""
    drop = {b"content-length", b"transfer-encoding"}
    if session is not None:
        drop.add(b"x-session-id")
    out = [(k, v) for k, v in headers if k.lower() not in drop]
    out.append((b"content-length", str(length).encode()))
    if session:
        out.append((b"x-session-id", session))
    return out


async def _bad_request(send: Send, exc: MalformedRequestError) -> None:
    """HTTP 400 in the OpenAI error shape vLLM uses (``error.message`` names the field)."""
    error = {"message": str(exc), "type": "BadRequestError", "param": exc.field, "code": 400}
    payload = json.dumps({"error": error}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
