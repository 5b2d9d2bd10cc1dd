"""The link's durable event buffer: memory first, then append-only spill segments on disk.

Only the link's sender thread (and :meth:`ControlPlaneLink.close` once that thread has
stopped) calls an :class:`EventBuffer`; the scheduler's thread never touches the disk.

On disk: segment files ``spill-NNNNNNNNN.jsonl`` in the spill folder, one JSON event per
line, appended to through one open file until a segment holds ``segment_events`` lines or
``segment_bytes`` bytes (then the next segment is opened: files are rotated by size, never
one per flush). :meth:`EventBuffer.sync` flushes and ``fsync`` s the open segment. A
segment is read back whole when memory runs empty and deleted only once every event in it
was delivered, so a crash between reading and delivering sends those events again (the
control plane drops repeats by event id). A line a crash tore is skipped and counted (``corrupt``).

The bound: ``max_bytes`` of segment files in the folder (those found at start included).
An event that would pass it is not written: it is dropped and counted (``dropped``), with
one warning per run of drops; the events already on disk are kept and delivered first. A
disk that refuses a write (full before the bound, read-only, failing) is treated alike:
what the open segment holds on disk stays and is delivered, the events the refused write
carried and those that come while the disk refuses are dropped and counted (``dropped``),
one warning per run, and an event a second later tries the disk again. The link's
thread never dies of it.

:func:`default_spill_dir` is the stable per-engine folder used when ``spill_dir`` is unset,
and :func:`claim_spill_dir` makes sure two live engines never share one.

A spill folder belongs to one credential (the control-plane token it was written under):
the folder holds :data:`OWNER_FILE`, a salted SHA-256 of the token (never the token), and
events in it are delivered only under that token. Whoever delivers them is the tenant that
reads them, so an engine started with another token never delivers them: it logs one line
naming the folder and spills elsewhere (:func:`claim_spill_dir`); the files stay in place
for an engine that holds the token they were written under.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO

from enginehook.core.tracker import (
    ProgramEndReport,
    ToolCallReport,
    event_from_record,
    event_record,
)

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SPILL_MAX_BYTES",
    "OWNER_FILE",
    "EventBuffer",
    "ForeignSpillError",
    "claim_spill_dir",
    "credential_id",
    "default_spill_dir",
]

logger = logging.getLogger("enginehook.link.spill")

Event = ToolCallReport | ProgramEndReport

#: Seconds after the disk refused a write before the spill tries it again.
REFUSED_RETRY_S = 1.0
#: The spill's default bound on disk (``spill_max_bytes``).
DEFAULT_SPILL_MAX_BYTES = 256 * 1024 * 1024

#: A spill segment's default bound in bytes (the next one is opened past it).
DEFAULT_SEGMENT_BYTES = 4 * 1024 * 1024

_LOCK_NAME = ".lock"
#: The file in a spill folder naming the credential its events were written under.
OWNER_FILE = ".owner"
_OWNER_SALT = b"cachettl-spill-owner\0"


class ForeignSpillError(RuntimeError):
    """A spill folder holds events written under another credential."""


def credential_id(token: str) -> str:
    """A salted SHA-256 of ``token`` (32 hex digits): what a spill folder's name and its
    :data:`OWNER_FILE` hold in place of the token, which never reaches the disk.

    >>> credential_id("t-1") == credential_id("t-1") != credential_id("t-2")
    True
    >>> "t-1" in credential_id("t-1")
    False
    """
    return hashlib.sha256(_OWNER_SALT + token.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def default_spill_dir(control_plane: str, tenant: str, key: str = "", token: str = "") -> Path:
    """``<user cache dir>/cachettl/spill/<engine key>``: the same folder at every start of
    the same engine (this host, control plane, tenant name, credential and ``key``, e.g.
    the model), so events an earlier process spilled are found and delivered. The
    credential enters as :func:`credential_id`: engines with different tokens never share
    a folder, whatever tenant name their configs give."""
    import platformdirs

    ident = "\0".join((socket.gethostname(), control_plane, tenant, key, credential_id(token)))
    name = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return Path(platformdirs.user_cache_dir("cachettl")) / "spill" / name


def _has_spill(folder: Path) -> bool:
    return any(folder.glob("spill-*.jsonl"))


def folder_owner(folder: Path) -> str | None:
    """The :func:`credential_id` a spill folder belongs to (``None``: not marked)."""
    try:
        return (folder / OWNER_FILE).read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def check_owner(folder: Path, token: str) -> None:
    """Mark ``folder`` as ``token``'s when it holds no spill of anyone else's; raise
    :class:`ForeignSpillError` naming the folder when it holds spill written under another
    credential (or under an unknown one: a folder with segments and no owner mark)."""
    mine, owner = credential_id(token), folder_owner(folder)
    if owner == mine:
        return
    if _has_spill(folder):
        whose = "another credential" if owner else "an unknown credential (no owner mark)"
        raise ForeignSpillError(
            f"spill folder {folder} holds events written under {whose}: not delivered with "
            "this engine's token (they are left in place for an engine that holds theirs)"
        )
    (folder / OWNER_FILE).write_text(mine + "\n", encoding="ascii")


def claim_spill_dir(base: Path, token: str | None = None) -> tuple[Path, IO[bytes]]:
    """``base``, or ``base-2``, ``base-3``... : the first folder no live process holds,
    with its lock (an exclusive ``flock`` kept while the file stays open; the kernel lets
    go of it when the process dies, so a crashed engine's folder is taken over). Given
    ``token``, a folder whose spill was written under another credential is passed over
    (one warning line names it) and the folder claimed is marked as ``token``'s."""
    for n in range(1, 65):
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        folder.mkdir(parents=True, exist_ok=True)
        lock = (folder / _LOCK_NAME).open("ab")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        if token is not None:
            try:
                check_owner(folder, token)
            except ForeignSpillError as error:
                logger.warning("%s", error)
                lock.close()
                continue
        return folder, lock
    raise RuntimeError(f"no free spill folder next to {base} (64 engines hold one)")


class EventBuffer:
    """FIFO of undelivered events: up to ``memory_events`` in memory, the rest in spill
    segments of at most ``segment_events`` lines and ``segment_bytes`` bytes under
    ``spill_dir``, at most ``max_bytes`` of them (see the module docstring). Segments an
    earlier process left are delivered first. Given ``token``, the folder must belong to
    that credential (:func:`check_owner`; :class:`ForeignSpillError` otherwise) and is
    marked as its. Thread-safe, but meant for one thread (the link's sender)."""

    def __init__(
        self,
        spill_dir: str | Path,
        memory_events: int = 10_000,
        segment_events: int = 1000,
        max_bytes: int = DEFAULT_SPILL_MAX_BYTES,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        token: str | None = None,
    ) -> None:
        if min(memory_events, segment_events, max_bytes, segment_bytes) < 1:
            raise ValueError(
                "memory_events, segment_events, segment_bytes and max_bytes must be >= 1"
            )
        self.spill_dir = Path(spill_dir)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        if token is not None:
            check_owner(self.spill_dir, token)
        self.memory_events = memory_events
        self.segment_events = segment_events
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        #: Events not written because the spill was at ``max_bytes``.
        self.dropped = 0
        #: Lines of spill files that could not be read (torn by a crash).
        self.corrupt = 0
        self._memory: deque[Event] = deque()
        self._lock = threading.Lock()
        self._segments: deque[Path] = deque(sorted(self.spill_dir.glob("spill-*.jsonl")))
        self._seq = int(self._segments[-1].stem.split("-")[1]) if self._segments else 0
        self._spilled = sum(_count_lines(p) for p in self._segments)
        self._bytes = sum(p.stat().st_size for p in self._segments)
        self._open: IO[str] | None = None  # the last segment, while it takes more lines
        self._open_lines = 0
        self._open_bytes = 0
        #: Spill segment files opened by this buffer.
        self.segments_opened = 0
        self._loaded: Path | None = None  # the segment the oldest memory events came from
        self._backed = 0  # how many of the oldest memory events are still in _loaded
        self._full = False
        self._refusing = False  # the disk refused a write: new events dropped until _retry_at
        self._retry_at = 0.0
        #: Counts the times :meth:`spill_all` moved events of memory onto the disk: a batch
        #: peeked before that is no longer in memory, and its :meth:`drop` is skipped.
        self.epoch = 0

    def put(self, event: Event) -> None:
        """Queue ``event`` (in memory, or spilled once memory is full or spill is pending)."""
        with self._lock:
            if len(self._memory) < self.memory_events and not self._segments:
                self._memory.append(event)
                return
            self._spill(event)

    def _spill(self, event: Event) -> None:
        line = json.dumps(event_record(event)) + "\n"
        size = len(line.encode())
        if self._bytes + size > self.max_bytes:
            self.dropped += 1
            if not self._full:
                logger.warning(
                    "spill %s is at its bound of %d bytes: dropping new events until "
                    "delivery makes room",
                    self.spill_dir,
                    self.max_bytes,
                )
            self._full = True
            return
        self._full = False
        if self._refusing and time.monotonic() < self._retry_at:
            self.dropped += 1  # the disk refused a write less than a second ago
            return
        try:
            full = self._open_lines >= self.segment_events or self._open_bytes >= self.segment_bytes
            if self._open is None or full:
                self._close_open()
                self._seq += 1
                path = self.spill_dir / f"spill-{self._seq:09d}.jsonl"
                self._open = path.open("a", encoding="utf-8")
                self._segments.append(path)
                self._open_lines = self._open_bytes = 0
                self.segments_opened += 1
            self._open.write(line)
        except OSError as error:
            self.dropped += 1  # this event, and below what the refused write carried
            self._refused(error)
            return
        self._open_lines += 1
        self._open_bytes += size
        self._spilled += 1
        self._bytes += size

    def _refused(self, error: OSError) -> None:
        """The disk refused a write of the open segment: keep what that segment holds on
        disk, count the events it believed written but which are not as dropped, and
        start the next event on a new segment (the module doc)."""
        if not self._refusing:
            logger.warning(
                "spill %s: the disk refused a write (%s): dropping new events until it "
                "takes them again",
                self.spill_dir,
                error.strerror or error,
            )
        self._refusing = True
        self._retry_at = time.monotonic() + REFUSED_RETRY_S
        if self._open is None:
            return
        path = Path(self._open.name)
        with contextlib.suppress(OSError):
            self._open.close()  # the raw file closes even when the flush fails
        self._open = None
        try:
            on_disk = path.read_bytes()
        except OSError:
            on_disk = b""
        # Lines as reading will count them: a torn last one is read, skipped and counted
        # as corrupt there.
        kept = sum(1 for line in on_disk.split(b"\n") if line.strip())
        self.dropped += max(0, self._open_lines - kept)
        self._spilled -= max(0, self._open_lines - kept)
        self._bytes -= self._open_bytes - len(on_disk)
        self._open_lines = self._open_bytes = 0

    def _close_open(self) -> None:
        if self._open is not None:
            try:
                self._open.flush()
                os.fsync(self._open.fileno())
                self._open.close()
            except OSError as error:
                self._refused(error)
            self._open = None

    def sync(self) -> None:
        """Flush the open segment to the disk (``fsync``)."""
        with self._lock:
            if self._open is not None:
                try:
                    self._open.flush()
                    os.fsync(self._open.fileno())
                    self._refusing = False
                except OSError as error:
                    self._refused(error)

    def peek(self, n: int) -> list[Event]:
        """Up to ``n`` oldest events (refilling memory from the oldest spill segment)."""
        with self._lock:
            if not self._memory and self._segments:
                self._refill()
            return [self._memory[i] for i in range(min(n, len(self._memory)))]

    def _refill(self) -> None:
        segment = self._segments.popleft()
        if not self._segments:
            self._close_open()
        lines = segment.read_text(encoding="utf-8").splitlines() if segment.exists() else []
        events: list[Event] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                events.append(_from_json(line))
            except (ValueError, KeyError, TypeError):
                self.corrupt += 1
                logger.warning("spill %s: an unreadable line skipped", segment)
        self._spilled -= sum(1 for line in lines if line.strip())
        size = segment.stat().st_size if segment.exists() else 0
        self._bytes -= size
        self._memory.extend(events)
        self._loaded, self._backed = segment, len(events)
        if not events:
            self._forget_loaded()

    def _forget_loaded(self) -> None:
        if self._loaded is not None:
            self._loaded.unlink(missing_ok=True)
        self._loaded, self._backed = None, 0

    def spill_all(self) -> int:
        """Put every in-memory event on disk (when delivery fails, and at shutdown);
        returns how many were in memory. Events read from a segment that is still on disk
        are not written again."""
        with self._lock:
            backed = self._backed
            moved = list(self._memory)[backed:]
            for _ in range(len(moved)):
                self._memory.pop()
            for event in moved:  # appended to the open segment, rotated by size
                self._spill(event)
            if moved:
                self.epoch += 1
            if self._open is not None:
                try:
                    self._open.flush()  # written; sync() makes it durable
                    self._refusing = False
                except OSError as error:
                    self._refused(error)
            return backed + len(moved)

    def forget_memory(self) -> None:
        """Let go of in-memory events that are still in their segment on disk (at
        shutdown, after :meth:`spill_all`): the next start reads them from there."""
        with self._lock:
            self._memory.clear()
            self._loaded, self._backed = None, 0

    def drop(self, n: int, epoch: int | None = None) -> None:
        """Remove the ``n`` oldest events (after they were delivered). Given the
        :attr:`epoch` read when they were peeked, nothing is removed if :meth:`spill_all`
        moved memory to the disk since: those events are delivered again from there (the
        control plane drops repeats by event id)."""
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return
            n = min(n, len(self._memory))
            for _ in range(n):
                self._memory.popleft()
            if self._loaded is not None:
                self._backed -= min(n, self._backed)
                if self._backed == 0:
                    self._forget_loaded()

    def __len__(self) -> int:
        with self._lock:
            return len(self._memory) + self._spilled

    @property
    def in_memory(self) -> int:
        """Events held in memory."""
        with self._lock:
            return len(self._memory)

    @property
    def spilled_bytes(self) -> int:
        """Bytes of spill segments on disk not yet read back."""
        with self._lock:
            return self._bytes

    def close(self) -> None:
        """Close the open segment (synced)."""
        with self._lock:
            self._close_open()


def _count_lines(path: Path) -> int:
    with path.open(encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())


def _from_json(line: str) -> Event:
    return event_from_record(json.loads(line))
