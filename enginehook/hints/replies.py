"""What the engine pinned, told to the client and the router in the reply's headers.

The pin is decided in vLLM's engine-core process when a turn finishes (the hook's
``_free_blocks``), after the reply's tokens are produced. The hook's ``_free_request``
returns it in the request's ``kv_transfer_params`` under :data:`REPLY_KEY`, which vLLM 0.32
carries in the finished ``EngineCoreOutput`` to the API server and writes into the
non-streaming reply's top-level ``kv_transfer_params`` field (chat, completions, responses,
messages)::

    "kv_transfer_params": {"cachettl": {"engine": "3f2a9c0b1d4e", "pinned": true,
                                        "ttl_s": 60.0, "expires_at": 1767225660.25,
                                        "tokens": 480}}

``pinned`` is ``false`` (and nothing else but ``engine`` is given) when the hook decided not
to pin this turn (a last turn, a turn that calls no tool, a TTL of 0, the budget refused).
A turn the hook did not look at (no session, the hook off or passing through, a turn cut
short) carries no key.

The session middleware (:func:`pin_headers_send`) repeats it as headers of the reply:
:data:`PINNED_HEADER`, and for a pin :data:`TTL_HEADER`, :data:`EXPIRES_HEADER` (Unix
seconds) and :data:`TOKENS_HEADER`, next to ``X-CacheTTL-Engine``. Headers leave before
the body, so the middleware holds a ``200`` JSON reply's ``http.response.start`` until its
body is complete (at most ``limit`` bytes; a longer body is passed on as it comes, without
the headers). Streaming replies (``text/event-stream``) are passed on untouched. On
``/v1/responses`` vLLM's own ``response.completed`` event carries the whole reply,
``kv_transfer_params`` included; vLLM 0.32's chat and completions stream generators drop the
final output's ``kv_transfer_params`` (no chunk type has the field, and the per-request
metadata they leave for middleware holds only the usage), so those streams carry no pin and
the middleware has nothing sound to add. vLLM 0.33.0's do put it in the chunk that carries
``finish_reason``.
Plain ASGI: unit-testable without vLLM.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

__all__ = [
    "EXPIRES_HEADER",
    "PINNED_HEADER",
    "REPLY_KEY",
    "TOKENS_HEADER",
    "TTL_HEADER",
    "pin_headers",
    "pin_headers_send",
    "pin_reply",
]

logger = logging.getLogger("enginehook")

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

#: The key of ``kv_transfer_params`` that carries the pin decision.
REPLY_KEY = "cachettl"
PINNED_HEADER = b"x-cachettl-pinned"
TTL_HEADER = b"x-cachettl-pin-ttl"
EXPIRES_HEADER = b"x-cachettl-pin-expires-at"
TOKENS_HEADER = b"x-cachettl-pin-tokens"


def pin_reply(
    engine: str, ttl_s: float | None = None, expires_at: float = 0.0, tokens: int = 0
) -> dict[str, Any]:
    """The decision as the reply carries it (``ttl_s`` ``None``: not pinned).

    >>> pin_reply("e1")
    {'engine': 'e1', 'pinned': False}
    >>> pin_reply("e1", 60.0, 1000.5, 480)
    {'engine': 'e1', 'pinned': True, 'ttl_s': 60.0, 'expires_at': 1000.5, 'tokens': 480}
    """
    if ttl_s is None:
        return {"engine": engine, "pinned": False}
    return {
        "engine": engine,
        "pinned": True,
        "ttl_s": float(ttl_s),
        "expires_at": float(expires_at),
        "tokens": int(tokens),
    }


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) and value >= 0 else None


def pin_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """The pin headers for a reply ``body`` (JSON), or ``[]`` when it carries no
    well-formed decision under ``kv_transfer_params.cachettl``.

    >>> reply = {"kv_transfer_params": {"cachettl": pin_reply("e", 7.5, 1000.25, 64)}}
    >>> pin_headers(json.dumps(reply).encode())  # doctest: +NORMALIZE_WHITESPACE
    [(b'x-cachettl-pinned', b'true'), (b'x-cachettl-pin-ttl', b'7.5'),
     (b'x-cachettl-pin-expires-at', b'1000.250'), (b'x-cachettl-pin-tokens', b'64')]
    >>> pin_headers(b'{"kv_transfer_params": {"cachettl": {"pinned": false}}}')
    [(b'x-cachettl-pinned', b'false')]
    >>> pin_headers(b'{"kv_transfer_params": null}'), pin_headers(b"not json")
    ([], [])
    """
    try:
        reply = json.loads(body)
    except ValueError:
        return []
    params = reply.get("kv_transfer_params") if isinstance(reply, Mapping) else None
    pin = params.get(REPLY_KEY) if isinstance(params, Mapping) else None
    if not isinstance(pin, Mapping) or not isinstance(pin.get("pinned"), bool):
        return []
    if not pin["pinned"]:
        return [(PINNED_HEADER, b"false")]
    ttl, expires, tokens = (_number(pin.get(k)) for k in ("ttl_s", "expires_at", "tokens"))
    if ttl is None or expires is None or tokens is None:
        logger.debug("pin in reply: malformed %.200r", pin)
        return []
    return [
        (PINNED_HEADER, b"true"),
        (TTL_HEADER, f"{ttl:g}".encode()),
        (EXPIRES_HEADER, f"{expires:.3f}".encode()),
        (TOKENS_HEADER, str(int(tokens)).encode()),
    ]


def _holds(message: Message) -> bool:
    """Whether a response start is one whose body is read for the pin: ``200``, JSON."""
    if message.get("status") != 200:
        return False
    for name, value in message.get("headers", ()):
        if name.lower() == b"content-type":
            return bytes(value).split(b";")[0].strip().lower() == b"application/json"
    return False


def pin_headers_send(send: Send, limit: int) -> Send:
    """``send`` that holds a ``200`` JSON reply's start until its body is complete and adds
    :func:`pin_headers` to it; other replies, and a body over ``limit`` bytes (from there
    on), pass as they come."""
    held: list[Message] = []
    size = [0]
    passing = [False]

    async def flush(extra: list[tuple[bytes, bytes]]) -> None:
        start, *chunks = held
        held.clear()
        if extra:
            start = dict(start)
            start["headers"] = [*start.get("headers", ()), *extra]
        await send(start)
        for chunk in chunks:
            await send(chunk)

    async def holding(message: Message) -> None:
        kind = message.get("type")
        if passing[0] or kind not in ("http.response.start", "http.response.body"):
            await send(message)
        elif kind == "http.response.start":
            if not _holds(message):
                passing[0] = True
                await send(message)
                return
            held.append(message)
        else:
            held.append(message)
            size[0] += len(message.get("body", b""))
            if size[0] > limit:
                passing[0] = True
                await flush([])
            elif not message.get("more_body", False):
                body = b"".join(m.get("body", b"") for m in held[1:])
                await flush(pin_headers(body))

    return holding
