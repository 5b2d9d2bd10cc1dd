"""Who sees what through the console, over HTTP against a real server (no browser).

Every page and JSON route the application has is tried (the list comes from the app, so a
new route is tried too) with another tenant's session, with no session, and for the admin.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.parse
from collections.abc import Callable

import pytest
from sqlalchemy import create_engine, text
from starlette.routing import Route

from controlplane.console.bench import Client
from controlplane.console.host import Console, ConsoleOptions
from controlplane.rpc.server import ServerOptions
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from tests.console.conftest import ADMIN, ENGINES, RIVAL_MARKERS, Cluster, _calls
from tests.controlplane.conftest import PG_BASE, pg_url
from tests.support import ServerThread

#: Query strings that name the rival's tenant, tool and signature.
RIVAL_QUERIES: tuple[dict[str, str], ...] = (
    {"tenant": "rival"},
    {"tenant": "rival", "name": "rival-secret-tool"},
    {"tenant": "rival", "name": "rival-secret-tool", "sig": "rivalsig"},
    {"tenant": "rival", "name": "bash", "q": "rival"},
    {"name": "rival-secret-tool"},
    {"name": "bash", "sig": "rivalsig"},
    {"name": "bash", "q": "rivalsig"},
    {"q": "rival"},
    {},
)


def _get_routes(cluster: Cluster) -> list[str]:
    paths = [
        r.path
        for r in cluster.console.app.routes
        if isinstance(r, Route) and r.methods and "GET" in r.methods and r.path != "/login"
    ]
    assert {"/tools", "/api/tool", "/engines", "/api/shared", "/tenants"} <= set(paths)
    return paths


def _names_the_rival(path: str, query: dict[str, str]) -> bool:
    """Whether the page asked for is the rival's (its tenant, tool or signature)."""
    return (
        query.get("tenant") == "rival"
        or path.endswith("/tenants")
        or (path.endswith(("/tool", "/shared")) and query.get("name") == "rival-secret-tool")
        or (path.endswith("/tool") and query.get("sig") == "rivalsig")
    )


def _leaks(body: bytes, asked: str = "") -> list[str]:
    """The rival's markers in ``body``, but for those the request itself named (a page
    may repeat its own query, e.g. in its search box)."""
    text = body.decode(errors="replace")
    return [m for m in RIVAL_MARKERS if m in text and m not in asked]


def test_no_route_shows_another_tenants_statistics(cluster: Cluster) -> None:
    acme = cluster.client("acme")
    tried = 0
    for path in _get_routes(cluster):
        for query in RIVAL_QUERIES:
            target = path + ("?" + urllib.parse.urlencode(query) if query else "")
            status, body = acme.get(target)
            tried += 1
            leaks = _leaks(body, urllib.parse.unquote_plus(target))
            assert not leaks, f"{target} answered {status} with {leaks}"
            assert len(body) < 300_000, target  # paged and thinned, never whole models
            if path == "/":  # to the viewer's own first page
                assert status == 303, target
            elif _names_the_rival(path, query):
                assert status == 404, target
    assert tried >= 9 * 13
    # the same routes do show the rival's statistics to the rival: the markers are real
    rival = cluster.client("rival")
    status, body = rival.get("/tool?name=rival-secret-tool&sig=rivalsig")
    assert status == 200
    assert set(_leaks(body)) >= {"rival-secret-tool", "rivalsig"}
    assert "rival-engine" in rival.get("/api/engines")[1].decode()


def test_another_tenant_is_answered_like_a_tenant_nobody_holds(cluster: Cluster) -> None:
    acme = cluster.client("acme")
    rival = acme.get("/api/tools?tenant=rival")
    nobody = acme.get("/api/tools?tenant=nobody")
    assert rival[0] == nobody[0] == 404
    assert json.loads(rival[1])["error"].replace("rival", "X") == json.loads(nobody[1])[
        "error"
    ].replace("nobody", "X")


def test_a_tenant_sees_its_own_and_the_published_shared_models(cluster: Cluster) -> None:
    acme = cluster.client("acme")
    tools = json.loads(acme.get("/api/tools")[1])
    assert [t["name"] for t in tools["tools"]] == ["bash", "find"]
    shared = json.loads(acme.get("/api/shared")[1])
    assert [t["name"] for t in shared["tools"]] == ["grep"]
    grep = json.loads(acme.get("/api/shared?name=grep")[1])
    assert grep["distribution"]["samples"] > 0
    # a tenant that does not share is shown none
    rival = json.loads(cluster.client("rival").get("/api/shared")[1])
    assert rival["share"] is False
    assert rival["tools"] == []


def test_engines_show_links_moves_and_the_snapshot_streamed(cluster: Cluster) -> None:
    data = json.loads(cluster.client("acme").get("/api/engines")[1])
    engines = {e["name"]: e for e in data["engines"]}
    assert set(engines) == {"engine-a", "engine-b"}
    assert engines["engine-a"]["engine"] == ENGINES["engine-a"]  # the id the hook reported
    assert len(engines["engine-a"]["instance"]) == 6
    assert engines["engine-b"]["watching"] == 1
    assert engines["engine-b"]["moves"] == 3  # the three programs that left it
    assert engines["engine-a"]["programs"] == 3
    assert data["snapshot_sent"] is not None
    assert data["snapshot_lag"] == data["version"] - data["snapshot_sent"]
    assert data["streams"] >= 1


