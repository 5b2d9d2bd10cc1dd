"""The console in a real browser: Playwright's client driving Debian's Chromium.

Logs in as a tenant, opens a tool, checks that the CDF and its TTL line are drawn and a
miss reason is listed, that another tenant's tool is absent and its page refused, that
engines are listed by name, that a tool in its cold start says so and keeps its TTL line on
the chart, and that the browser reports no error (a Content-Security-Policy violation would
be one). Takes
screenshots of the main pages; with ``CACHETTL_UPDATE_SCREENSHOTS=1`` they replace the
documentation's (docs/img/console/).
"""

from __future__ import annotations

import os
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Response, sync_playwright

from tests.console.conftest import ADMIN, LINT_CALLS, Cluster

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "img" / "console"
#: Counts the TTL line's pixels (its colour, #d1495b) on a chart's canvas.
RED_PIXELS = """el => {
  const c = el.querySelector('canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (d[i] > 180 && d[i + 1] > 50 && d[i + 1] < 100 && d[i + 2] > 70 && d[i + 2] < 120) n++;
  return n;
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: scripts/setup installs Debian's chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Iterator[Path]:
    """Where screenshots go; copied to the docs with CACHETTL_UPDATE_SCREENSHOTS=1."""
    yield tmp_path
    if os.environ.get("CACHETTL_UPDATE_SCREENSHOTS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        for png in tmp_path.glob("*.png"):
            shutil.copy(png, DOCS / png.name)


def _page(browser: Browser, errors: list[str]) -> Page:
    """A new page whose errors go to ``errors``: the browser's (a script's, a blocked
    resource's) and, as ``STATUS PATH``, every answer of 400 or more."""
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()

    def console(message: ConsoleMessage) -> None:
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            errors.append(message.text)

    def response(answer: Response) -> None:
        if answer.status >= 400:
            url = urllib.parse.urlsplit(answer.url)
            errors.append(f"{answer.status} {url.path}?{url.query}")

    page.on("console", console)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", response)
    return page


def _log_in(page: Page, base: str, token: str) -> None:
    page.goto(base + "/login")
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")


def test_a_tenant_sees_its_tool_with_the_ttl_on_its_cdf(
    cluster: Cluster, browser: Browser, shots: Path
) -> None:
    base, errors = f"http://127.0.0.1:{cluster.port}", list[str]()
    page = _page(browser, errors)
    page.goto(base + "/tools")  # not logged in: the login page says so
    assert "not logged in" in page.inner_text("#login-error")
    page.screenshot(path=shots / "login.png")
    _log_in(page, base, cluster.tokens["acme"])
    page.wait_for_url(base + "/tools")
    tools = page.inner_text("#tools")
    assert "bash" in tools
    assert "rival-secret-tool" not in page.content()
    page.screenshot(path=shots / "tools.png", full_page=True)

    page.click("#tools >> text=bash")
    page.wait_for_selector("#cdf[data-ttl] canvas")
    ttl = float(page.get_attribute("#cdf", "data-ttl") or "nan")
    assert ttl > 0
    assert page.eval_on_selector("#cdf", RED_PIXELS) > 50  # the TTL line is drawn
    assert page.eval_on_selector("#hist", RED_PIXELS) > 50
    assert int(page.get_attribute("#cdf", "data-points") or 0) > 10
    assert page.is_hidden("#cold-start")  # 400 samples: the tool's own model decides
    page.wait_for_selector("#outcomes canvas")
    reasons = page.inner_text("#miss-reasons")
    assert "expired" in reasons
    assert "not_pinned" in reasons
    assert "expired" in page.inner_text("#misses")
    page.screenshot(path=shots / "tool.png", full_page=True)

    page.click("#signatures >> text=pytest")
    page.wait_for_selector("#cdf[data-ttl] canvas")
    assert page.inner_text("#basis") == "invocation"

    page.goto(base + "/tool?tenant=rival&name=rival-secret-tool")
    assert "no tenant named 'rival'" in page.inner_text("#error")
    page.goto(base + "/tool?name=rival-secret-tool")
    assert "has no tool 'rival-secret-tool'" in page.inner_text("#error")

    page.goto(base + "/workload")
    page.wait_for_selector("#workload canvas")
    page.screenshot(path=shots / "workload.png", full_page=True)
    page.goto(base + "/engines")
    names = page.locator("#engines td.engine-name").all_inner_texts()
    assert names == ["engine-a", "engine-b"]  # the names the hooks were given, not ids
    starts = page.locator("#engines td.instance").all_inner_texts()
    assert [len(s) for s in starts] == [6, 6]
    assert "rival-engine" not in page.content()
    page.screenshot(path=shots / "engines.png", full_page=True)
    page.goto(base + "/shared?name=grep")
    page.wait_for_selector("#cdf canvas")
    assert errors == [  # the pages refused above, and nothing else
        "401 /tools?",
        "404 /tool?tenant=rival&name=rival-secret-tool",
        "404 /tool?name=rival-secret-tool",
    ]
    for name in ("login", "tools", "tool", "workload", "engines"):
        assert (shots / f"{name}.png").stat().st_size > 10_000


def test_the_admin_sees_the_tenants(cluster: Cluster, browser: Browser, shots: Path) -> None:
    base, errors = f"http://127.0.0.1:{cluster.port}", list[str]()
    page = _page(browser, errors)
    _log_in(page, base, ADMIN)
    page.wait_for_url(base + "/tenants")
    assert "rival" in page.inner_text("#tenants")
    page.screenshot(path=shots / "tenants.png", full_page=True)
    page.click("#tenants >> text=rival")
    assert "rival-secret-tool" in page.inner_text("#tools")
    page.click("button:has-text('Log out')")
    page.wait_for_url(base + "/login")
    page.goto(base + "/tenants")
    assert "not logged in" in page.inner_text("#login-error")
    assert errors == ["401 /tenants?"]


def test_a_tool_in_its_cold_start_says_so_with_its_ttl_on_the_chart(
    cluster: Cluster, browser: Browser, shots: Path
) -> None:
    """s0's ``lint`` has 37 calls of 3..8 ms: the TTL comes from the cold-start rule
    (hundreds of ms), far right of every sample, and the page says where it comes from."""
    base, errors = f"http://127.0.0.1:{cluster.port}", list[str]()
    page = _page(browser, errors)
    _log_in(page, base, cluster.tokens["s0"])
    page.wait_for_url(base + "/tools")
    page.goto(base + "/tool?name=lint")
    page.wait_for_selector("#cdf[data-ttl] canvas")
    cold = page.inner_text("#cold-start")
    assert f"cold start: {LINT_CALLS} of 101 samples; the TTL comes from" in cold
    assert "cold-start rule" in cold
    assert "until it has 101 samples" in cold
    assert page.inner_text("#basis") == "cold-start"
    ttl = float(page.get_attribute("#cdf", "data-ttl") or "nan")
    assert ttl > 0.1  # far beyond the longest call (8 ms)
    for chart in ("#cdf", "#hist"):
        assert page.get_attribute(chart, "data-ttl-inside") == "yes", chart
        assert page.eval_on_selector(chart, RED_PIXELS) > 50, chart
    page.screenshot(path=shots / "tool-cold-start.png", full_page=True)
    assert errors == []
