"""The stable path of the session middleware:
``--middleware enginehook.sessions.SessionIdMiddleware``.
The middleware lives in :mod:`enginehook.hints.sessions`."""

from enginehook.hints.sessions import SessionIdMiddleware

__all__ = ["SessionIdMiddleware"]
