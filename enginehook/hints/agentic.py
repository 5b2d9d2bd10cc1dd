"""vllm-router's program contract: ``vllm_xargs.agentic_context``, translated for vLLM.

vllm-router (0.1.17, ``--enable-program-scheduling``) names a request's program in the body
field ``vllm_xargs.agentic_context``, an object (its ``docs/program_scheduling.md``)::

    {"session_id": "...", "program_id": "...", "parent_program_id": "...",
     "root_program_id": "...", "task_id": "...", "step_id": ..., "priority": ...,
     "deadline_seconds": ..., "expected_output_length": ..., "blocks_parent": ...,
     "expected_resume": ..., "kv_retention_ttl_seconds": ...}

vLLM refuses such a body (HTTP 400: ``vllm_xargs`` values must be strings or numbers), so
the session middleware takes the object out before vLLM validates the request
(:func:`translate`) and hands on what the hook uses, as the flat keys it reads:

- the program: ``program_id`` (else ``session_id``) becomes ``vllm_xargs.session_id``
  unless the request names its session itself (the body's ``session_id`` or
  ``vllm_xargs.session_id``; an ``X-Session-ID`` header still wins inside vLLM, as always);
- ``parent_program_id`` becomes ``parent_session_id`` (a sub-agent is scheduled as part of
  its parent), unless a header already set it;
- ``kv_retention_ttl_seconds`` becomes ``pin_ttl_s``, the client's TTL, unless the request
  set that key itself; the engine's TTL cap still applies on top.

Every other key is checked (a string of at most 256 characters, a finite number, a bool or
null) and dropped: the router keeps its own scheduling state. A malformed context is HTTP 400
naming ``vllm_xargs.agentic_context.<key>``; the object may hold at most
:data:`MAX_KEYS` keys. Given as JSON text instead of an object, it is parsed within the
envelope's bounds (:func:`controlplane.kvhints.loads_bounded`).

>>> body = {"vllm_xargs": {"agentic_context": {"program_id": "swe-7",
...         "parent_program_id": "swe", "kv_retention_ttl_seconds": 7.5, "step_id": 3}}}
>>> translate(body).program_id
'swe-7'
>>> body
{'vllm_xargs': {'session_id': 'swe-7', 'parent_session_id': 'swe', 'pin_ttl_s': 7.5}}
>>> translate({"vllm_xargs": {"agentic_context": {"kv_retention_ttl_seconds": -1}}})
Traceback (most recent call last):
...
controlplane.kvhints.HintError: vllm_xargs.agentic_context.kv_retention_ttl_seconds must be \
a finite number >= 0, got -1
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from controlplane.kvhints import HintError, loads_bounded, quote
from enginehook.hints.flat import control_character

__all__ = ["FIELD", "MAX_KEYS", "AgenticContext", "parse", "translate"]

#: Where the router puts the context.
FIELD = "vllm_xargs.agentic_context"
#: The most keys a context may hold.
MAX_KEYS = 32
#: The longest string value (the control plane's program-id limit).
MAX_CHARS = 256
_IDS = ("program_id", "session_id", "parent_program_id")


@dataclass(frozen=True, slots=True)
class AgenticContext:
    """What the hook takes from a context: the program, its parent and the client's TTL."""

    program_id: str | None = None
    parent_program_id: str | None = None
    ttl_s: float | None = None


def _checked(key: str, value: Any) -> Any:
    where = f"{FIELD}.{key}"
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if len(value) > MAX_CHARS:
            raise HintError(where, f"must be at most {MAX_CHARS} characters, got {len(value)}")
        bad = control_character(value)
        if bad is not None:
            raise HintError(where, f"must not contain control characters, got {bad!r}")
        return value
    if isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise HintError(where, f"must be a finite number, got {quote(value)}")
        return number
    raise HintError(where, f"must be a string, a number, a bool or null, got {quote(value)}")


def parse(value: Any) -> AgenticContext:
    """The checked context (an object, or its JSON text); :class:`HintError` names the key."""
    if isinstance(value, str | bytes):
        value = loads_bounded(value, FIELD)
    if not isinstance(value, dict):
        raise HintError(FIELD, f"must be a JSON object, got {quote(value)}")
    if len(value) > MAX_KEYS:
        raise HintError(FIELD, f"must hold at most {MAX_KEYS} keys, got {len(value)}")
    checked = {str(k)[:MAX_CHARS]: _checked(str(k), v) for k, v in value.items()}
    ids = {}
    for key in _IDS:
        given = checked.get(key)
        if given is not None and (not isinstance(given, str) or not given):
            raise HintError(f"{FIELD}.{key}", f"must be a non-empty string, got {quote(given)}")
        ids[key] = given
    ttl = checked.get("kv_retention_ttl_seconds")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, float) or ttl < 0):
        raise HintError(
            f"{FIELD}.kv_retention_ttl_seconds",
            f"must be a finite number >= 0, got {quote(value['kv_retention_ttl_seconds'])}",
        )
    return AgenticContext(ids["program_id"] or ids["session_id"], ids["parent_program_id"], ttl)


def translate(body: MutableMapping[str, Any]) -> AgenticContext | None:
    """Take ``vllm_xargs.agentic_context`` out of a parsed request ``body`` and set the flat
    keys the hook reads in its place (module docstring); ``None`` when there is none."""
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, MutableMapping) or "agentic_context" not in xargs:
        return None
    context = parse(xargs.pop("agentic_context"))
    if context.program_id is not None and "session_id" not in body:
        xargs.setdefault("session_id", context.program_id)
    if context.parent_program_id is not None:
        xargs.setdefault("parent_session_id", context.parent_program_id)
    if context.ttl_s is not None:
        xargs.setdefault("pin_ttl_s", context.ttl_s)
    return context
