"""KV hints in the cross-engine ``KvHintsEnvelope`` shape, and CacheTTL's retention action.

The envelope is the one vLLM (``vllm.v1.kv_hints.KvHintsEnvelope``, on ``Request.kv_hints``),
SGLang (``kv_hints`` of a generate request) and Dynamo's router carry::

    {"protocol_version": "1", "message_id": "...",
     "actions": [{"action_id": "...", "action_type": "...", "action_version": "...",
                  "payload": {...}}]}

CacheTTL executes one action type, :data:`RETENTION_ACTION` (``cachettl.retention``),
version :data:`RETENTION_VERSION` (``1``). Its payload (every key optional):

- ``ttl_s``: the TTL of this turn's pin, seconds >= 0 (overrides the policy);
- ``ttl_ceiling_s``: the most this turn may be pinned, seconds >= 0 (caps any TTL, the
  policy's or ``ttl_s``; the engine's ``ttl_cap_s`` still applies on top);
- ``last_turn`` (bool): the program ends with this turn;
- ``tool``, ``tool_args`` (strings): the tool this turn calls and its arguments;
- ``pin`` (bool): ``false`` never pins this turn;
- ``release`` (bool): close the session now: its pin goes at once, nothing is pinned
  after this request.

Versions: ``action_version`` is ``MAJOR`` or ``MAJOR.MINOR``. Major 1 is accepted whatever
its minor (a later minor may add payload keys: unknown keys are ignored); another major is
ignored with a debug log. Actions of other types are ignored (they are other components'),
but every action must have the envelope's shape. A malformed envelope or retention payload
raises :class:`HintError` (a ``ValueError``) naming the field path.

Bounds (the envelope crosses a trust boundary: any HTTP client may send one):
:data:`MAX_TEXT_CHARS` characters of JSON text, nesting depth :data:`MAX_DEPTH` (the
envelope's own shape needs 4), integer literals of at most :data:`MAX_INT_DIGITS` digits,
no ``NaN``/``Infinity``; ids of 256 characters, texts of 4096, 64 actions. Text is
checked before it is parsed (:func:`loads_bounded`: the depth by a linear scan, so no
recursive parse ever sees a deep document) and a given object is walked without
recursion, so a hostile envelope raises :class:`HintError`, never ``RecursionError`` or
``OverflowError``. Errors quote at most a short prefix of a value (:func:`quote`).

Where an envelope comes from: ``Request.kv_hints`` (vLLM's offline API, routers lowering
into vLLM), a plain JSON object (SGLang, Dynamo), or an HTTP body's ``kv_hints`` field,
which :class:`enginehook.sessions.SessionIdMiddleware` moves into ``vllm_xargs`` under
:data:`XARGS_KEY` as JSON text (vLLM 0.32's HTTP server does not pass ``kv_hints`` on).

>>> envelope = retention_envelope(Retention(ttl_s=30.0), message_id="m1")
>>> parse_kv_hints(envelope).payload()
{'ttl_s': 30.0}
>>> envelope["actions"][0]["payload"]["ttl_s"] = -1
>>> parse_kv_hints(envelope)
Traceback (most recent call last):
...
controlplane...HintError: kv_hints.actions[0].payload.ttl_s must be a finite number >= 0, got -1
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_hints import KvHintsEnvelope

    from controlplane._gen.cachettl.v1 import ttl_pb2

__all__ = [
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_TEXT_CHARS",
    "PROTOCOL_VERSION",
    "RETENTION_ACTION",
    "RETENTION_VERSION",
    "XARGS_KEY",
    "HintError",
    "Retention",
    "check_bounds",
    "envelope_from_proto",
    "envelope_to_proto",
    "loads_bounded",
    "parse_kv_hints",
    "quote",
    "retention_envelope",
    "to_vllm",
    "within_depth",
]

logger = logging.getLogger("enginehook")

#: The action type CacheTTL executes.
RETENTION_ACTION = "cachettl.retention"
#: The version of it this release writes (major 1 is read whatever its minor).
RETENTION_VERSION = "1"
#: The envelope's ``protocol_version`` this release writes.
PROTOCOL_VERSION = "1"
#: The ``vllm_xargs`` key under which the HTTP path carries an envelope (JSON text).
XARGS_KEY = "cachettl_kv_hints"

_MAJOR = 1
#: Message ids: unique per process by the counter, across processes by the random prefix.
_ID_PREFIX = uuid.uuid4().hex[:16]
_IDS = itertools.count()
_VERSION = re.compile(r"^(\d+)(?:\.\d+)?$")
_MAX_ACTIONS = 64
_MAX_ID = 256
_MAX_TEXT = 4096
_SECONDS = ("ttl_s", "ttl_ceiling_s")
_FLAGS = ("last_turn", "pin", "release")
_TEXTS = ("tool", "tool_args")
#: The longest envelope accepted as JSON text (characters).
MAX_TEXT_CHARS = 64 * 1024
#: The deepest nesting accepted in an envelope (objects and arrays).
MAX_DEPTH = 16
#: The most digits of an integer literal (a float literal is bounded by being finite).
MAX_INT_DIGITS = 32
_MAX_INT = 10**MAX_INT_DIGITS
#: The most values (objects, arrays, scalars) in an envelope given as an object.
_MAX_NODES = 16 * 1024
#: Characters of a value quoted in an error message.
_QUOTE = 40
#: JSON text tokens that matter for depth: a whole string (skipped), an opening, a closing.
_SCAN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|([\[{])|([\]}])')


class HintError(ValueError):
    """A malformed hint; ``field`` names it (``kv_hints.actions[0].payload.ttl_s``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message if message.startswith(field) else f"{field} {message}")
        self.field = field


