"""vLLM tests whose assertion the hook changes on purpose, with the reason.

Each entry: a test id (or an id prefix ending in ``*``), the modes it applies to, the
failure it may show (a regular expression the failure message must match: any other
failure of that test is still unexpected), and why the hook's behaviour differs from
stock vLLM there. Keep this list short: where a test can
be made pin-aware without weakening it, do that instead of listing it.
"""

from __future__ import annotations

import re

__all__ = ["EXCEPTIONS", "exception_for"]

#: ``test id or prefix*`` -> (modes, failure message pattern, reason). vLLM's free-block
#: counts right after a finish are made pin-aware instead (``pinaware.PIN_AWARE``).
EXCEPTIONS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "tests/v1/core/test_scheduler.py::test_cache_aware_admission_*": (
        ("defaults", "active", "pins"),
        r"'warm'",
        "vLLM 0.34's cache-aware admission tests create `warm` before `cold` and add them in "
        "the other order, and expect `cold` first wherever the window does not reorder: vLLM's "
        "FCFS queue keeps the order of add_request, the hook's queue orders by (program) "
        "arrival time, so `warm`, which arrived first, goes first (with the window off too)",
    ),
}


def exception_for(test_id: str, mode: str, message: str = "") -> str | None:
    """The reason ``test_id`` may fail in ``mode`` with ``message`` (``None``: it must
    pass, or it failed otherwise)."""
    for pattern, (modes, expected, reason) in EXCEPTIONS.items():
        hit = test_id.startswith(pattern[:-1]) if pattern.endswith("*") else test_id == pattern
        if hit and mode in modes and re.search(expected, message):
            return reason
    return None
