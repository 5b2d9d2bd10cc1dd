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
raises ``ValueError`` naming the field path.

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
ValueError: kv_hints.actions[0].payload.ttl_s must be a finite number >= 0, got -1
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
    "PROTOCOL_VERSION",
    "RETENTION_ACTION",
    "RETENTION_VERSION",
    "XARGS_KEY",
    "Retention",
    "envelope_from_proto",
    "envelope_to_proto",
    "parse_kv_hints",
    "retention_envelope",
    "to_vllm",
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
    """An envelope as plain JSON values: from a vLLM/msgspec struct, JSON text or a dict."""
    if hasattr(value, "__struct_fields__"):
        import msgspec

        return msgspec.to_builtins(value)
    if isinstance(value, str | bytes):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where} must be a JSON object: {exc}") from None
    return value


def _string(obj: Mapping[str, Any], key: str, where: str, limit: int = _MAX_ID) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string, got {value!r}")
    if len(value) > limit:
        raise ValueError(f"{where}.{key} must be at most {limit} characters, got {len(value)}")
    return value


def _major(version: str, where: str) -> int:
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"{where}.action_version must be MAJOR or MAJOR.MINOR, got {version!r}")
    return int(match.group(1))


def _seconds(payload: Mapping[str, Any], key: str, where: str) -> float | None:
    value = payload.get(key)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}.{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _flag(payload: Mapping[str, Any], key: str, where: str) -> bool | None:
    value = payload.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def _text(payload: Mapping[str, Any], key: str, where: str) -> str | None:
    if payload.get(key) is None:
        return None
    return _string(payload, key, where, _MAX_TEXT) or None


def _retention(payload: Any, where: str) -> Retention:
    if not isinstance(payload, Mapping):
        raise ValueError(f"{where} must be an object, got {payload!r}")
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
        raise ValueError(f"{where} must be an object, got {envelope!r}")
    _string(envelope, "protocol_version", where)
    _string(envelope, "message_id", where)
    actions = envelope.get("actions")
    if not isinstance(actions, list):
        raise ValueError(f"{where}.actions must be a list, got {actions!r}")
    if len(actions) > _MAX_ACTIONS:
        raise ValueError(f"{where}.actions must hold at most {_MAX_ACTIONS}, got {len(actions)}")
    found: Retention | None = None
    for i, action in enumerate(actions):
        at = f"{where}.actions[{i}]"
        if not isinstance(action, Mapping):
            raise ValueError(f"{at} must be an object, got {action!r}")
        kind = _string(action, "action_type", at)
        _string(action, "action_id", at)
        version = _string(action, "action_version", at)
        if not isinstance(action.get("payload"), Mapping):
            raise ValueError(f"{at}.payload must be an object, got {action.get('payload')!r}")
        if kind != RETENTION_ACTION:
            continue
        if _major(version, at) != _MAJOR:
            logger.debug("ignoring %s: %s version %s is not %d.x", at, kind, version, _MAJOR)
            continue
        if found is not None:
            raise ValueError(f"{at}: at most one {RETENTION_ACTION} action per envelope")
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
