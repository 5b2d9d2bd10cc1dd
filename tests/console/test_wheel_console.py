"""The console of an installed wheel: the repository's HEAD cloned into a temporary folder, an
sdist and a wheel built from it (the wheel from the sdist, as ``python -m build`` does), the
wheel installed into a fresh virtual environment, and ``cachettl serve --console`` from that
environment drawing a tool's chart in Chromium.

Nothing is downloaded: the build runs without isolation on this environment's setuptools, and
the fresh environment reads its dependencies from this one's site-packages through a path file
(as in tests/test_wheel.py), so the project itself can only come from the wheel.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser

from controlplane.service import ControlPlane
from controlplane.storage import create_store
from tests.console.conftest import fill
from tests.console.test_browser import RED_PIXELS, _log_in, _page, browser  # noqa: F401
from tests.test_wheel import ROOT, _run, install_wheel


def _console_files() -> list[str]:
    """What the console serves and renders, as git holds it (its Python files aside)."""
    listed = _run(
        ["git", "ls-files", "controlplane/console/static", "controlplane/console/templates"], ROOT
    )
    return [name for name in listed.splitlines() if not name.endswith(".py")]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel built from a clone of HEAD."""
    work = tmp_path_factory.mktemp("clean")
    _run(["git", "clone", "--quiet", "--no-hardlinks", ROOT, work / "src"], work)
    build: list[str | Path] = [
        sys.executable,
        "-m",
        "build",
        "--no-isolation",
        "--outdir",
        work / "dist",
    ]
    _run([*build, work / "src"], work)
    return work / "dist"


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the wheel; its ``bin``."""
    (wheel,) = dist.glob("cachettl_kvserve-*.whl")
    return install_wheel(wheel, tmp_path_factory.mktemp("venv") / "env")


def test_the_sdist_and_the_wheel_hold_every_file_the_console_serves(dist: Path) -> None:
    expected = _console_files()
    assert "controlplane/console/static/vendor/uPlot.iife.min.js" in expected
    assert "controlplane/console/static/vendor/uPlot.LICENSE" in expected
    (wheel,) = dist.glob("cachettl_kvserve-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert [name for name in expected if name not in in_wheel] == []
    (sdist,) = dist.glob("cachettl_kvserve-*.tar.gz")
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert [name for name in expected if name not in in_sdist] == []


@pytest.fixture(scope="module")
def serving(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """``cachettl serve --console`` of the installed wheel: (the console's port, acme's token)."""
    work = tmp_path_factory.mktemp("serve")
    db = f"sqlite:///{work / 'cachettl.sqlite3'}"
    store = create_store(db)
    tokens = fill(ControlPlane(store))
    store.close()
    where = _run(
        [installed / "python", "-c", "import controlplane; print(controlplane.__file__)"], work
    )
    assert Path(where.strip()).is_relative_to(installed.parent), where
    cmd = [installed / "cachettl", "serve", "--db", db, "--listen", "127.0.0.1:0"]
    cmd += ["--console", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [str(c) for c in cmd], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert "console on port" in lines[1], lines
        yield int(lines[1].split("on port")[1].split()[0]), tokens["acme"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_the_installed_console_draws_a_chart_in_chromium(
    serving: tuple[int, str],
    browser: Browser,  # noqa: F811 - the fixture imported above
) -> None:
    port, token = serving
    base, errors = f"http://127.0.0.1:{port}", list[str]()
    page = _page(browser, errors)
    _log_in(page, base, token)
    page.wait_for_url(base + "/tools")
    page.click("#tools >> text=bash")
    page.wait_for_selector("#cdf[data-ttl] canvas")
    assert page.eval_on_selector("#cdf", RED_PIXELS) > 50  # uPlot drew the TTL line
    assert page.evaluate("typeof uPlot") == "function"
    assert errors == []
