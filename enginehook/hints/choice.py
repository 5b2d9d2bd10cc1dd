"""Which session id a request carries: the sources agent stacks use, in precedence order,
the limits an id obeys, and sub-agents' programs. The ASGI middleware that applies it is
:mod:`enginehook.hints.sessions`.

The hook takes a request's program id from vLLM's ``Request.session_id``, which vLLM
resolves itself from the body's ``session_id``, then the ``X-Session-ID`` header, then
``vllm_xargs.session_id``. Agent stacks name it otherwise; the middleware recognises, in
this order (:data:`SOURCES`), the first one present winning:

1. body ``session_id`` (vLLM's own; chat, completions, responses);
2. header ``X-Session-ID`` (vLLM's own; also what OpenCode sends);
3. body ``vllm_xargs.session_id`` (vLLM's own);
4. header ``X-Dynamo-Session-ID`` (NVIDIA Dynamo's canonical session header);
5. header ``X-Claude-Code-Session-Id`` (Claude Code; llm-d's ``agent-identity`` plugin has
   no header of its own, it reads the agents' native ones such as this);
6. header ``Session-Id`` (the Codex CLI on the Responses API, and pi);
7. header ``session_id`` (older Codex CLIs; proxies such as nginx drop header names with
   underscores unless told otherwise);
8. body ``prompt_cache_key`` (OpenAI's): last, because it is a cache key that several
   sessions may share on purpose (one key per prompt template), so it is only a fallback.

vLLM's own three come first so that the middleware never changes what vLLM would decide
(but for the sub-agent qualifier below); then the headers a router or an agent sets for
session identity; the cache key last. When the winner is not one of vLLM's own, the
middleware hands it to vLLM unchanged: a header's bytes as ``X-Session-ID``,
``prompt_cache_key`` as ``vllm_xargs.session_id`` (a JSON string, so any text survives).
The winning id must be 1..256 characters without control characters (the control plane's
program-id limit; printable text in any script is accepted, only Unicode control
characters, category ``Cc``, are refused); otherwise the answer is HTTP 400 naming the
header or field. A header's id is counted in bytes (vLLM reads header bytes as Latin-1, one
character a byte) and must be UTF-8; a winning header id that is not ASCII reaches vLLM in
the body instead (``session_id``, or ``vllm_xargs.session_id`` where vLLM reads no body
``session_id``; the request's ``X-Session-ID`` dropped), so the engine keys the id as
sent and not vLLM's Latin-1 reading of its bytes (a router's drop by the real id finds
the pin). Ids that do not win are not looked at, but every
header the middleware reads (:data:`SOURCES`' headers, :data:`AGENT_HEADERS`,
:data:`PARENT_HEADER`, :data:`FINAL_HEADER`) must come at most once: vLLM reads the first
of two ``X-Session-ID`` headers, so two of any is HTTP 400 naming the header.

Sub-agents (:data:`AGENT_HEADERS`): Claude Code sends its sub-agents' requests (the Agent
or Task tool) with the parent's ``X-Claude-Code-Session-Id`` and the sub-agent's own
``X-Claude-Code-Agent-Id``. Each is its own conversation over its own prefix, so when the
winning id is that session's, the program is ``<session id>/<agent id>``: the parent and
each sub-agent get their own pin, their own turns and their own tool-call durations (the
parent's Agent call lasts as long as the sub-agent's whole run). Under one program, every
sub-agent's turn would replace the pin its siblings and parent are about to return to.
The qualified id is handed to vLLM where it reads first (the body's ``session_id`` or
``vllm_xargs.session_id`` when one of those won, else ``X-Session-ID``) and obeys the same
limits (HTTP 400 naming the agent header). The session's own id goes along as
``vllm_xargs.parent_session_id``: the sub-agent is scheduled as part of its parent (its
place in the program order and its attained service; the parent waits on it), where it
would otherwise queue as a new program. Sub-agents that run in a session of their own
name their parent in ``X-Parent-Session-ID`` (:data:`PARENT_HEADER`; agent gateways and
OpenCode plugins send it); it becomes the same hint, checked like a session id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.kvhints import quote
from enginehook.hints.flat import control_character
from enginehook.hints.ids import MAX_SESSION_ID

__all__ = [
    "AGENT_HEADERS",
    "FINAL_HEADER",
    "PARENT_HEADER",
    "PATHS",
    "READ_HEADERS",
    "SOURCES",
    "MalformedRequestError",
    "SessionChoice",
    "check_id",
    "choose_session",
    "parent_session",
    "read_headers",
    "session_final",
]

#: Endpoints whose body is read, and whether vLLM reads a body ``session_id`` there.
PATHS = {
    "/v1/chat/completions": True,
    "/v1/completions": True,
    "/v1/responses": True,
    "/v1/messages": False,
}
#: The session-id sources in precedence order: ``(kind, name, vLLM's own)``.
SOURCES = (
    ("body", "session_id", True),
    ("header", "x-session-id", True),
    ("body", "vllm_xargs.session_id", True),
    ("header", "x-dynamo-session-id", False),
    ("header", "x-claude-code-session-id", False),
    ("header", "session-id", False),
    ("header", "session_id", False),
    ("body", "prompt_cache_key", False),
)
#: ``(sub-agent header, the session header it qualifies)``: a request carrying both, whose
#: winning session id is that session header's, belongs to program ``<session>/<agent>``.
AGENT_HEADERS = (("x-claude-code-agent-id", "x-claude-code-session-id"),)
#: The header naming the session a sub-agent's own session works for.
PARENT_HEADER = "x-parent-session-id"
#: Dynamo's header for a session's last request.
FINAL_HEADER = "x-dynamo-session-final"
#: Names that are both a header source and a body field: errors say "header <name>".
_AMBIGUOUS = {n for k, n, _ in SOURCES if k == "header"} & {n for k, n, _ in SOURCES if k == "body"}
#: Every header the middleware reads: each may come at most once.
READ_HEADERS = frozenset(
    [n for k, n, _ in SOURCES if k == "header"]
    + [h for pair in AGENT_HEADERS for h in pair]
    + [PARENT_HEADER, FINAL_HEADER]
)


class MalformedRequestError(ValueError):
    """A request the middleware refuses (HTTP 400); ``field`` names the header or field."""

    def __init__(self, field: str, message: str) -> None:
        """``message``: what is wrong (prefixed with ``field`` unless it names it first)."""
        super().__init__(message if message.startswith(field) else f"{field} {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class SessionChoice:
    """The winning session id (qualified by a sub-agent's id when ``agent`` names the
    header that gave it), where it came from (a header or a body field), and whether vLLM
    reads it itself."""

    session_id: str
    source: str
    vllm_reads: bool
    header: bool
    agent: str | None = None


def check_id(source: str, value: str, header: bool = False) -> str:
    """``value`` if it is a valid session id (a header's: its UTF-8 text, counted in
    bytes, as vLLM reads one character a byte); else :class:`MalformedRequestError`."""
    size = len(value.encode("utf-8", "surrogateescape")) if header else len(value)
    if size > MAX_SESSION_ID:
        unit = "characters" if value.isascii() or not header else "bytes of UTF-8"
        raise MalformedRequestError(source, f"must be at most {MAX_SESSION_ID} {unit}, got {size}")
    if header and any("\udc80" <= c <= "\udcff" for c in value):
        raise MalformedRequestError(source, "must be UTF-8 text")
    if any("\ud800" <= c <= "\udfff" for c in value):
        raise MalformedRequestError(source, "must be Unicode text (it holds a lone surrogate)")
    bad = control_character(value)
    if bad is not None:
        raise MalformedRequestError(source, f"must not contain control characters, got {bad!r}")
    return value


def read_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers by lower-case name, values decoded as UTF-8 (bytes that are
    not UTF-8 kept as surrogates, so the id's bytes can be handed on as received). Raises
    :class:`MalformedRequestError` when a header the middleware reads comes twice.

    >>> read_headers([(b"X-Session-ID", "Zürich-1".encode())])
    {'x-session-id': 'Zürich-1'}
    >>> read_headers([(b"X-Session-ID", b"a"), (b"x-session-id", b"b")])
    Traceback (most recent call last):
    ...
    enginehook...MalformedRequestError: x-session-id must be sent at most once, got 2
    """
    headers: dict[str, str] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name in headers and name in READ_HEADERS:
            count = sum(k.decode("latin-1").lower() == name for k, _ in raw)
            raise MalformedRequestError(name, f"must be sent at most once, got {count}")
        headers[name] = value.decode("utf-8", "surrogateescape")
    return headers


