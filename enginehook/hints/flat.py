"""Client hints of a request: flat keys in its ``vllm_xargs`` (vLLM's
``SamplingParams.extra_args``) and a KV-hint envelope's retention action
(:mod:`controlplane.kvhints`).

Flat keys: ``last_turn`` (bool), ``tool`` (the tool this turn calls), ``tool_args``,
``pin_ttl_s`` (override the TTL, seconds >= 0), ``pin_ttl_max_s`` (the most this turn may
be pinned, seconds >= 0: a ceiling on any TTL, the policy's or ``pin_ttl_s``), ``pin``
(bool; 0 disables pinning for this request), ``release`` (bool: close the session now),
``parent_session_id`` (the program this one works for, such as a sub-agent's parent: the
program is scheduled as part of it; the session middleware sets it).
The tenant is never a request field: it is the engine's (its control-plane credentials).
vLLM turns JSON booleans into ``1``/``0`` on the way, so flags accept 0/1, booleans and
the strings ``"true"``/``"false"``/``"1"``/``"0"``.

Bounds: ``tool`` and ``tool_args`` at most 4096 characters, ``parent_session_id`` at most
256 (the program-id limit) without control characters, seconds finite (an integer too
large for a float is refused like ``inf``), the envelope's text as
:func:`controlplane.kvhints.loads_bounded` bounds it. A bad value raises
:class:`~controlplane.kvhints.HintError` naming the key, quoting at most a short prefix.

When a request carries both, the envelope wins, key by key: what its retention action
says (``ttl_s``, ``ttl_ceiling_s``, ``last_turn``, ``tool``, ``tool_args``, ``pin``,
``release``) replaces the flat key of the same meaning (``pin_ttl_s``, ``pin_ttl_max_s``,
...); what it does not say keeps the flat value. The envelope is the typed, versioned
contract a router writes on purpose; flat keys are the older, looser form.

>>> Hints.from_extra_args({"last_turn": 1, "tool": "bash", "pin_ttl_s": "2.5"})
Hints(last_turn=True, tool='bash', tool_args=None, pin_ttl_s=2.5, pin=True, ...)
>>> Hints.from_extra_args({"pin_ttl_s": -1})
Traceback (most recent call last):
...
controlplane.kvhints.HintError: vllm_xargs.pin_ttl_s must be a finite number >= 0, got -1
>>> from controlplane.kvhints import Retention
>>> hints = Hints(pin_ttl_s=60.0, pin_ttl_max_s=300.0)
>>> hints.with_retention(Retention(ttl_ceiling_s=30.0, release=True))
Hints(..., pin_ttl_s=60.0, pin=True, pin_ttl_max_s=30.0, release=True, parent_session_id=None)
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from controlplane.kvhints import XARGS_KEY, HintError, Retention, parse_kv_hints, quote

__all__ = ["Hints", "control_character", "parse_flag", "request_hints"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_MAX_TEXT = 4096
#: The longest ``parent_session_id`` (the control plane's program-id limit).
_MAX_ID = 256
#: Retention payload key -> the Hints field it sets.
_FROM_RETENTION = {
    "ttl_s": "pin_ttl_s",
    "ttl_ceiling_s": "pin_ttl_max_s",
    "last_turn": "last_turn",
    "tool": "tool",
    "tool_args": "tool_args",
    "pin": "pin",
    "release": "release",
}


def parse_flag(name: str, value: Any) -> bool:
    """A boolean hint as vLLM delivers it (``1``/``0``, bool, or a string)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    where = f"vllm_xargs.{name}"
    raise HintError(where, f"must be a boolean (0/1, true/false), got {quote(value)}")


def _text(name: str, value: Any, limit: int = _MAX_TEXT) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise HintError(f"vllm_xargs.{name}", f"must be a string, got {quote(value)}")
    if len(value) > limit:
        raise HintError(f"vllm_xargs.{name}", f"must be at most {limit} characters")
    return value or None


def control_character(text: str) -> str | None:
    """The first control character in ``text`` (Unicode category ``Cc``: C0, DEL, C1), or
    ``None``; printable text in any script passes.

    >>> control_character("Zürich-会话-1"), control_character("a\\x00b")
    (None, '\\x00')
    """
    return next((c for c in text if unicodedata.category(c) == "Cc"), None)


def _session(name: str, value: Any) -> str | None:
    text = _text(name, value, _MAX_ID)
    bad = control_character(text) if text is not None else None
    if bad is not None:
        where = f"vllm_xargs.{name}"
        raise HintError(where, f"must not contain control characters, got {bad!r}")
    return text


def _seconds(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and len(value) > 64:
        seconds = math.nan  # no number of seconds needs more characters
    else:
        try:
            seconds = float(value)
        except (TypeError, ValueError, OverflowError):
            seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
        where = f"vllm_xargs.{name}"
        raise HintError(where, f"must be a finite number >= 0, got {quote(value)}")
    return seconds


@dataclass(frozen=True, slots=True)
class Hints:
    """What the client said about one request."""

    last_turn: bool = False
    tool: str | None = None
    tool_args: str | None = None
    pin_ttl_s: float | None = None
    pin: bool = True
    pin_ttl_max_s: float | None = None
    release: bool = False
    parent_session_id: str | None = None

    @classmethod
    def from_extra_args(cls, extra: Mapping[str, Any] | None) -> Hints:
        """Parse ``vllm_xargs``' flat keys; unknown keys are ignored, bad values name the key."""
        if not extra:
            return cls()
        return cls(
            last_turn=parse_flag("last_turn", extra.get("last_turn", False)),
            tool=_text("tool", extra.get("tool")),
            tool_args=_text("tool_args", extra.get("tool_args")),
            pin_ttl_s=_seconds("pin_ttl_s", extra.get("pin_ttl_s")),
            pin=parse_flag("pin", extra.get("pin", True)),
            pin_ttl_max_s=_seconds("pin_ttl_max_s", extra.get("pin_ttl_max_s")),
            release=parse_flag("release", extra.get("release", False)),
            parent_session_id=_session("parent_session_id", extra.get("parent_session_id")),
        )

    def with_retention(self, retention: Retention | None) -> Hints:
        """These hints with what a retention action says laid over them (it wins)."""
        if retention is None:
            return self
        said = retention.payload()
        return replace(self, **{_FROM_RETENTION[key]: value for key, value in said.items()})


def request_hints(extra: Mapping[str, Any] | None, kv_hints: Any = None) -> Hints:
    """A request's hints: ``vllm_xargs``' flat keys, then the envelope of ``kv_hints``
    (vLLM's ``Request.kv_hints``), then the one an HTTP body carried (``vllm_xargs``
    key :data:`controlplane.kvhints.XARGS_KEY`), each winning over what came before.
    Raises :class:`~controlplane.kvhints.HintError` naming the key or field path."""
    hints = Hints.from_extra_args(extra)
    if kv_hints is not None:
        hints = hints.with_retention(parse_kv_hints(kv_hints, "kv_hints"))
    carried = extra.get(XARGS_KEY) if extra else None
    if carried is not None:
        if not isinstance(carried, str):
            where = f"vllm_xargs.{XARGS_KEY}"
            raise HintError(where, f"must be an envelope's JSON text, got {quote(carried)}")
        hints = hints.with_retention(parse_kv_hints(carried, "kv_hints"))
    return hints
