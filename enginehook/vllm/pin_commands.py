"""A router's commands on a session's pin: drop it, or extend it.

vllm-router's program scheduling documents the engine side it lacks: a router-to-engine KV
hint answered at once ``accepted``, ``rejected`` or ``unsupported``, then ``applied``,
``failed`` or ``expired`` (its ``docs/program_scheduling.md``; "router residency
accounting must not change until the engine reports ``applied``"). This module is that
contract, engine-independent:

- :meth:`PinCommands.submit` (any thread: the hook's HTTP endpoint) answers at once:
  ``unsupported`` where the engine does not pin (the hook off or passing through) or the
  action is not one of :data:`ACTIONS`; ``rejected`` for a bad session id or TTL, or when
  :data:`MAX_PENDING` commands already wait; else ``accepted``, queued.
- :meth:`PinCommands.apply` (the scheduler's thread, at its next step or idle wake-up)
  settles every queued command on the :class:`~enginehook.core.lifecycle.PinController`:
  ``applied`` when the session held a pin (dropped; or held at least until now + TTL,
  within the rules' cap), ``expired`` when it held none by then (its pin had expired, been
  hit or released), ``failed`` when applying raised.
- :meth:`PinCommands.get` returns a command by id while it is among the newest
  :data:`HISTORY` and the history holds at most :data:`HISTORY_MAX_BYTES` (a router polls
  it). Every client string a command keeps or answers (its action, session id, detail) is
  clipped to :data:`CLIENT_STRING_CHARS` characters with a marker (:func:`clip`), so a
  60,000-character id costs no more than a 256-character one. Ids are random (122 bits
  of a UUID 4), never sequential: one id tells nothing of another command's, so no one
  reads another router's sessions by counting, and ids never collide across engines. Both it and
  ``submit`` return a JSON-ready copy taken under the lock (the HTTP threads never see a
  command half settled).

Nothing here blocks the scheduler: the queue is a lock-guarded deque it swaps out in one
step, and an engine with nothing queued pays one truthiness test.

>>> commands = PinCommands()
>>> answer = commands.submit("drop", "s1", now=10.0)
>>> answer["state"], answer["session"], len(answer["id"])
('accepted', 's1', 33)
>>> commands.get(answer["id"])["state"]
'accepted'
>>> commands.submit("offload", "s1", now=10.0)["state"]
'unsupported'
>>> commands.submit("extend", "s1", now=10.0, ttl_s=-1.0)["detail"]
'ttl_seconds must be a finite number > 0, got -1.0'
"""

from __future__ import annotations

import math
import sys
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from enginehook.core.lifecycle import PinController

__all__ = [
    "ACTIONS",
    "BUSY",
    "CLIENT_STRING_CHARS",
    "HISTORY",
    "HISTORY_MAX_BYTES",
    "MAX_PENDING",
    "MAX_SESSION_CHARS",
    "PinCommand",
    "PinCommands",
    "clip",
]

#: What a router may ask of a session's pin.
ACTIONS = ("drop", "extend")
#: Commands queued for the scheduler at most (more are rejected, not queued).
MAX_PENDING = 1024
#: Settled or queued commands kept for :meth:`PinCommands.get`, at most, and the memory
#: they may hold (estimated per command: its object, id and times, plus its strings; the
#: oldest are dropped first past either bound).
HISTORY = 4096
HISTORY_MAX_BYTES = 4 * 1024 * 1024
#: The longest client string (action, session id, error detail) a command keeps or
#: answers; longer ones are cut there and marked ``…[+N chars]``.
CLIENT_STRING_CHARS = 256
#: What one kept command costs besides its strings (object, id, times, history entry).
_COMMAND_BYTES = 320
#: The ``detail`` of a command rejected because :data:`MAX_PENDING` already wait.
BUSY = f"{MAX_PENDING} commands pending"
#: The longest session id taken (as the session middleware's).
MAX_SESSION_CHARS = 256


def clip(text: str, limit: int = CLIENT_STRING_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked with how many were cut.

    >>> clip("x" * 300)[-16:]
    'xxxx…[+44 chars]'
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[+{len(text) - limit} chars]"


@dataclass(slots=True)
class PinCommand:
    """One command and where it stands: ``accepted`` → ``applied`` | ``failed`` |
    ``expired``; or ``rejected`` / ``unsupported`` at once. ``expires_at``: the pin's expiry
    (Unix seconds) after an applied ``extend``."""

    command_id: str
    action: str
    session: str
    ttl_s: float | None
    submitted_at: float
    state: str = "accepted"
    detail: str = ""
    settled_at: float | None = None
    expires_at: float | None = None
    blocks: int | None = None

    def cost(self) -> int:
        """Estimated bytes this command holds in the history."""
        strings = (self.action, self.session, self.detail)
        return _COMMAND_BYTES + sum(sys.getsizeof(s) for s in strings)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.command_id,
            "action": self.action,
            "session": self.session,
            "state": self.state,
        }
        for key, value in (
            ("ttl_seconds", self.ttl_s),
            ("detail", self.detail or None),
            ("settled_at", self.settled_at),
            ("expires_at", self.expires_at),
            ("blocks", self.blocks),
        ):
            if value is not None:
                out[key] = value
        return out


