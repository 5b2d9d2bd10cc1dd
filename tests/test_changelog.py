"""CHANGELOG.md names the version ``cachettl --version`` prints, which is the package's
(pyproject.toml), and the upgrade page is in the documentation site's navigation."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from controlplane.cli import version

ROOT = Path(__file__).resolve().parents[1]


def _newest_entry() -> str:
    """The version of the CHANGELOG's first ``## [X.Y.Z]`` heading ("Unreleased" skipped)."""
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    versions: list[str] = [h for h in headings if h != "Unreleased"]
    assert versions, "CHANGELOG.md has no version entry"
    return versions[0]


def test_cachettl_version_is_the_changelogs_newest() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "cachettl"), "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    with (ROOT / "pyproject.toml").open("rb") as file:
        declared = tomllib.load(file)["project"]["version"]
    assert done.stdout == f"cachettl {declared}\n"
    assert version() == declared == _newest_entry()


def test_the_upgrade_page_is_in_the_navigation() -> None:
    assert "  - Upgrade: upgrade.md\n" in (ROOT / "mkdocs.yml").read_text()
    page = (ROOT / "docs" / "upgrade.md").read_text()
    assert "buf breaking" in page
    assert "cachettl db upgrade" in page
