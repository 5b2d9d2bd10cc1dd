"""What each console page shows, from its query: the checks of its parameters and the
viewer's right to the tenant it names, then its data (:mod:`controlplane.console.views`).

Each builder answers ``(template, data)``; the app renders the page from both and answers
the data alone as the page's JSON twin. A parameter that is bad raises ``DeniedError(400)``
naming it; a tenant, tool or signature the viewer may not see, or that does not exist,
raises ``DeniedError(404)`` with the same words either way.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from controlplane.console import overview, views
from controlplane.console.sessions import DeniedError, Viewer
from controlplane.records import LIMITS, Tenant

__all__ = ["PAGES", "Pages"]

#: Longest search text (characters).
SEARCH_CHARS = 200
Built = tuple[str, dict[str, Any]]


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


class Pages:
    """The page builders over one console's sources."""

    def __init__(self, src: views.Sources) -> None:
        self.src = src

    async def tenant_of(self, request: Request, viewer: Viewer) -> Tenant:
        """The tenant a page names (``?tenant=``), if the viewer may see it; another
        tenant's name is answered exactly like a name nobody holds."""
        name = _text(request, "tenant", LIMITS.tenant_name)
        if viewer.tenant is not None:
            if name in ("", viewer.tenant.name):
                return viewer.tenant
        elif name:
            for t in await run_in_threadpool(self.src.plane.store.list_tenants):
                if t.name == name:
                    return t
        raise DeniedError(404, f"no tenant named {name!r} to show" if name else "tenant: missing")

    async def tenants(self, request: Request, viewer: Viewer) -> Built:
        if not viewer.admin:
            raise DeniedError(404, "the tenants page is the admin's")
        return "tenants.html", await run_in_threadpool(overview.tenants, self.src)

    async def tools(self, request: Request, viewer: Viewer) -> Built:
        tenant = await self.tenant_of(request, viewer)
        q = _text(request, "q", SEARCH_CHARS)
        sort = request.query_params.get("sort", "name")
        if sort not in ("name", "calls"):
            raise DeniedError(400, f"sort: must be 'name' or 'calls', got {sort[:40]!r}")
        page = _int(request, "page", 1, 10**6)
        data = await run_in_threadpool(views.tools, self.src, tenant.name, q, sort, page)
        return "tools.html", data

    async def tool(self, request: Request, viewer: Viewer) -> Built:
        tenant = await self.tenant_of(request, viewer)
        name = _text(request, "name", LIMITS.tool_name)
        sig = _text(request, "sig", LIMITS.tool_args)
        q = _text(request, "q", SEARCH_CHARS)
        page = _int(request, "page", 1, 10**6)
        context = _int(request, "context", views.CONTEXT_TOKENS, LIMITS.context_tokens)
        data = await run_in_threadpool(views.tool, self.src, tenant, name, sig, q, page, context)
        if data is None:
            what = f"signature {sig!r} of tool {name!r}" if sig else f"tool {name!r}"
            raise DeniedError(404, f"tenant {tenant.name!r} has no {what}")
        return "tool.html", data

    async def shared(self, request: Request, viewer: Viewer) -> Built:
        tenant = await self.tenant_of(request, viewer)
        name = _text(request, "name", LIMITS.tool_name)
        page = _int(request, "page", 1, 10**6)
        data = await run_in_threadpool(overview.shared, self.src, tenant, name, page)
        if name and data.get("distribution") is None:
            raise DeniedError(404, f"no shared model of tool {name!r} is published to this tenant")
        return "shared.html", data

    async def workload(self, request: Request, viewer: Viewer) -> Built:
        tenant = await self.tenant_of(request, viewer)
        return "workload.html", await run_in_threadpool(overview.workload, self.src, tenant.name)

    async def engines(self, request: Request, viewer: Viewer) -> Built:
        tenant = await self.tenant_of(request, viewer)
        return "engines.html", overview.engines(self.src, tenant)  # memory only, on the loop


#: The pages: path → builder name (each also answers its data at ``/api`` + path).
PAGES = {
    "/tenants": "tenants",
    "/tools": "tools",
    "/tool": "tool",
    "/shared": "shared",
    "/workload": "workload",
    "/engines": "engines",
}