class PinCommands:
    """Commands from routers, queued for the scheduler and kept for polling."""

    def __init__(self, supported: bool = True, on_submit: Callable[[], None] | None = None):
        #: Whether this engine pins at all (off or passing through: every command is
        #: ``unsupported``).
        self.supported = supported
        #: Called (from the submitting thread) when a command is queued: wakes the engine.
        self.on_submit = on_submit
        self._lock = threading.Lock()
        self._queue: deque[PinCommand] = deque()
        self._history: OrderedDict[str, PinCommand] = OrderedDict()
        self._history_bytes = 0

    def __bool__(self) -> bool:
        return bool(self._queue)

    def submit(
        self, action: str, session: str, now: float, ttl_s: float | None = None
    ) -> dict[str, Any]:
        """Take one command (any thread); its ``state`` is the immediate answer."""
        with self._lock:
            state, detail = self._check(action, session, ttl_s)
            command = PinCommand(f"c{uuid.uuid4().hex}", clip(action), clip(session), ttl_s, now)
            command.state, command.detail = state, detail
            if state != "accepted":
                command.settled_at = now
            elif len(self._queue) >= MAX_PENDING:
                command.state, command.detail = "rejected", BUSY
                command.settled_at = now
            else:
                self._queue.append(command)
            self._history[command.command_id] = command
            self._history_bytes += command.cost()
            self._trim()
            answer = command.to_json()
        if command.state == "accepted" and self.on_submit is not None:
            self.on_submit()
        return answer

    def _trim(self) -> None:
        """Drop the oldest commands past :data:`HISTORY` or :data:`HISTORY_MAX_BYTES`
        (under the lock)."""
        while len(self._history) > HISTORY or (
            self._history_bytes > HISTORY_MAX_BYTES and len(self._history) > 1
        ):
            _, old = self._history.popitem(last=False)
            self._history_bytes -= old.cost()

    def _check(self, action: str, session: str, ttl: float | None) -> tuple[str, str]:
        if action not in ACTIONS:
            valid = ", ".join(ACTIONS)
            return "unsupported", f"action {clip(action)!r} is not one of {valid}"
        if not self.supported:
            return "unsupported", "this engine does not pin (CacheTTL off or passing through)"
        if not session or len(session) > MAX_SESSION_CHARS or not session.isprintable():
            return "rejected", f"session id must be 1-{MAX_SESSION_CHARS} printable characters"
        if action == "extend":
            if ttl is None or not (isinstance(ttl, float) and math.isfinite(ttl) and ttl > 0):
                return "rejected", f"ttl_seconds must be a finite number > 0, got {ttl!r}"
        elif ttl is not None:
            return "rejected", "drop takes no ttl_seconds"
        return "accepted", ""

    def ids(self) -> list[str]:
        """The ids of the commands kept, oldest first."""
        with self._lock:
            return list(self._history)

    def get(self, command_id: str) -> dict[str, Any] | None:
        with self._lock:
            command = self._history.get(command_id)
            return None if command is None else command.to_json()

    def apply(self, controller: PinController[Any], now: float) -> None:
        """Settle every queued command (the scheduler's thread)."""
        with self._lock:
            queued, self._queue = self._queue, deque()
        for command in queued:
            blocks = expires_at = None
            try:
                if command.action == "drop":
                    pin = controller.drop(command.session, now)
                else:
                    assert command.ttl_s is not None
                    pin = controller.extend(command.session, command.ttl_s, now)
            except Exception as exc:  # settled as failed; the scheduler carries on
                state, detail = "failed", clip(f"{type(exc).__name__}: {exc}")
            else:
                if pin is None:
                    state, detail = (
                        "expired",
                        "the session holds no pin here (expired, hit or released)",
                    )
                else:
                    state, detail, blocks = "applied", "", pin.blocks
                    expires_at = pin.expires_at if command.action == "extend" else None
            with self._lock:
                kept = self._history.get(command.command_id) is command
                if kept:
                    self._history_bytes -= command.cost()
                command.state, command.detail, command.settled_at = state, detail, now
                command.blocks, command.expires_at = blocks, expires_at
                if kept:
                    self._history_bytes += command.cost()
                    self._trim()
