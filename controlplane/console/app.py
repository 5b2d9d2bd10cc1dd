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
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.console import views
from controlplane.console.pages import PAGES, Pages
from controlplane.console.sessions import (
    COOKIE,
    LOGIN_COOKIE,
    DeniedError,
    Sessions,
    Viewer,
    login_token_matches,
    new_login_token,
)
from controlplane.errors import StorageError

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


class _Console:
    """The plumbing of one console: sessions, templates, login and the pages' routes."""

    def __init__(self, src: views.Sources, sessions: Sessions) -> None:
        self.sessions = sessions
        self.pages = Pages(src)
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))

    def page(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        context.setdefault("poll_s", POLL_S)
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    async def viewer_of(self, request: Request) -> Viewer:
        return await self.sessions.viewer(request.cookies.get(COOKIE))

    def routes_of(self, path: str, build: _Handler) -> list[Route]:
        """The page at ``path`` and its JSON twin at ``/api`` + ``path``."""

        async def built(request: Request) -> tuple[Viewer, str, dict[str, Any]]:
            viewer = await self.viewer_of(request)
            try:
                template, data = await build(request, viewer)
            except StorageError:
                raise DeniedError(503, "the database is unavailable: try again shortly") from None
            return viewer, template, data

        async def html(request: Request) -> Response:
            try:
                viewer, template, data = await built(request)
            except DeniedError as denied:
                return self.denied_page(request, denied)
            api = "/api" + path + ("?" + request.url.query if request.url.query else "")
            return self.page(request, template, viewer=viewer, data=data, api=api)

        async def api(request: Request) -> Response:
            try:
                _, _, data = await built(request)
            except DeniedError as denied:
                return _retry(JSONResponse({"error": denied.message}, denied.status), denied)
            return JSONResponse(data)

        return [Route(path, html), Route("/api" + path, api)]

    def denied_page(self, request: Request, denied: DeniedError) -> Response:
        if denied.status == 401:
            return self.login_page(request, denied.message, 401)
        return _retry(self.error(request, denied.status, denied.message), denied)

    def error(self, request: Request, status: int, message: str) -> Response:
        return self.page(request, "error.html", status, message=message, viewer=None)

    def login_page(self, request: Request, message: str = "", status: int = 200) -> Response:
        token = new_login_token()
        response = self.page(request, "login.html", status, message=message, login=token)
        _cookie(request, response, LOGIN_COOKIE, token, path="/login")
        return response

    async def login_form(self, request: Request) -> Response:
        return self.login_page(request)

    async def login(self, request: Request) -> Response:
        form = await request.form(max_files=0, max_fields=4)
        field, token = form.get("login"), form.get("token")
        if not login_token_matches(
            field if isinstance(field, str) else None, request.cookies.get(LOGIN_COOKIE)
        ):
            message = "the login form expired or came from another site; log in again"
            return self.error(request, 403, message)
        source = request.client.host if request.client else ""
        try:
            sid = await self.sessions.login(token if isinstance(token, str) else "", source)
        except DeniedError as denied:
            return _retry(self.login_page(request, denied.message, denied.status), denied)
        response = RedirectResponse("/", 303)
        _cookie(request, response, COOKIE, sid)
        _cookie(request, response, LOGIN_COOKIE, "", path="/login", max_age=0)
        return response

    async def logout(self, request: Request) -> Response:
        sid = request.cookies.get(COOKIE)
        try:
            viewer = await self.sessions.viewer(sid)
        except DeniedError:
            return RedirectResponse("/login", 303)
        form = await request.form(max_files=0, max_fields=2)
        field = form.get("csrf")
        if isinstance(field, str) and login_token_matches(field, viewer.csrf):
            self.sessions.logout(sid or "")
        response = RedirectResponse("/login", 303)
        _cookie(request, response, COOKIE, "", max_age=0)
        return response

    async def home(self, request: Request) -> Response:
        try:
            viewer = await self.viewer_of(request)
        except DeniedError as denied:
            return self.denied_page(request, denied)
        return RedirectResponse("/tenants" if viewer.admin else "/tools", 303)

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return self.error(request, 404, "no such page")


def make_app(src: views.Sources, sessions: Sessions) -> Starlette:
    """The console over ``src``, with viewers from ``sessions``."""
    console = _Console(src, sessions)
    routes: list[Route | Mount] = [
        Route("/", console.home),
        Route("/login", console.login_form, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
    ]
    for path, builder in PAGES.items():
        routes += console.routes_of(path, getattr(console.pages, builder))
    routes.append(Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"))
    app = Starlette(routes=routes, exception_handlers={404: console.not_found})
    app.add_middleware(SecurityHeaders)
    return app


def _retry(response: Response, denied: DeniedError) -> Response:
    """``response`` with ``Retry-After`` when ``denied`` says when to try again."""
    if denied.retry_after is not None:
        response.headers["retry-after"] = str(denied.retry_after)
    return response


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
