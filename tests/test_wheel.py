"""The wheel ships what it imports: built from the source tree, installed without ``-e`` into
a fresh virtual environment, its ``cachettl`` starts and simulates.

The fresh environment gets the dependencies from the test's own environment through a path
file (its site-packages on ``sys.path``, whose ``.pth`` files, among them the editable
install's hook, are not run), so nothing is downloaded and the project itself can only come
from the wheel; the test checks that it does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = (
    "simulator/policies/__init__.py",
    "simulator/studies/commands.py",
    "controlplane/migrations/env.py",
    "controlplane/migrations/script.py.mako",
    "controlplane/proto/buf.yaml",
    "controlplane/_gen/cachettl/v1/ttl_pb2.py",
)


def _run(args: list[str | Path], cwd: Path, with_errors: bool = False) -> str:
    """The command's standard output (``with_errors``: and its error output); a failure
    shows both."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + (done.stderr if with_errors else "")


def _source_copy(target: Path) -> Path:
    """The files git would commit (tracked and not ignored), copied so that the build's
    ``build/`` and ``*.egg-info`` stay out of the working tree."""
    listed = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], ROOT)
    for name in listed.splitlines():
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(the wheel, the build's output)."""
    work = tmp_path_factory.mktemp("wheel")
    source = _source_copy(work / "src")
    build: list[str | Path] = [
        sys.executable,
        "-m",
        "build",
        "--wheel",
        "--no-isolation",
        "--outdir",
        work / "dist",
    ]
    log = _run(build, source, with_errors=True)
    (wheel,) = (work / "dist").glob("cachettl_kvserve-*.whl")
    return wheel, log


def install_wheel(wheel: Path, home: Path) -> Path:
    """A fresh virtual environment at ``home`` holding ``wheel`` (no ``-e``; its
    dependencies read from this environment's site-packages through a path file, so
    nothing is downloaded); its ``bin``."""
    _run([sys.executable, "-m", "venv", "--without-pip", home], home.parent)
    python = home / "bin" / "python"
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], home
    )
    deps = Path(sysconfig.get_paths()["purelib"])
    (Path(purelib.strip()) / "_dependencies.pth").write_text(f"{deps}\n")
    pip: list[str | Path] = [sys.executable, "-m", "pip", "--python", python, "install"]
    _run([*pip, "--no-deps", "--no-index", "--quiet", wheel], home.parent)
    return home / "bin"


@pytest.fixture(scope="module")
def venv(built: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed (no ``-e``); its ``bin``."""
    return install_wheel(built[0], tmp_path_factory.mktemp("venv") / "env")


def test_the_wheel_ships_what_the_code_imports(built: tuple[Path, str]) -> None:
    wheel, log = built
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert missing == []
    assert any(n.startswith("controlplane/migrations/versions/0001_") for n in names)
    protos = {n for n in names if n.startswith("controlplane/proto/cachettl/v1/")}
    assert {Path(n).name for n in protos} == {
        p.name for p in (ROOT / "proto/cachettl/v1").glob("*.proto")
    }
    assert not any(n.startswith(("tests/", "results/", "conftest")) for n in names)
    assert "absent from the `packages` configuration" not in log


def test_the_installed_project_comes_from_the_wheel(venv: Path) -> None:
    code = "import controlplane, simulator.policies, enginehook.core; print(controlplane.__file__)"
    where = Path(_run([venv / "python", "-c", code], venv).strip())
    assert where.is_relative_to(venv.parent / "lib"), where
    assert not where.is_relative_to(ROOT)


def test_cachettl_starts_and_simulates_from_the_wheel(venv: Path) -> None:
    assert "simulate" in _run([venv / "cachettl", "--help"], venv)
    out = _run(
        [venv / "cachettl", "simulate", "--workload", "swe", "--programs", "3", "--json"], venv
    )
    result = json.loads(out[out.index("{") :])
    assert result["policies"]
    assert all(p["programs"] == 3 for p in result["policies"].values())
