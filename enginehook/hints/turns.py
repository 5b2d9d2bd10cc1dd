"""A program's turn index, counted from what the client sends, so that a program that moves
between engines is counted whole.

Each engine counts the turns it served itself; behind a router that moves a program, no
engine saw all of them. A chat body says how far its program is: every earlier turn's
answer is in it as an ``assistant`` message. The session middleware
(:mod:`enginehook.hints.sessions`) writes that count into ``vllm_xargs`` under
:data:`TURN_KEY` (the turn's index, 0-based: the turns finished before it), and the engine
counts the program's turns from at least there
(:meth:`enginehook.core.lifecycle.PinController.arrived`, ``turns``): its tool calls'
``turn_index`` and its end's ``total_turns`` count the turns served anywhere.

Which bodies: ``/v1/chat/completions`` and ``/v1/messages`` (``messages``, roles as OpenAI
and Anthropic name them). ``/v1/completions`` and ``/v1/responses`` carry no history the
middleware can count (a prompt's text; a ``previous_response_id``), so there each engine
counts the turns it served since the program last arrived there, unless the client sends
:data:`TURN_KEY` itself. A client's own value is checked (an integer in
``0..``:data:`MAX_TURN_INDEX`; else HTTP 400 naming ``vllm_xargs.turn_index``) and the
larger of it and the count is kept.

>>> body = {"messages": [{"role": "user"}, {"role": "assistant"}, {"role": "tool"},
...                      {"role": "assistant"}, {"role": "user"}]}
>>> carry_turn_index(body, "/v1/chat/completions"), body["vllm_xargs"]
(True, {'turn_index': 2})
>>> turn_hint(body["vllm_xargs"]), turn_hint({"turn_index": "x"}), turn_hint(None)
(2, None, None)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.kvhints import quote
from controlplane.records import LIMITS
from enginehook.hints.choice import MalformedRequestError

__all__ = ["COUNTED_PATHS", "MAX_TURN_INDEX", "TURN_KEY", "carry_turn_index", "turn_hint"]

#: The ``vllm_xargs`` key of a request's turn index (the turns its program finished before).
TURN_KEY = "turn_index"
#: The largest turn index taken (a program's ``total_turns`` is at most one more).
MAX_TURN_INDEX = LIMITS.total_turns - 1
#: The paths whose bodies carry the conversation as ``messages``.
COUNTED_PATHS = frozenset({"/v1/chat/completions", "/v1/messages"})


def _index(value: Any) -> int | None:
    """``value`` as a turn index, or ``None`` when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit() and len(value) <= 12:
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_TURN_INDEX:
        return value
    return None


def turn_hint(extra: Mapping[str, Any] | None) -> int | None:
    """The turn index a request's ``vllm_xargs`` carries (``None``: none, or not a valid
    one: the engine then counts on its own)."""
    if not extra:
        return None
    return _index(extra.get(TURN_KEY))


def answers(body: Mapping[str, Any]) -> int:
    """The ``assistant`` messages of a body's ``messages`` (0 when it has none)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(1 for m in messages if isinstance(m, Mapping) and m.get("role") == "assistant")


def carry_turn_index(body: dict[str, Any], path: str) -> bool:
    """Write the body's turn index into its ``vllm_xargs`` (in place; the larger of the
    client's own and the count of its answers); ``True`` when the body changed. Raises
    :class:`MalformedRequestError` for a client's value that is no turn index."""
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        return False  # vLLM answers for its own field
    given = (xargs or {}).get(TURN_KEY)
    if given is not None and _index(given) is None:
        where = f"vllm_xargs.{TURN_KEY}"
        message = f"must be an integer in 0..{MAX_TURN_INDEX}, got {quote(given)}"
        raise MalformedRequestError(where, message)
    counted = min(answers(body), MAX_TURN_INDEX) if path in COUNTED_PATHS else 0
    index = max(counted, _index(given) or 0)
    if index == 0 or given == index:
        return False
    body["vllm_xargs"] = {**(xargs or {}), TURN_KEY: index}
    return True
