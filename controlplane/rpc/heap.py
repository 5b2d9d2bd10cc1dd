"""Giving freed memory back to the system, where the C allocator keeps it.

glibc's ``malloc`` keeps what a process frees in its arenas for reuse: after a burst of
large buffers (gRPC's copies of snapshots for a thousand streams, a console page's rows)
the server's resident memory stays at its peak although Python and gRPC released them.
``malloc_trim(0)`` returns the free pages of every arena. It walks the arenas under their
locks, so it runs in a worker thread (ctypes releases the interpreter lock), at most
once per ``min_interval_s``, and only when something large was released since the last
one or the resident memory grew by ``grown_bytes``. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import sys
import time
from collections.abc import Callable

__all__ = ["HeapTrimmer", "resident_bytes", "trim_heap"]

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the allocator's free pages to the system; False where that is not possible
    (not glibc). Blocks for up to tens of milliseconds: call it off the event loop."""
    return bool(_TRIM is not None and _TRIM(0) >= 0)


def resident_bytes() -> int:
    """The process's resident memory (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """Decides when to trim: :meth:`released` is told of large frees (bytes), and
    :meth:`maybe_trim` (from the event loop, periodically) trims in a worker thread when
    they add up to ``released_bytes`` or the resident memory grew by ``grown_bytes``
    since the last trim, at most once per ``min_interval_s``.

    >>> trimmer = HeapTrimmer(released_bytes=10, min_interval_s=0.0)
    >>> trimmer.released(4); trimmer.due(rss=0)
    False
    >>> trimmer.released(6); trimmer.due(rss=0)
    True
    """

    def __init__(
        self,
        released_bytes: int = 32 << 20,
        grown_bytes: int = 64 << 20,
        min_interval_s: float = 10.0,
    ) -> None:
        self.released_bytes = released_bytes
        self.grown_bytes = grown_bytes
        self.min_interval_s = min_interval_s
        self.trims = 0
        self.freed = 0  # resident bytes the trims gave back, in all
        self._released = 0
        self._last_rss = resident_bytes()
        self._last_at = float("-inf")

    def released(self, size: int) -> None:
        """``size`` bytes of large buffers were freed."""
        self._released += size

    def due(self, rss: int) -> bool:
        if time.monotonic() - self._last_at < self.min_interval_s:
            return False
        return self._released >= self.released_bytes or rss - self._last_rss >= self.grown_bytes

    async def maybe_trim(self) -> bool:
        """Trim if due (see the class doc); whether it trimmed."""
        if _TRIM is None or not self.due(resident_bytes()):
            return False
        self._last_at = time.monotonic()
        self._released = 0
        before = resident_bytes()
        await asyncio.to_thread(trim_heap)
        after = resident_bytes()
        self.trims += 1
        self.freed += max(0, before - after)
        self._last_rss = after
        log.debug("heap trimmed: resident %d -> %d MB", before >> 20, after >> 20)
        return True
