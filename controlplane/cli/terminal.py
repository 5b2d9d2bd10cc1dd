"""Text for a terminal: what the CLI's views print of names that come from clients."""

from __future__ import annotations

__all__ = ["printable"]


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