def _body_value(body: Mapping[str, Any] | None, name: str) -> Any:
    value: Any = body
    for part in name.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def choose_session(
    headers: Mapping[str, str], body: Mapping[str, Any] | None, path: str = "/v1/chat/completions"
) -> SessionChoice | None:
    """The first session id present among :data:`SOURCES` (``headers``: lower-case names;
    ``body``: the parsed JSON body, ``None`` if not read), checked; ``None`` when there is
    none. Raises :class:`MalformedRequestError` naming the source of a malformed winner.

    >>> choice = choose_session({"x-dynamo-session-id": "run-1"}, {"prompt_cache_key": "k"})
    >>> choice.session_id, choice.source, choice.vllm_reads, choice.header
    ('run-1', 'x-dynamo-session-id', False, True)
    >>> choose_session({"x-session-id": "a" * 300}, None)
    Traceback (most recent call last):
    ...
    enginehook...MalformedRequestError: x-session-id must be at most 256 characters, got 300
    >>> sub = {"x-claude-code-session-id": "run-1", "x-claude-code-agent-id": "explore-2"}
    >>> choose_session(sub, {}).session_id
    'run-1/explore-2'
    """
    for kind, name, own in SOURCES:
        if kind == "header":
            value: Any = headers.get(name)
        elif name == "session_id" and not PATHS.get(path, True):
            continue  # vLLM reads no body session_id there
        else:
            value = _body_value(body, name)
        if isinstance(value, str) and value:
            header = kind == "header"
            checked = check_id(_where(kind, name), value, header)
            return _qualified(SessionChoice(checked, name, own, header), headers)
    return None


