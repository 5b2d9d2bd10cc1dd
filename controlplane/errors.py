"""The control plane's exceptions (storage drivers' errors are turned into these)."""

from __future__ import annotations

__all__ = [
    "MAX_MESSAGE_CHARS",
    "AuthenticationError",
    "ControlPlaneError",
    "InvalidInputError",
    "LogCompactedError",
    "NotFoundError",
    "OverloadedError",
    "RevokedError",
    "SchemaOutOfDateError",
    "SlowClientError",
    "StorageError",
    "TenantExistsError",
    "TenantNotFoundError",
    "clip",
]

#: Characters of an error message that reach a client or a log line at most.
MAX_MESSAGE_CHARS = 500


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to a short prefix that says how long it was: an error never echoes
    a client's input whole (a value may be megabytes). Values inside a message are
    quoted with ``kvhints.quote`` (a 40-character prefix).

    >>> clip("ok")
    'ok'
    >>> clip("no tenant named " + "x" * 10_000, limit=20)
    'no tenant named xxxx... (10016 characters)'
    """
    return message if len(message) <= limit else f"{message[:limit]}... ({len(message)} characters)"


#: Trailing metadata key of an error that retrying the same request cannot cure (a limit
#: that only an operator can raise): its value is ``"false"``. Clients that retry on
#: RESOURCE_EXHAUSTED (the engine hook) treat such an answer as final.
RETRYABLE_KEY = "cachettl-retryable"

#: Trailing metadata key of a call refused for its tenant's share of the server
#: (RESOURCE_EXHAUSTED, :mod:`controlplane.rpc.lanes`): milliseconds to wait before
#: sending again.
RETRY_AFTER_KEY = "cachettl-retry-after-ms"


def retry_after_s(error: BaseException) -> float | None:
    """The delay an error answer asks for before a retry (:data:`RETRY_AFTER_KEY`), in
    seconds; None when it names none (a gRPC error's trailing metadata, read duck-typed)."""
    trailer = getattr(error, "trailing_metadata", None)
    if not callable(trailer):
        return None
    for key, value in trailer() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


class ControlPlaneError(Exception):
    """Base class of the control plane's errors. ``retryable``: whether sending the same
    request again may succeed (answered with :data:`RETRYABLE_KEY` when not)."""

    retryable = True


class StorageError(ControlPlaneError):
    """The database failed (connection lost, disk full, lock timeout, ...)."""


class SchemaOutOfDateError(StorageError):
    """The database schema is older (or newer) than this version of the code expects."""


class LogCompactedError(StorageError, ValueError):
    """The event log was compacted and no stored snapshot this server can restore covers
    what was deleted: its models cannot be rebuilt (the message says what to do)."""


class OverloadedError(ControlPlaneError):
    """A limit on concurrent work was reached (RESOURCE_EXHAUSTED); the message names it."""


class AuthenticationError(ControlPlaneError):
    """No usable bearer token, or nobody holds it (UNAUTHENTICATED)."""


class RevokedError(ControlPlaneError):
    """The token's tenant was revoked (PERMISSION_DENIED)."""


class NotFoundError(ControlPlaneError):
    """What a request names does not exist (NOT_FOUND)."""


class SlowClientError(ControlPlaneError):
    """The call's message did not arrive in time after its headers (DEADLINE_EXCEEDED)."""


class TenantExistsError(ControlPlaneError):
    """A tenant of that name already exists."""


class TenantNotFoundError(ControlPlaneError):
    """No tenant of that name."""


class InvalidInputError(ControlPlaneError, ValueError):
    """A request field is out of bounds; the message names the field and the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
