"""The console's Starlette application: pages, their JSON, login, and security headers.

Every page has a JSON twin under ``/api`` (same query) that the page's script polls to
redraw its charts. Query parameters name the tenant and tool (``?tenant=…&name=…``),
never a token. Every response carries a strict Content-Security-Policy (scripts and
styles from this origin only, no inline code), ``X-Frame-Options: DENY``, ``nosniff``,
``Referrer-Policy: no-referrer`` and, but for static files, ``Cache-Control: no-store``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.console import views
from controlplane.console.sessions import (
    COOKIE,
    LOGIN_COOKIE,
    DeniedError,
    Sessions,
    Viewer,
    login_token_matches,
    new_login_token,
)
from controlplane.records import LIMITS, Tenant

__all__ = ["SECURITY_HEADERS", "make_app"]

HERE = Path(__file__).parent
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
#: Builds a page's data: its template and the data (the JSON twin answers the data).
_Handler = Callable[[Request, Viewer], Awaitable[tuple[str, dict[str, Any]]]]
#: Seconds between a page's refreshes of its charts.
POLL_S = 5


class SecurityHeaders:
    """ASGI middleware adding ``SECURITY_HEADERS`` (and HSTS over TLS) to every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"cache-control"]
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                cache = "public, max-age=3600" if static else "no-store"
                headers.append((b"cache-control", cache.encode()))
                if scope.get("scheme") == "https":
                    headers.append((b"strict-transport-security", b"max-age=31536000"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def _int(request: Request, name: str, default: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= high:
        raise DeniedError(400, f"{name}: must be a whole number in 1..{high}, got {raw[:40]!r}")
    return int(raw)


def _text(request: Request, name: str, limit: int) -> str:
    value = request.query_params.get(name, "")
    if len(value) > limit or "\x00" in value:
        raise DeniedError(400, f"{name}: must be at most {limit} characters, without NUL")
    return value


def make_app(src: views.Sources, sessions: Sessions) -> Starlette:
    """The console over ``src``, with viewers from ``sessions``."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))

    def page(request: Request, name: str, status: int = 200, **context: Any) -> Response:
        context.setdefault("poll_s", POLL_S)
        return templates.TemplateResponse(request, name, context, status_code=status)

    async def viewer_of(request: Request) -> Viewer:
        return await sessions.viewer(request.cookies.get(COOKIE))

    async def tenant_of(request: Request, viewer: Viewer) -> Tenant:
        """The tenant a page names (``?tenant=``), if the viewer may see it; another
        tenant's name is answered exactly like a name nobody holds."""
        name = _text(request, "tenant", LIMITS.tenant_name)
        if viewer.tenant is not None:
            if name in ("", viewer.tenant.name):
                return viewer.tenant
        elif name:
            for t in await run_in_threadpool(src.plane.store.list_tenants):
                if t.name == name:
                    return t
        raise DeniedError(404, f"no tenant named {name!r} to show" if name else "tenant: missing")

    def routes_of(path: str, build: _Handler) -> list[Route]:
        """The page at ``path`` and its JSON twin at ``/api`` + ``path``."""

        async def html(request: Request) -> Response:
            try:
                viewer = await viewer_of(request)
                template, data = await build(request, viewer)
            except DeniedError as denied:
                return _denied_page(request, denied)
            api = "/api" + path + ("?" + request.url.query if request.url.query else "")
            return page(request, template, viewer=viewer, data=data, api=api)

        async def api(request: Request) -> Response:
            try:
                _, data = await build(request, await viewer_of(request))
            except DeniedError as denied:
                return JSONResponse({"error": denied.message}, denied.status)
            return JSONResponse(data)

        return [Route(path, html), Route("/api" + path, api)]

    def _denied_page(request: Request, denied: DeniedError) -> Response:
        if denied.status == 401:
            return _login_page(request, denied.message, 401)
        return page(request, "error.html", denied.status, message=denied.message, viewer=None)

    def _login_page(request: Request, message: str = "", status: int = 200) -> Response:
        token = new_login_token()
        response = page(request, "login.html", status, message=message, login=token)
        _cookie(request, response, LOGIN_COOKIE, token, path="/login")
        return response

    async def login_form(request: Request) -> Response:
        return _login_page(request)

    async def login(request: Request) -> Response:
        form = await request.form(max_files=0, max_fields=4)
        field, token = form.get("login"), form.get("token")
        if not login_token_matches(
            field if isinstance(field, str) else None, request.cookies.get(LOGIN_COOKIE)
        ):
            message = "the login form expired or came from another site; log in again"
            return page(request, "error.html", 403, message=message, viewer=None)
        try:
            sid = await sessions.login(token if isinstance(token, str) else "")
        except DeniedError as denied:
            return _login_page(request, denied.message, denied.status)
        response = RedirectResponse("/", 303)
        _cookie(request, response, COOKIE, sid)
        _cookie(request, response, LOGIN_COOKIE, "", path="/login", max_age=0)
        return response

    async def logout(request: Request) -> Response:
        sid = request.cookies.get(COOKIE)
        try:
            viewer = await sessions.viewer(sid)
        except DeniedError:
            return RedirectResponse("/login", 303)
        form = await request.form(max_files=0, max_fields=2)
        field = form.get("csrf")
        if isinstance(field, str) and login_token_matches(field, viewer.csrf):
            sessions.logout(sid or "")
        response = RedirectResponse("/login", 303)
        _cookie(request, response, COOKIE, "", max_age=0)
        return response

    async def home(request: Request) -> Response:
        try:
            viewer = await viewer_of(request)
        except DeniedError as denied:
            return _denied_page(request, denied)
        return RedirectResponse("/tenants" if viewer.admin else "/tools", 303)

    async def tenants(request: Request, viewer: Viewer) -> tuple[str, dict[str, Any]]:
        if not viewer.admin:
            raise DeniedError(404, "the tenants page is the admin's")
        return "tenants.html", await run_in_threadpool(views.tenants, src)

    async def tools(request: Request, viewer: Viewer) -> tuple[str, dict[str, Any]]:
        tenant = await tenant_of(request, viewer)
        q = _text(request, "q", 200)
        sort = request.query_params.get("sort", "name")
        if sort not in ("name", "calls"):
            raise DeniedError(400, f"sort: must be 'name' or 'calls', got {sort[:40]!r}")
        page_no = _int(request, "page", 1, 10**6)
        data = await run_in_threadpool(views.tools, src, tenant.name, q, sort, page_no)
        return "tools.html", data

    async def tool(request: Request, viewer: Viewer) -> tuple[str, dict[str, Any]]:
        tenant = await tenant_of(request, viewer)
        name = _text(request, "name", LIMITS.tool_name)
        sig = _text(request, "sig", LIMITS.tool_args)
        q = _text(request, "q", 200)
        page_no = _int(request, "page", 1, 10**6)
        context = _int(request, "context", views.CONTEXT_TOKENS, LIMITS.context_tokens)
        data = await run_in_threadpool(views.tool, src, tenant, name, sig, q, page_no, context)
        if data is None:
            what = f"signature {sig!r} of tool {name!r}" if sig else f"tool {name!r}"
            raise DeniedError(404, f"tenant {tenant.name!r} has no {what}")
        return "tool.html", data

    async def shared(request: Request, viewer: Viewer) -> tuple[str, dict[str, Any]]:
        tenant = await tenant_of(request, viewer)
        name = _text(request, "name", LIMITS.tool_name)
        page_no = _int(request, "page", 1, 10**6)
        data = await run_in_threadpool(views.shared, src, tenant, name, page_no)
        if name and data.get("distribution") is None:
            raise DeniedError(404, f"no shared model of tool {name!r} is published to this tenant")
        return "shared.html", data

    async def workload(request: Request, viewer: Viewer) -> tuple[str, dict[str, Any]]:
        tenant = await tenant_of(request, viewer)
        return "workload.html", await run_in_threadpool(views.workload, src, tenant.name)

    async def engines(request: Request, viewer: Viewer) -> tuple[str, dict[str, Any]]:
        tenant = await tenant_of(request, viewer)
        return "engines.html", views.engines(src, tenant)  # memory only, on the loop

    async def not_found(request: Request, exc: Exception) -> Response:
        return page(request, "error.html", 404, message="no such page", viewer=None)

    routes: list[Route | Mount] = [
        Route("/", home),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ]
    for path, build in (
        ("/tenants", tenants),
        ("/tools", tools),
        ("/tool", tool),
        ("/shared", shared),
        ("/workload", workload),
        ("/engines", engines),
    ):
        routes += routes_of(path, build)
    routes.append(Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"))
    app = Starlette(routes=routes, exception_handlers={404: not_found})
    app.add_middleware(SecurityHeaders)
    return app


def _cookie(
    request: Request,
    response: Response,
    name: str,
    value: str,
    path: str = "/",
    max_age: int | None = None,
) -> None:
    """Set (or with ``max_age=0`` delete) a cookie scripts cannot read, sent to this
    site only, and only over TLS when the console is served over TLS."""
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=path,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
