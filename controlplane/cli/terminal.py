"""Text for a terminal: names that come from clients made safe to print, durations as
people read them, and tables with aligned columns."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["printable", "seconds", "table"]


def printable(text: str) -> str:
    r"""``text`` safe for a terminal: each non-printable character (escape sequences, other
    controls, bidirectional overrides) written as its Python escape, e.g. ``\x1b``.

    >>> print(printable("ls"), printable("\x1b[2Jbash\u202e"))
    ls \x1b[2Jbash\u202e
    """
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def seconds(value: float) -> str:
    """A duration as people read it: milliseconds under a second, else seconds.

    >>> seconds(0.3949), seconds(2.5), seconds(0.0), seconds(float("nan"))
    ('395 ms', '2.50 s', '0 ms', '–')
    """
    if value != value:  # NaN: no samples
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1.0 else f"{value:.2f} s"


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    indent: str = "",
    right: Sequence[bool] | None = None,
) -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell, each aligned to
    the right where ``right`` says so (by default: where the first row holds a number).

    >>> print("\\n".join(table(["TOOL", "CALLS"], [["bash", 12], ["grep", 3]])))
    TOOL  CALLS
    bash     12
    grep      3
    """
    if right is None:
        right = [isinstance(c, int | float) for c in rows[0]] if rows else [False] * len(headers)
    cells = [[printable(str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = []
    for row in [list(headers), *cells]:
        line = "  ".join(
            c.rjust(w) if to_right else c.ljust(w)
            for c, w, to_right in zip(row, widths, right, strict=True)
        )
        lines.append(indent + line.rstrip())
    return lines
