"""The quickstart's and the deploy page's commands, run verbatim on this machine; the
operations page's runbooks, each naming the test or command that tried it.

Each page's marked shell blocks (``<!-- docs-test: run -->``, tests/docs/pages.py) are joined
into one bash script and run from the repository's root; the only thing the test changes is
the environment variables the page itself sets with a default (``export WORK=${WORK:-...}``):
a fresh folder, free ports, and a fresh PostgreSQL database and role (dropped after). The
script stops its own processes (its last block); whatever it left running is stopped with its
process group.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from enginehook.tools.servers import free_port
from tests.docs.pages import DOCS, ROOT, shell_blocks

pytestmark = pytest.mark.slow

QUICKSTART = DOCS / "quickstart.md"
DEPLOY = DOCS / "deploy.md"
ONE_ENGINE = "One engine on SQLite"
CLUSTER = "A cluster behind vllm-router"
REPLICAS = "Control-plane replicas on PostgreSQL"
#: The PostgreSQL server the suite uses (trust authentication), as the page's ``PGHOST`` and
#: ``PGUSER`` name it.
POSTGRES = {"PGHOST": "127.0.0.1", "PGUSER": "postgres"}
_DEFAULTED = re.compile(r"\b([A-Z][A-Z0-9_]*)=\$\{\1:-[^}]*\}")


def script(page: Path, section: str | None = None) -> str:
    """The page's (section's) runnable blocks as one script; every shell block there must be
    marked to run (the installation alone is marked as the suite's own first step)."""
    parts = ["set -euo pipefail"]
    for block in shell_blocks(page, section):
        assert block.marker in ("run", "setup"), (
            f"{page.name}:{block.line}: a shell block the suite does not run ({block.marker!r})"
        )
        if block.marker == "run":
            parts.append(block.text)
    assert len(parts) > 1, f"{page.name} {section or ''}: no runnable block"
    return "\n".join(parts)


def variables(text: str, work: Path, given: dict[str, str] | None = None) -> dict[str, str]:
    """The page's defaulted variables: ``WORK`` a fresh folder, every ``*_PORT`` a free port,
    the others from ``given`` (a fresh database's name and role) or :data:`POSTGRES`."""
    names = sorted(set(_DEFAULTED.findall(text)))
    assert "WORK" in names, "the page sets no WORK folder"
    env = {"WORK": str(work)}
    known = {**POSTGRES, **(given or {})}
    for name in names:
        if name.endswith("_PORT"):
            env[name] = str(free_port())
        elif name in known:
            env[name] = known[name]
        else:
            assert name == "WORK", f"the page defaults {name}, which the test does not know"
    return env


def run(
    page: Path,
    work: Path,
    section: str | None = None,
    timeout_s: float = 900,
    given: dict[str, str] | None = None,
) -> str:
    """Run the page's script (``given``: values for its variables other than ``WORK`` and
    ports); its output (stdout and stderr). Fails with the output and the tails of the logs
    it wrote when the script fails."""
    text = script(page, section)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **variables(text, work, given)}
    proc = subprocess.Popen(
        ["bash", "-c", text],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(proc.pid)
        out, _ = proc.communicate()
    finally:
        _stop_group(proc.pid)
    output = out.decode(errors="replace")
    if proc.returncode != 0:
        logs = "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
            for log in sorted(work.glob("*.log"))
        )
        pytest.fail(f"{page.name} {section or ''} exited {proc.returncode}:\n{output}\n{logs}")
    return output


def _stop_group(pgid: int) -> None:
    """SIGTERM to what the script left running, SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def _metric(output: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{re.escape(name)} (\S+)$", output, re.M)]


def test_the_installation_is_the_suites_first_step() -> None:
    """The quickstart's installation block is what scripts/test runs before the tests."""
    (setup,) = [b for b in shell_blocks(QUICKSTART) if b.marker == "setup"]
    command = setup.text.split("#")[0].strip()
    steps = (ROOT / "scripts" / "test").read_text().splitlines()
    assert command in steps
    assert (ROOT / command).exists()


def test_quickstart_pins_a_turn(tmp_path: Path) -> None:
    out = run(QUICKSTART, tmp_path / "quickstart")
    assert re.search(r"^x-cachettl-pinned: true\r?$", out, re.M | re.I), out
    assert _metric(out, "cachettl_pins_taken_total") == [1.0], out
    assert _metric(out, "cachettl_pins_held") == [1.0], out


def test_one_engine_pins_and_hits(tmp_path: Path) -> None:
    out = run(DEPLOY, tmp_path / "engine", ONE_ENGINE)
    assert re.search(r"^x-cachettl-pinned: true\r?$", out, re.M | re.I), out
    cached = [int(n) for n in re.findall(r'"cached_tokens":(\d+)', out)]
    assert cached, out
    assert cached[0] >= 32, out
    assert _metric(out, "cachettl_pins_taken_total") == [1.0], out
    assert _metric(out, "cachettl_pinned_prefix_hits_total") == [1.0], out
    assert _metric(out, "cachettl_model_version"), out  # the control plane's /metrics answered