def test_the_admin_sees_every_tenant(cluster: Cluster) -> None:
    admin = cluster.client(None)
    names = [t["name"] for t in json.loads(admin.get("/api/tenants")[1])["tenants"]]
    assert names == ["acme", "rival", "s0", "s1", "s2", "s3"]
    status, body = admin.get("/tool?tenant=rival&name=rival-secret-tool")
    assert status == 200
    assert b"rival-secret-tool" in body


def test_without_a_session_every_route_answers_401(cluster: Cluster) -> None:
    anonymous = Client(cluster.port)
    for path in _get_routes(cluster):
        status, body = anonymous.get(path + "?tenant=acme&name=bash")
        assert status == 401, path
        assert b"bash" not in body.replace(b"bearer", b"")
        if path.startswith("/api/"):
            assert "log in" in json.loads(body)["error"]
        else:
            assert b'action="/login"' in body
            assert b"not logged in" in body


@pytest.mark.parametrize(
    ("token", "status", "message"),
    [
        ("cttl_not-a-token", 401, b"unknown token"),
        ("", 400, b"token: missing"),
    ],
)
def test_a_bad_or_missing_token_gets_a_clear_page(
    cluster: Cluster, token: str, status: int, message: bytes
) -> None:
    client = Client(cluster.port)
    assert client.login(token) == status
    _, login_page = client.get("/login")
    field = re.search(rb'name="login" value="([^"]+)"', login_page)
    assert field is not None
    answer = client.request("POST", "/login", {"login": field.group(1).decode(), "token": token})
    assert answer[0] == status
    assert message in answer[2]
    assert "cttl_session" not in client.cookies


def test_a_revoked_token_ends_its_session(cluster: Cluster) -> None:
    plane = cluster.plane
    _, token = plane.create_tenant("soon-gone")
    client = Client(cluster.port)
    assert client.login(token) == 303
    assert client.get("/api/tools")[0] == 200
    plane.store.revoke_tenant("soon-gone", 0.0)
    cluster.thread.server._servicer.tenants._entries.clear()  # as after its fresh age
    status, body = client.get("/tools")
    assert status == 403
    assert b"was revoked" in body
    assert client.get("/api/tools")[0] == 401  # the session ended with it


def test_login_posts_from_elsewhere_are_refused(cluster: Cluster) -> None:
    client = Client(cluster.port)  # never loaded the form: no login cookie
    status, _, body = client.request(
        "POST", "/login", {"login": "guessed", "token": cluster.tokens["acme"]}
    )
    assert status == 403
    assert b"another site" in body
    assert "cttl_session" not in client.cookies
    client.get("/login")  # a cookie, but another form's value
    status, _, _ = client.request(
        "POST", "/login", {"login": "guessed", "token": cluster.tokens["acme"]}
    )
    assert status == 403


def test_cookies_headers_and_logs_keep_the_token_out(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = cluster.tokens["acme"]
    client = Client(cluster.port)
    _, form_headers, _ = client.request("GET", "/login")
    field = client.cookies["cttl_login"]
    status, headers, _ = client.request("POST", "/login", {"login": field, "token": token})
    assert status == 303
    assert headers["location"] == "/"
    cookie = next(c for c in headers["set-cookie"].splitlines() if c.startswith("cttl_session="))
    assert token not in headers["set-cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert "Secure" not in cookie  # plain HTTP here; see the TLS test
    for target in ("/tools", "/api/tool?name=bash", "/static/console.js", "/nowhere"):
        _, page_headers, _ = client.request("GET", target)
        for h in (form_headers, page_headers):
            csp = h["content-security-policy"]
            assert "unsafe-inline" not in csp
            assert "unsafe-eval" not in csp
            assert "script-src 'self'" in csp
            assert "frame-ancestors 'none'" in csp
            assert h["x-frame-options"] == "DENY"
            assert h["x-content-type-options"] == "nosniff"
            assert h["referrer-policy"] == "no-referrer"
    assert token not in caplog.text
    assert caplog.records  # the access log did log the requests


def test_the_database_away_gets_a_clear_answer(pg_schemas: Callable[[], str]) -> None:
    """While the database is away, a page that must read it answers 503 saying so, a
    login that must look its token up too; pages of what is in memory still answer, and
    sessions outlive the outage."""
    schema = pg_schemas()
    store = create_store(pg_url(schema))
    plane = ControlPlane(store)
    tenant, token = plane.create_tenant("acme")
    plane.record_tool_calls(tenant, _calls("acme", "bash", ["ls"], 50, 1))
    thread = ServerThread(plane, ServerOptions(listen="127.0.0.1:0"))
    console = Console(thread.server, ConsoleOptions("127.0.0.1:0", ADMIN))
    port = thread.run(console.start())
    engine = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    try:
        acme, admin, newcomer = Client(port), Client(port), Client(port)
        assert acme.login(token) == 303
        assert admin.login(ADMIN) == 303
        assert acme.get("/tool?name=bash")[0] == 200
        with engine.connect() as c:
            c.execute(text(f"ALTER SCHEMA {schema} RENAME TO {schema}_away"))
        status, body = admin.get("/api/tenants")
        assert status == 503
        assert "database is unavailable" in json.loads(body)["error"]
        assert b"database is unavailable" in admin.get("/tenants")[1]
        assert newcomer.login("cttl_unknown-token") == 503
        assert acme.get("/api/tool?name=bash")[0] == 200  # nothing new: reads reused
        assert acme.get("/api/workload")[0] == 200
        with engine.connect() as c:
            c.execute(text(f"ALTER SCHEMA {schema}_away RENAME TO {schema}"))
        assert admin.get("/api/tenants")[0] == 200
    finally:
        engine.dispose()
        thread.run(console.stop())
        thread.stop()
        store.close()