def quote(value: Any) -> str:
    """``value`` for an error message: at most a short prefix of it, never its whole text
    (a client may send megabytes), and never a recursive ``repr``.

    >>> quote("x" * 1000)
    "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (1000 characters)"
    >>> quote([[[1]]]), quote(10**100), quote(-1)
    ('an array', 'an integer of 101 digits', '-1')
    """
    if isinstance(value, str | bytes):
        more = f"... ({len(value)} characters)" if len(value) > _QUOTE else ""
        return repr(value[:_QUOTE]) + more
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_QUOTE:
        return f"an integer of {_digits(value)} digits"
    if isinstance(value, bool | int | float) or value is None:
        return repr(value)
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return f"a {type(value).__name__}"


def _digits(value: int) -> str:
    """How many digits ``value`` has (``str()`` refuses ints of over 4300 digits)."""
    if value.bit_length() < 10_000:
        return str(len(str(abs(value))))
    return f"about {int(value.bit_length() * math.log10(2)) + 1}"


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer literal of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"a number out of range: {text[:_QUOTE]}")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def loads_bounded(
    text: str | bytes, where: str, *, max_chars: int = MAX_TEXT_CHARS, max_depth: int = MAX_DEPTH
) -> Any:
    """JSON ``text`` parsed within bounds: at most ``max_chars`` characters, nesting at
    most ``max_depth`` deep (checked by a linear scan before parsing), integer literals of
    at most :data:`MAX_INT_DIGITS` digits, finite numbers only. Raises :class:`HintError`
    naming ``where``.

    >>> loads_bounded('{"a": [1, 2.5]}', "x")
    {'a': [1, 2.5]}
    >>> loads_bounded("[" * 100 + "]" * 100, "kv_hints")
    Traceback (most recent call last):
    ...
    controlplane.kvhints.HintError: kv_hints must nest at most 16 deep
    >>> loads_bounded('{"ttl_s": 1e400}', "kv_hints")
    Traceback (most recent call last):
    ...
    controlplane.kvhints.HintError: kv_hints must be a JSON object: a number out of range: 1e400
    """
    if len(text) > max_chars:
        raise HintError(where, f"must be at most {max_chars} characters, got {len(text)}")
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError:
            raise HintError(where, "must be UTF-8 text") from None
    if not within_depth(text, max_depth):
        raise HintError(where, f"must nest at most {max_depth} deep")
    try:
        return json.loads(
            text,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except ValueError as exc:
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise HintError(where, f"must be a JSON object: {message}") from None


def within_depth(text: str, max_depth: int) -> bool:
    """Whether no object or array in JSON ``text`` nests deeper than ``max_depth`` (strings
    skipped whole; malformed text is left to the parser)."""
    if text.count("[") + text.count("{") <= max_depth:
        return True
    depth = 0
    for match in _SCAN.finditer(text):
        if match.lastindex == 1:
            depth += 1
            if depth > max_depth:
                return False
        elif match.lastindex == 2:
            depth -= 1
    return True


def check_bounds(value: Any, where: str, *, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`HintError` when ``value`` (JSON-like objects) nests deeper than
    ``max_depth``, holds more than 16,384 values, or holds an integer over
    :data:`MAX_INT_DIGITS` digits or a non-finite float. Walks without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > _MAX_NODES:
            raise HintError(where, f"must hold at most {_MAX_NODES} values")
        if isinstance(item, Mapping | list | tuple):
            if depth > max_depth:
                raise HintError(where, f"must nest at most {max_depth} deep")
            children = item.values() if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, float) and not math.isfinite(item):
            raise HintError(where, f"must hold finite numbers only, got {item!r}")
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) >= _MAX_INT:
            raise HintError(where, f"must hold integers of at most {MAX_INT_DIGITS} digits")