def test_cluster_behind_vllm_router_pins_and_hits(tmp_path: Path) -> None:
    out = run(DEPLOY, tmp_path / "cluster", CLUSTER)
    assert re.search(r"^x-cachettl-pinned: true\r?$", out, re.M | re.I), out
    engines = re.findall(r"^x-cachettl-engine: (\S+)", out, re.M | re.I)
    assert len(engines) == 2, out
    assert engines[0] == engines[1], out  # both turns on one engine
    cached = [int(n) for n in re.findall(r'"cached_tokens":(\d+)', out)]
    assert cached, out
    assert cached[0] >= 32, out
    assert sorted(_metric(out, "cachettl_pins_taken_total")) == [0.0, 1.0], out
    assert sorted(_metric(out, "cachettl_pinned_prefix_hits_total")) == [0.0, 1.0], out
    router_lines = out.strip().splitlines()[-1]
    assert int(router_lines) > 0, out  # the router's /metrics answered with its samples


@pytest.fixture
def fresh_database() -> Iterator[dict[str, str]]:
    """A database name and a role name that exist nowhere yet, for the page to create on the
    suite's PostgreSQL; both dropped afterwards (the database even with a replica still
    connected)."""
    suffix = secrets.token_hex(4)
    names = {"DB_NAME": f"cachettl_docs_{suffix}", "DB_ROLE": f"cachettl_docs_{suffix}"}
    yield names
    admin = ["-h", POSTGRES["PGHOST"], "-U", POSTGRES["PGUSER"]]
    drops = (["dropdb", *admin, "--if-exists", "--force"], ["dropuser", *admin, "--if-exists"])
    for command, name in zip(drops, (names["DB_NAME"], names["DB_ROLE"]), strict=True):
        subprocess.run([*command, name], capture_output=True, timeout=60, check=True)


def test_replicas_on_postgresql_share_one_database(
    tmp_path: Path, fresh_database: dict[str, str]
) -> None:
    out = run(DEPLOY, tmp_path / "replicas", REPLICAS, timeout_s=300, given=fresh_database)
    assert re.search(r"^schema empty -> \d{4}$", out, re.M), out
    assert _metric(out, "cachettl_database_reachable") == [1.0, 1.0], out
    assert re.search(r"^agents +no +active ", out, re.M), out


# -- the operations page's runbooks: each entry names what tried it ---------------------------

OPERATIONS = DOCS / "operations.md"
RUNBOOKS = "When a part is away"
#: The faults the page must have an entry for (the start of each entry's heading).
FAULTS = (
    "An engine killed behind vllm-router",
    "A control-plane replica lost",
    "PostgreSQL restarted",
    "The hook's spill folder on a full disk",
    "A tenant at its caps",
)
_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")
_BENCH_REF = re.compile(r"`cachettl bench ([\w-]+)[^`]*`")


def runbook_entries(page: Path, section: str) -> dict[str, str]:
    """The ``###`` entries of a ``##`` section: heading -> the entry's text."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end >= 0 else len(text)]
    parts = re.split(r"^### (.+)$", body, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _bench_commands() -> set[str]:
    from controlplane.cli import build_parser

    def sub(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(found[0].choices) if found else {}

    return set(sub(sub(build_parser())["bench"]))


def _missing(text: str, commands: set[str]) -> list[str]:
    """What an entry's **Tried** names that does not exist (a file, a test in it, a bench)."""
    missing = []
    for path, name in _TEST_REF.findall(text):
        source = ROOT / path
        if not source.is_file():
            missing.append(path)
        elif name and not re.search(rf"^(async )?def {name}\(", source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    missing += [f"cachettl bench {c}" for c in _BENCH_REF.findall(text) if c not in commands]
    return missing


def test_every_runbook_entry_names_a_test_or_command_that_exists() -> None:
    entries = runbook_entries(OPERATIONS, RUNBOOKS)
    for fault in FAULTS:
        assert any(h.startswith(fault) for h in entries), f"no runbook entry for {fault!r}"
    commands = _bench_commands()
    for heading, text in entries.items():
        assert text.count("**Tried:**") == 1, f"{heading!r}: one **Tried:** line"
        tried = text.split("**Tried:**", 1)[1]
        named = _TEST_REF.findall(tried) + _BENCH_REF.findall(tried)
        assert named, f"{heading!r}: its **Tried** names no test and no `cachettl bench`"
        assert _missing(tried, commands) == [], heading


def test_a_runbook_naming_what_does_not_exist_is_caught() -> None:
    """The check above can fail: a missing file, test and bench are each named."""
    text = (
        "`tests/docs/test_runbooks.py::no_such_test`, `tests/no_such_file.py` and "
        "`cachettl bench no-such-bench --x 1`; `tests/docs/pages.py::blocks` exists"
    )
    assert _missing(text, _bench_commands()) == [
        "tests/docs/test_runbooks.py::no_such_test",
        "tests/no_such_file.py",
        "cachettl bench no-such-bench",
    ]