def _where(kind: str, name: str) -> str:
    """How an error names a source (``header session_id`` is not the body's field)."""
    return f"header {name}" if kind == "header" and name in _AMBIGUOUS else name


def _qualified(choice: SessionChoice, headers: Mapping[str, str]) -> SessionChoice:
    """``choice`` as a sub-agent's program when a sub-agent header qualifies its session."""
    for agent_header, session_header in AGENT_HEADERS:
        agent = headers.get(agent_header)
        if agent and headers.get(session_header) == choice.session_id:
            check_id(agent_header, agent, header=True)
            qualified = f"{choice.session_id}/{agent}"
            if len(qualified.encode("utf-8", "surrogateescape")) > MAX_SESSION_ID:
                limit = f"makes the program id {len(qualified)} characters, over {MAX_SESSION_ID}"
                raise MalformedRequestError(agent_header, limit)
            return SessionChoice(qualified, choice.source, False, choice.header, agent_header)
    return choice


def parent_session(headers: Mapping[str, str], choice: SessionChoice | None) -> str | None:
    """The program the chosen session works for: a qualified sub-agent's own session, else
    :data:`PARENT_HEADER` when it names another session (``None``: none, or no session).

    >>> sub = {"x-claude-code-session-id": "run-1", "x-claude-code-agent-id": "explore-2"}
    >>> parent_session(sub, choose_session(sub, {}))
    'run-1'
    >>> child = {"x-session-id": "child-7", "x-parent-session-id": "run-1"}
    >>> parent_session(child, choose_session(child, {}))
    'run-1'
    """
    if choice is None:
        return None
    if choice.agent is not None:
        return headers[dict(AGENT_HEADERS)[choice.agent]]
    parent = headers.get(PARENT_HEADER)
    if not parent or parent == choice.session_id:
        return None
    return check_id(PARENT_HEADER, parent, header=True)


def session_final(headers: Mapping[str, str]) -> bool:
    """Whether ``X-Dynamo-Session-Final`` marks this request as its session's last (then
    it carries the flat ``release`` hint: the session closes when the request arrives).
    Raises :class:`MalformedRequestError` for a value other than true/false/1/0."""
    value = headers.get(FINAL_HEADER, "").strip().lower()
    if value not in ("", "true", "false", "1", "0"):
        raise MalformedRequestError(FINAL_HEADER, f"must be true or false, got {quote(value)}")
    return value in ("true", "1")
