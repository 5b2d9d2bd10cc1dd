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

Sessions are bounded per tenant (:class:`SessionLimits`): a tenant's new login ends only
that tenant's oldest session past ``per_tenant``, the admin's sessions are a group of their
own, and past ``total`` sessions in all a login is refused (503) rather than ending
anyone's. Logins are rate-limited (token buckets, :class:`RateLimit`): every attempt per
source address, failed attempts per source address (checked *before* the token is looked
up, so that a guessing client costs no lookup once over its budget) and successful logins
per tenant (the admin counting as one); over a budget the answer is 429 with
``Retry-After``.

A tenant sees its own statistics and, if it shares, the published shared models (the
published, k-anonymous, quantised aggregates, :mod:`controlplane.sharing`); any other
tenant's name is answered as not found. The admin sees every tenant.
"""

from __future__ import annotations

import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.errors import OverloadedError, StorageError
from controlplane.records import Tenant
from controlplane.rpc.auth import TenantCache

__all__ = [
    "COOKIE",
    "LOGIN_COOKIE",
    "MAX_TOKEN_CHARS",
    "DeniedError",
    "RateLimit",
    "Session",
    "SessionLimits",
    "Sessions",
    "Viewer",
]

COOKIE = "cttl_session"
LOGIN_COOKIE = "cttl_login"
#: The longest token looked up (longer ones are refused as failed logins, unread).
MAX_TOKEN_CHARS = 512
#: The admin's session group (no tenant name holds a NUL).
_ADMIN = "\0admin"


class DeniedError(Exception):
    """The viewer may not see the page: ``status`` and a message for the error page
    (``retry_after``: seconds, for a 429 or 503)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class RateLimit:
    """A token bucket: ``burst`` at once, refilled at ``per_minute``."""

    burst: int
    per_minute: float

    def __post_init__(self) -> None:
        if self.burst < 1 or not self.per_minute > 0:
            raise ValueError("a login rate needs burst >= 1 and per_minute > 0")


@dataclass(frozen=True)
class SessionLimits:
    """How many sessions, for how long, and how fast logins may come."""

    per_tenant: int = 64
    admin: int = 32
    total: int = 100_000
    idle_s: float = 1800.0
    max_age_s: float = 12 * 3600.0
    logins_per_source: RateLimit = field(default_factory=lambda: RateLimit(30, 30.0))
    failures_per_source: RateLimit = field(default_factory=lambda: RateLimit(10, 10.0))
    logins_per_tenant: RateLimit = field(default_factory=lambda: RateLimit(30, 30.0))
    #: Sources (and tenants) whose buckets are remembered (least recently used dropped).
    max_buckets: int = 10_000

    def __post_init__(self) -> None:
        if min(self.per_tenant, self.admin, self.total, self.max_buckets) < 1:
            raise ValueError("session caps must be >= 1")


class _Buckets:
    """Token buckets by key, the least recently used forgotten past ``max_keys`` (a
    forgotten key starts full again: its burst, no more)."""

    def __init__(self, rate: RateLimit, max_keys: int, clock: Callable[[], float]) -> None:
        self.rate, self.max_keys, self.clock = rate, max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, key: str) -> tuple[float, float]:
        now = self.clock()
        tokens, then = self._buckets.get(key, (float(self.rate.burst), now))
        refill = (now - then) * self.rate.per_minute / 60.0
        return min(float(self.rate.burst), tokens + refill), now

    def wait_s(self, key: str) -> int:
        """Seconds until ``key`` has a token (0: it has one now); takes nothing."""
        tokens, _ = self._level(key)
        if tokens >= 1.0:
            return 0
        return max(1, math.ceil((1.0 - tokens) * 60.0 / self.rate.per_minute))

    def take(self, key: str) -> int:
        """Take a token of ``key``: 0 if there was one, else the seconds to wait."""
        tokens, now = self._level(key)
        if tokens < 1.0:
            return max(1, math.ceil((1.0 - tokens) * 60.0 / self.rate.per_minute))
        self._buckets[key] = (tokens - 1.0, now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return 0


def _too_many(what: str, wait_s: int) -> DeniedError:
    return DeniedError(429, f"too many {what}: try again in {wait_s} s", retry_after=wait_s)


@dataclass
class Session:
    token: str
    admin: bool
    csrf: str
    created: float
    seen: float
    group: str = _ADMIN


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
    """Logged-in viewers, in memory, bounded per tenant (each tenant's oldest dropped
    first) and in all; logins rate-limited (:class:`SessionLimits`)."""

    def __init__(
        self,
        tenants: TenantCache,
        admin_token: str | None = None,
        limits: SessionLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tenants = tenants
        self._admin = admin_token
        self.limits = limits = limits or SessionLimits()
        self.idle_s = limits.idle_s
        self.max_age_s = limits.max_age_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._groups: dict[str, OrderedDict[str, None]] = {}
        keys = limits.max_buckets
        self._by_source = _Buckets(limits.logins_per_source, keys, clock)
        self._failures = _Buckets(limits.failures_per_source, keys, clock)
        self._by_tenant = _Buckets(limits.logins_per_tenant, keys, clock)

    def __len__(self) -> int:
        return len(self._sessions)

    def known(self, sid: str) -> bool:
        """Whether ``sid`` is a session id held now (valid or not yet found expired)."""
        return sid in self._sessions

    def sessions_of(self, tenant: str | None) -> int:
        """How many sessions ``tenant`` (None: the admin) holds."""
        return len(self._groups.get(_ADMIN if tenant is None else tenant, ()))

    def is_admin(self, token: str) -> bool:
        return self._admin is not None and hmac.compare_digest(token.encode(), self._admin.encode())

    async def login(self, token: str, source: str = "") -> str:
        """A new session id for ``token`` from client address ``source``; ``DeniedError``
        for a missing, unknown or revoked token (the message never repeats the token),
        429 past a login rate, 503 when every session slot is taken."""
        token = token.strip()
        if not token:
            raise DeniedError(400, "token: missing; paste your tenant's bearer token")
        wait = self._by_source.take(source) or self._failures.wait_s(source)
        if wait:
            raise _too_many(f"logins from {source or 'this address'}", wait)
        try:
            if len(token) > MAX_TOKEN_CHARS:
                raise DeniedError(401, "unknown token: no tenant holds it")
            admin = self.is_admin(token)
            group = _ADMIN if admin else (await self._tenant(token)).name
        except DeniedError as denied:
            if denied.status in (401, 403):
                self._failures.take(source)
            raise
        wait = self._by_tenant.take(group)
        if wait:
            raise _too_many(f"logins of {'the admin' if admin else 'tenant ' + repr(group)}", wait)
        mine = self._groups.setdefault(group, OrderedDict())
        cap = self.limits.admin if admin else self.limits.per_tenant
        while len(mine) >= cap:
            self.logout(next(iter(mine)))
            mine = self._groups.setdefault(group, OrderedDict())
        if len(self._sessions) >= self.limits.total:
            raise DeniedError(503, "every console session is taken: try again later", 60)
        sid = secrets.token_urlsafe(32)
        now = self._clock()
        self._sessions[sid] = Session(token, admin, secrets.token_urlsafe(16), now, now, group)
        mine[sid] = None
        return sid

    def logout(self, sid: str) -> None:
        session = self._sessions.pop(sid, None)
        if session is None:
            return
        mine = self._groups.get(session.group)
        if mine is not None:
            mine.pop(sid, None)
            if not mine:
                del self._groups[session.group]

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