@dataclass(frozen=True, slots=True)
class Retention:
    """What a retention action said (``None``: not said)."""

    ttl_s: float | None = None
    ttl_ceiling_s: float | None = None
    last_turn: bool | None = None
    tool: str | None = None
    tool_args: str | None = None
    pin: bool | None = None
    release: bool | None = None

    def payload(self) -> dict[str, Any]:
        """The action's JSON payload (the keys said)."""
        values = ((k, getattr(self, k)) for k in _KEYS)
        return {k: v for k, v in values if v is not None}


#: The payload keys, in the order :class:`Retention` declares them.
_KEYS = tuple(f.name for f in fields(Retention))


def _as_mapping(value: Any, where: str) -> Any:
    """An envelope as plain JSON values within the bounds: from a vLLM/msgspec struct,
    JSON text or a dict."""
    if isinstance(value, str | bytes):
        return loads_bounded(value, where)
    if hasattr(value, "__struct_fields__"):
        import msgspec

        value = msgspec.to_builtins(value)
    check_bounds(value, where)
    return value


def _string(obj: Mapping[str, Any], key: str, where: str, limit: int = _MAX_ID) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise HintError(f"{where}.{key}", f"must be a string, got {quote(value)}")
    if len(value) > limit:
        raise HintError(f"{where}.{key}", f"must be at most {limit} characters, got {len(value)}")
    return value


def _major(version: str, where: str) -> int:
    match = _VERSION.match(version)
    if match is None:
        raise HintError(
            f"{where}.action_version", f"must be MAJOR or MAJOR.MINOR, got {quote(version)}"
        )
    return int(match.group(1))


def _seconds(payload: Mapping[str, Any], key: str, where: str) -> float | None:
    value = payload.get(key)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        raise HintError(f"{where}.{key}", f"must be a finite number >= 0, got {quote(value)}")
    if isinstance(value, int) and value >= _MAX_INT:
        raise HintError(f"{where}.{key}", f"must be a finite number >= 0, got {quote(value)}")
    return float(value)


def _flag(payload: Mapping[str, Any], key: str, where: str) -> bool | None:
    value = payload.get(key)
    if value is not None and not isinstance(value, bool):
        raise HintError(f"{where}.{key}", f"must be true or false, got {quote(value)}")
    return value


def _text(payload: Mapping[str, Any], key: str, where: str) -> str | None:
    if payload.get(key) is None:
        return None
    return _string(payload, key, where, _MAX_TEXT) or None


def _retention(payload: Any, where: str) -> Retention:
    if not isinstance(payload, Mapping):
        raise HintError(where, f"must be an object, got {quote(payload)}")
    values: dict[str, Any] = {k: _seconds(payload, k, where) for k in _SECONDS}
    values.update({k: _flag(payload, k, where) for k in _FLAGS})
    values.update({k: _text(payload, k, where) for k in _TEXTS})
    return Retention(**values)


