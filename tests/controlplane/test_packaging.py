"""Migrations, .proto files and generated code ship inside ``controlplane``, both in the
editable install and in a built wheel (no top-level ``migrations``/``proto``/``cachettl``)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from controlplane._resources import data_dir
from controlplane.storage.schema import HEAD_REVISION

ROOT = Path(__file__).resolve().parents[2]


def test_editable_install_resources() -> None:
    migrations = data_dir("migrations")
    assert (migrations / "env.py").is_file()
    assert (migrations / "versions" / "0001_initial.py").is_file()
    assert (data_dir("proto") / "cachettl" / "v1" / "ttl.proto").is_file()


def test_wheel_carries_and_uses_package_data(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation"]
    build += ["--skip-dependency-check", "--outdir", str(out), str(ROOT)]
    subprocess.run(build, check=True, capture_output=True)
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    revisions = sorted((ROOT / "migrations" / "versions").glob("0*.py"))
    assert len(revisions) >= 6
    for expected in (
        "controlplane/migrations/env.py",
        "controlplane/migrations/script.py.mako",
        *(f"controlplane/migrations/versions/{r.name}" for r in revisions),
        "controlplane/proto/cachettl/v1/events.proto",
        "controlplane/_gen/cachettl/v1/events_pb2.pyi",
    ):
        assert expected in names, expected
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert not top_level & {"migrations", "proto", "cachettl"}
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    db = f"sqlite:///{tmp_path / 'w.sqlite3'}"
    code = (
        "import controlplane, sys; assert controlplane.__file__.startswith(sys.argv[1]);"
        "from controlplane.__main__ import main;"
        "sys.exit(main(['db', 'upgrade', '--db', sys.argv[2]]))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(site), db],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"schema empty -> {HEAD_REVISION}"
