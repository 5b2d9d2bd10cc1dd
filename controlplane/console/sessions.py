"""Who is looking: the login form's sessions, and which tenants a viewer may see.

A viewer logs in by posting a token (a tenant's bearer token, or the console's admin
token) to ``/login``; the console answers with a cookie holding a random session id
(HttpOnly, SameSite=Strict, Secure when served over TLS). The token stays in the server's
memory and never appears in a URL, a cookie or a log line. Every request resolves the
session's token again through the gRPC services' ``TenantCache`` (same cache, same
freshness, same revocation), so a revoked tenant's console session ends as its RPCs do.

The login form is protected against cross-site posts by a double-submit token: ``GET
/login`` sets a random ``cttl_login`` cookie (SameSite=Strict) and puts the same value in
the form; a post whose field and cookie differ is refused.

A tenant sees its own statistics and, if it shares, the published shared models (the
published, k-anonymous, quantised aggregates, :mod:`controlplane.sharing`); any other
tenant's name is answered as not found. The admin sees every tenant.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.errors import OverloadedError, StorageError
from controlplane.records import Tenant
from controlplane.rpc.auth import TenantCache

__all__ = ["COOKIE", "LOGIN_COOKIE", "DeniedError", "Session", "Sessions", "Viewer"]

COOKIE = "cttl_session"
LOGIN_COOKIE = "cttl_login"


class DeniedError(Exception):
    """The viewer may not see the page: ``status`` and a message for the error page."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Session:
    token: str
    admin: bool
    csrf: str
    created: float
    seen: float


@dataclass(frozen=True)
class Viewer:
    """An authenticated viewer: the admin (``tenant`` None) or one tenant."""

    tenant: Tenant | None
    csrf: str

    @property
    def admin(self) -> bool:
        return self.tenant is None

    @property
    def name(self) -> str:
        return "admin" if self.tenant is None else self.tenant.name


class Sessions:
    """Logged-in viewers, in memory, bounded (the oldest dropped first)."""

    def __init__(
        self,
        tenants: TenantCache,
        admin_token: str | None = None,
        idle_s: float = 1800.0,
        max_age_s: float = 12 * 3600.0,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tenants = tenants
        self._admin = admin_token
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def is_admin(self, token: str) -> bool:
        return self._admin is not None and hmac.compare_digest(token.encode(), self._admin.encode())

    async def login(self, token: str) -> str:
        """A new session id for ``token``; ``DeniedError`` for a missing, unknown or revoked
        token (the message never repeats the token)."""
        token = token.strip()
        if not token:
            raise DeniedError(400, "token: missing; paste your tenant's bearer token")
        admin = self.is_admin(token)
        if not admin:
            await self._tenant(token)
        sid = secrets.token_urlsafe(32)
        now = self._clock()
        self._sessions[sid] = Session(token, admin, secrets.token_urlsafe(16), now, now)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return sid

    def logout(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    async def viewer(self, sid: str | None) -> Viewer:
        """The viewer of session ``sid``; ``DeniedError(401)`` when there is none (expired,
        logged out, never logged in) or its token no longer holds."""
        session = self._sessions.get(sid) if sid else None
        now = self._clock()
        if session is not None and (
            now - session.seen > self.idle_s or now - session.created > self.max_age_s
        ):
            self.logout(sid or "")
            session = None
        if session is None:
            raise DeniedError(401, "not logged in (or the session expired): log in with your token")
        session.seen = now
        if session.admin:
            return Viewer(None, session.csrf)
        try:
            tenant = await self._tenant(session.token)
        except DeniedError as denied:
            if denied.status != 503:  # the token no longer holds (503: try again)
                self.logout(sid or "")
            raise
        return Viewer(tenant, session.csrf)

    async def _tenant(self, token: str) -> Tenant:
        try:
            tenant = await self.tenants.tenant(token)
        except OverloadedError as error:  # too many lookups of unknown tokens at once
            raise DeniedError(503, f"{error}") from None
        except StorageError:
            raise DeniedError(503, "the database is unavailable: try again shortly") from None
        if tenant is None:
            raise DeniedError(401, "unknown token: no tenant holds it")
        if tenant.revoked_at is not None:
            raise DeniedError(403, f"the token of tenant {tenant.name!r} was revoked")
        return tenant


def new_login_token() -> str:
    return secrets.token_urlsafe(24)


def login_token_matches(form_value: str | None, cookie_value: str | None) -> bool:
    """Whether the login form's hidden token equals its cookie (both present)."""
    if not form_value or not cookie_value:
        return False
    return hmac.compare_digest(form_value.encode(), cookie_value.encode())