def parse_kv_hints(value: Any, where: str = "kv_hints") -> Retention | None:
    """The retention action of an envelope (a vLLM ``KvHintsEnvelope``, a JSON object or
    its text), or ``None`` when it carries none this release reads. ``where`` prefixes
    the field path in errors."""
    envelope = _as_mapping(value, where)
    if not isinstance(envelope, Mapping):
        raise HintError(where, f"must be an object, got {quote(envelope)}")
    _string(envelope, "protocol_version", where)
    _string(envelope, "message_id", where)
    actions = envelope.get("actions")
    if not isinstance(actions, list):
        raise HintError(f"{where}.actions", f"must be a list, got {quote(actions)}")
    if len(actions) > _MAX_ACTIONS:
        raise HintError(f"{where}.actions", f"must hold at most {_MAX_ACTIONS}, got {len(actions)}")
    found: Retention | None = None
    for i, action in enumerate(actions):
        at = f"{where}.actions[{i}]"
        if not isinstance(action, Mapping):
            raise HintError(at, f"must be an object, got {quote(action)}")
        kind = _string(action, "action_type", at)
        _string(action, "action_id", at)
        version = _string(action, "action_version", at)
        if not isinstance(action.get("payload"), Mapping):
            payload = quote(action.get("payload"))
            raise HintError(f"{at}.payload", f"must be an object, got {payload}")
        if kind != RETENTION_ACTION:
            continue
        if _major(version, at) != _MAJOR:
            logger.debug("ignoring %s: %s version %s is not %d.x", at, kind, version, _MAJOR)
            continue
        if found is not None:
            raise HintError(at, f"{at}: at most one {RETENTION_ACTION} action per envelope")
        found = _retention(action["payload"], f"{at}.payload")
    return found


def retention_envelope(retention: Retention, *, message_id: str | None = None) -> dict[str, Any]:
    """An envelope (JSON form) holding one retention action that says ``retention``
    (``message_id``: default, one unique to this process and call)."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id or f"{_ID_PREFIX}-{next(_IDS)}",
        "actions": [
            {
                "action_id": "retention",
                "action_type": RETENTION_ACTION,
                "action_version": RETENTION_VERSION,
                "payload": retention.payload(),
            }
        ],
    }


def to_vllm(envelope: Mapping[str, Any]) -> KvHintsEnvelope:
    """The JSON form as vLLM's ``KvHintsEnvelope`` (for ``AsyncLLM.generate(kv_hints=...)``
    or ``LLMEngine.add_request(kv_hints=...)``); imports vLLM."""
    import msgspec
    from vllm.v1.kv_hints import KvHintsEnvelope

    return msgspec.convert(dict(envelope), KvHintsEnvelope)


def envelope_from_proto(message: ttl_pb2.KvHintsEnvelope) -> dict[str, Any]:
    """The JSON form of the wire message (``DecideTtlResponse.kv_hints``), ready to forward
    as an HTTP body's ``kv_hints``, an SGLang/Dynamo ``kv_hints`` or (:func:`to_vllm`) to
    vLLM. Struct numbers are doubles, so ``ttl_s`` comes back as a float."""
    from google.protobuf import json_format

    out = json_format.MessageToDict(message, preserving_proto_field_name=True)
    out.setdefault("actions", [])
    for action in out["actions"]:
        action.setdefault("payload", {})
    return {"protocol_version": "", "message_id": "", **out}


def envelope_to_proto(envelope: Mapping[str, Any]) -> ttl_pb2.KvHintsEnvelope:
    """The wire message of a JSON-form envelope (the inverse of :func:`envelope_from_proto`;
    built field by field: ``json_format.ParseDict`` costs ten times as much on the
    ``DecideTtl`` path)."""
    from controlplane._gen.cachettl.v1 import ttl_pb2

    message = ttl_pb2.KvHintsEnvelope(
        protocol_version=envelope["protocol_version"], message_id=envelope["message_id"]
    )
    for action in envelope["actions"]:
        added = message.actions.add(
            action_id=action["action_id"],
            action_type=action["action_type"],
            action_version=action["action_version"],
        )
        added.payload.update(action["payload"])
    return message
