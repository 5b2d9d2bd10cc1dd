"""Reading the documentation's Markdown: fenced blocks with their run markers, sections,
relative links.

A shell block on a page the suite runs is preceded by a marker comment:
``<!-- docs-test: run -->`` (the suite runs it verbatim), ``<!-- docs-test: setup -->`` (the
installation, which the suite's own command runs first) or ``<!-- docs-test: skip (why) -->``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")
_MARKER = re.compile(r"^<!-- docs-test: (?P<kind>run|setup|skip)(?P<why>[^>]*)-->$")
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, text, marker (or ``""``), section and line."""

    language: str
    text: str
    marker: str
    section: str
    line: int


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, in order, each with the ``##`` section it is in
    and the marker on the nearest non-blank line before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        match = _FENCE.match(line)
        if not match:
            i += 1
            continue
        fence, start = match.group("fence"), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marked = _MARKER.match(lines[j].strip()) if j >= 0 else None
        language = match.group("info").strip().split(" ")[0]
        found.append(
            Block(
                language,
                "\n".join(body) + "\n",
                marked.group("kind") if marked else "",
                section,
                start + 1,
            )
        )
        i += 1
    return found


def shell_blocks(path: Path, section: str | None = None) -> list[Block]:
    """The shell blocks of ``path`` (of one ``##`` section when given)."""
    return [
        b for b in blocks(path) if b.language in SHELL and (section is None or b.section == section)
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens.

    >>> slug("Cluster: pins behind a router"), slug("The 2026 peers (`policies/peers.py`)")
    ('cluster-pins-behind-a-router', 'the-2026-peers-policiespeerspy')
    """
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (repeats get ``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence or not line.startswith("#"):
            continue
        heading = line.lstrip("#").strip()
        heading = re.sub(r"\s*\{#([\w-]+)\}$", "", heading)
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every relative link and image of a Markdown file, outside code."""
    out = []
    in_fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # inline code
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # a URL, not a path
                continue
            out.append((number, target))
    return out
