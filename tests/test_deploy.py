"""The service files of ``deploy/``: the systemd unit passes ``systemd-analyze verify`` with
no warning and ``systemd-analyze security`` at a low exposure, runs ``cachettl serve`` with
the example configuration, restarts on failure as a user of its own; the example
configuration is a valid ``serve --config`` file.

``systemd-analyze`` needs no running systemd: it reads the unit file alone (the command's path
is replaced by this environment's ``cachettl``, which ``verify`` requires to exist).
"""

from __future__ import annotations

import argparse
import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import build_parser
from controlplane.cli.configfile import load_config

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "systemd" / "cachettl.service"
EXAMPLE = ROOT / "deploy" / "serve.toml"
INSTALLED = "/opt/cachettl/bin/cachettl"
#: The highest exposure ``systemd-analyze security`` may give the unit (0 best, 10 worst).
MAX_EXPOSURE = 2.0


def _service() -> configparser.SectionProxy:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment, method-assign]
    unit.read(UNIT)
    return unit["Service"]


@pytest.fixture
def checkable(tmp_path: Path) -> Path:
    """The unit with this environment's ``cachettl`` in place of the installed path."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package has it)")
    here = Path(sys.executable).parent / "cachettl"
    text = UNIT.read_text()
    assert INSTALLED in text
    copy = tmp_path / "cachettl.service"
    copy.write_text(text.replace(INSTALLED, str(here)))
    return copy


def test_the_unit_passes_systemd_analyze_verify(checkable: Path) -> None:
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(checkable)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""  # a directive it ignores is a warning only: none


def test_the_unit_is_hardened(checkable: Path) -> None:
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(checkable)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: ([\d.]+)", done.stdout + done.stderr)
    assert found is not None, done.stdout + done.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE


def test_the_unit_runs_serve_with_the_config_as_its_own_user() -> None:
    service = _service()
    assert service["ExecStart"] == f"{INSTALLED} serve --config /etc/cachettl/serve.toml"
    assert service["User"] == "cachettl"
    assert service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["CapabilityBoundingSet"] == ""


def test_the_example_configuration_is_a_valid_file() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    values = load_config(EXAMPLE, sub.choices["serve"])
    assert values["listen"] == "0.0.0.0:50051"
    assert values["db"].startswith("postgresql")
