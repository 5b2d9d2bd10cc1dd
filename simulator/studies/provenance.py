"""Where a results file came from: the command that made it, the commit, the UTC date and
the machine's load, written once at the top of every file ``scripts/results`` makes.

A Markdown file opens with one machine-readable line and one line for people::

    <!-- provenance: {"command": "cachettl bench seeds ...", "commit": "c36227c", ...} -->
    > Made by `cachettl bench seeds ...` at commit `c36227c`, 2026-12-04 21:31 UTC; ...

A JSON object gets the same record under the key ``"provenance"``. Stamping again replaces
the record, so a file never carries two. A file not regenerated since an earlier commit is
stamped with :func:`earlier`, which names the command and says the figures are that
commit's.

>>> record = {"command": "cachettl bench seeds", "commit": "abc1234",
...           "date": "2026-12-04 21:31 UTC", "load": [1.0, 0.5, 0.25], "cpus": 2}
>>> text = stamp_markdown("# Title\\n", record)
>>> read(text)["command"], text.splitlines()[-1]
('cachettl bench seeds', '# Title')
>>> stamp_markdown(text, {**record, "commit": "def5678"}).count("provenance:")
1
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["current", "earlier", "load_now", "read", "stamp", "stamp_markdown"]

_LINE = re.compile(r"^<!-- provenance: (\{.*\}) -->\n(?:> .*\n)*\n?", re.MULTILINE)


def _git(*args: str, cwd: Path | None = None) -> str:
    out = subprocess.run(["git", *args], capture_output=True, text=True, check=False, cwd=cwd)
    return out.stdout.strip()


def load_now() -> list[float]:
    """The load average (1, 5, 15 min) now, to pass to :func:`current` as the start's."""
    return [round(x, 2) for x in os.getloadavg()]


def current(command: str, started_load: list[float] | None = None) -> dict[str, Any]:
    """The record of a file made now by ``command``: the commit checked out (``+`` when the
    working tree has changes), the UTC time, the load average (1, 5, 15 min) at the start
    (``started_load``, default now) and at the end (now), and the CPU count."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    end = load_now()
    return {
        "command": command,
        "commit": commit,
        "date": now,
        "load": started_load if started_load is not None else end,
        "load_end": end,
        "cpus": os.cpu_count() or 0,
        "regenerated": True,
    }


def earlier(path: Path, command: str, kind: str = "") -> dict[str, Any]:
    """The record of ``path`` as it stands: made by ``command`` at the last commit that
    changed it, not regenerated since (its load was not recorded). ``kind`` ``frozen``:
    figures of code that has changed since, kept as a comparison."""
    log = _git(  # the last commit that changed its content (a move changes no figure)
        "log",
        "-1",
        "--follow",
        "--diff-filter=AM",
        "--format=%h %cd",
        "--date=format:%Y-%m-%d %H:%M",
        "--",
        path.name,
        cwd=path.parent,
    )
    commit, _, date = log.partition(" ")
    return {
        "command": command,
        "commit": commit or "uncommitted",
        "date": f"{date} UTC" if date else "unknown",
        "load": None,
        "cpus": None,
        "regenerated": False,
        **({"kind": kind} if kind else {}),
    }


def _sentence(record: dict[str, Any]) -> str:
    command, commit, date = record["command"], record["commit"], record["date"]
    if record.get("kind") == "frozen":
        return (
            f"> Made by `{command}` at commit `{commit}` ({date}) on code that has changed "
            "since; kept as the comparison the documentation quotes, not regenerated."
        )
    if not record.get("regenerated", True):
        return (
            f"> Made by `{command}`. The figures are from commit `{commit}` ({date}, the last "
            "commit that changed them) and were not regenerated since; the machine's "
            "load was not recorded. `scripts/results` reruns the command."
        )
    load = " / ".join(f"{x:g}" for x in record["load"])
    end = " / ".join(f"{x:g}" for x in record.get("load_end") or record["load"])
    return (
        f"> Made by `{command}` at commit `{commit}`, {date}; load average {load} "
        f"(1 / 5 / 15 min) at the start and {end} at the end, on {record['cpus']} CPUs."
    )


def stamp_markdown(text: str, record: dict[str, Any]) -> str:
    """``text`` opening with ``record`` (any earlier record removed)."""
    body = _LINE.sub("", text, count=1) if text.startswith("<!-- provenance:") else text
    head = f"<!-- provenance: {json.dumps(record, ensure_ascii=False)} -->\n{_sentence(record)}\n\n"
    return head + body


def read(text: str) -> dict[str, Any] | None:
    """The record a Markdown text opens with, or ``None``."""
    m = _LINE.match(text)
    return json.loads(m.group(1)) if m else None


def stamp(path: Path, record: dict[str, Any]) -> bool:
    """Stamp ``path`` (``.md``: the opening lines; ``.json`` object: the ``provenance`` key);
    ``False`` for files that hold no record (images, JSON that is not an object)."""
    if path.suffix == ".md":
        path.write_text(stamp_markdown(path.read_text(), record))
        return True
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            return False
        data = {"provenance": record, **{k: v for k, v in data.items() if k != "provenance"}}
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        return True
    return False
