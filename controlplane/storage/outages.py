"""Database outages as the background loops of one server see them, logged once each.

Every loop that talks to the database in the background (the log's tail, snapshots, the
coherence listener and its upkeep) reports each round to its :class:`LoopHealth`: a round
that fails opens an outage of that loop, logged once, in one line with the cause in one
line (the traceback only at debug level); the rounds that fail after it are counted, not
logged; the first round that succeeds closes it with one line giving the failed rounds and
how long it lasted. So an outage of any length writes two lines per loop that ran during
it, however short the loop's interval.

A failure that is not the database's (no ``StorageError``, driver or socket error in it: a
bug) opens a streak the same way, logged once with its traceback at error level, and does
not count as an outage.

:class:`Outages` is shared by a store's loops (``Store.outages``); the server exports it in
``/metrics``: ``cachettl_database_outages_total{loop}``,
``cachettl_database_failed_rounds_total{loop}`` and ``cachettl_database_reachable`` (0 while
any loop's outage is open).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from controlplane.errors import StorageError

__all__ = ["CAUSE_CHARS", "LoopHealth", "Outages", "is_database_error", "one_line"]

#: Longest cause quoted in a log line (characters).
CAUSE_CHARS = 300


def one_line(error: BaseException) -> str:
    """The error's message on one line (drivers' messages span several), clipped."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 1] + "…"


def is_database_error(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is the database's or the network's."""
    import psycopg  # imported here: SQLite-only installs import this module too

    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, StorageError | SQLAlchemyError | psycopg.Error | OSError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class LoopHealth:
    """One background loop's rounds (module docstring); made by :meth:`Outages.loop`."""

    def __init__(
        self,
        outages: Outages,
        name: str,
        label: str,
        logger: logging.Logger,
        retry: str,
        clock: Callable[[], float],
    ) -> None:
        self.name = name
        self.label = label
        self.retry = retry
        self._outages = outages
        self._log = logger
        self._clock = clock
        self._since: float | None = None  # the open streak's start
        self._database = False  # whether the open streak is an outage
        self._failed = 0

    @property
    def failing(self) -> bool:
        return self._since is not None

    def failed(self, error: BaseException) -> None:
        """A round failed: logged if it opens a streak, else counted."""
        database = is_database_error(error)
        if self._log.isEnabledFor(logging.DEBUG):
            self._log.debug("%s: round failed", self.label, exc_info=error)
        self._failed += 1
        self._outages._round_failed(self.name)
        if self._since is not None:
            return
        self._since, self._database = self._clock(), database
        if database:
            self._outages._opened(self.name)
            self._log.warning(
                "%s: database unreachable (%s); %s; logged again when it answers",
                self.label,
                one_line(error),
                self.retry,
            )
        else:
            self._log.error(
                "%s failed; %s; logged again when it succeeds",
                self.label,
                self.retry,
                exc_info=error,
            )

    def succeeded(self) -> None:
        """A round succeeded: closes the open streak, if any, with one line."""
        if self._since is None:
            return
        lasted, rounds = self._clock() - self._since, self._failed
        database = self._database
        self._since, self._database, self._failed = None, False, 0
        if database:
            self._outages._closed(self.name)
            self._log.warning(
                "%s: database reachable again after %.1f s (%d failed rounds)",
                self.label,
                lasted,
                rounds,
            )
        else:
            self._log.warning(
                "%s: succeeds again after %.1f s (%d failed rounds)", self.label, lasted, rounds
            )


class Outages:
    """The outages of a store's background loops, counted per loop (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._open: set[str] = set()
        #: Outages opened, per loop.
        self.opened: Counter[str] = Counter()
        #: Rounds failed, per loop (outages or not).
        self.failed_rounds: Counter[str] = Counter()

    def loop(
        self,
        name: str,
        label: str,
        logger: logging.Logger,
        retry: str = "retrying",
    ) -> LoopHealth:
        """The health of the loop ``name`` (the metrics' label); ``label`` opens its log
        lines, ``retry`` says what it does meanwhile."""
        return LoopHealth(self, name, label, logger, retry, self._clock)

    @property
    def reachable(self) -> bool:
        """False while some loop's outage is open."""
        with self._lock:
            return not self._open

    def _opened(self, name: str) -> None:
        with self._lock:
            self._open.add(name)
            self.opened[name] += 1

    def _closed(self, name: str) -> None:
        with self._lock:
            self._open.discard(name)

    def _round_failed(self, name: str) -> None:
        with self._lock:
            self.failed_rounds[name] += 1
