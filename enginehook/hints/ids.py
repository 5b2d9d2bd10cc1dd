"""The engine's own check of a program id (a request's ``session_id``), whatever reached it.

The session middleware checks ids at the HTTP edge, but vLLM also parses bodies the
middleware cannot read (over its size limit) and takes requests from servers that run
without it; so the engine checks again, in ``add_request``, before an id can key a pin, a
program's order or an event. An id that fails is not used: the request runs as one
without a session (no pin, no program order), counted and logged once.

>>> session_id_problem("Zürich-会话-1") is None
True
>>> session_id_problem("x" * 300)
'longer than 256 characters (300)'
>>> session_id_problem("a\\x1bb")
"holds the control character '\\\\x1b'"
"""

from __future__ import annotations

from enginehook.hints.flat import control_character

__all__ = ["MAX_SESSION_ID", "session_id_problem"]

#: The longest program id taken (the control plane's program-id limit).
MAX_SESSION_ID = 256


def session_id_problem(value: str) -> str | None:
    """Why ``value`` cannot be a program id (``None``: it can): empty, over
    :data:`MAX_SESSION_ID` characters, a control character (C0, DEL, C1), or text that is
    not Unicode (a lone surrogate)."""
    if not value:
        return "empty"
    if len(value) > MAX_SESSION_ID:
        return f"longer than {MAX_SESSION_ID} characters ({len(value)})"
    bad = control_character(value)
    if bad is not None:
        return f"holds the control character {bad!r}"
    if any("\ud800" <= c <= "\udfff" for c in value):
        return "holds a lone surrogate (not Unicode text)"
    return None
