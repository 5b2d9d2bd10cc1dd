"""The storage interface of the control plane.

Every backend (``MemoryStore``, ``SqlStore`` on SQLite or PostgreSQL) implements
``Store``; one contract test class (tests/controlplane/test_store_contract.py) runs against
each of them.

Thread safety: every method may be called from any thread, concurrently.

Errors: a method raises ``StorageError`` when the database fails, ``InvalidInputError``
when a value is one the database cannot hold (never worth a retry), ``TenantExistsError`` /
``TenantNotFoundError`` as documented below, and nothing else. A method that raises has
changed nothing.

Ordering: committed tool calls (and, separately, program ends) get strictly increasing
positions ``seq``. A reader that has seen every row up to ``seq`` never later finds a new
row below it (writers commit in ``seq`` order), so tailing the log by position is exact.

Retention: ``compact_log`` deletes rows a stored snapshot covers and that lie beyond a
``Horizon``; positions are never reused (the newest row of each log is always kept), and
``log_compaction`` names the positions below which the log may no longer be whole.
"""

from __future__ import annotations

import hashlib
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from controlplane.records import (
    AppendResult,
    MissQuery,
    MissReason,
    ProgramEnd,
    SnapshotRecord,
    StoredProgramEnd,
    StoredToolCall,
    Tenant,
    ToolCall,
)
from controlplane.storage.outages import Outages
from controlplane.storage.rollouts import Rollout, StoredRollout

__all__ = [
    "SNAPSHOTS_KEPT",
    "Batch",
    "Compaction",
    "Horizon",
    "SnapshotSupersededError",
    "Store",
    "TenantChange",
    "hash_token",
    "new_token",
]

#: One tenant's batch of tool calls, as a group commit takes it.
Batch = tuple[Tenant, Sequence[ToolCall]]

#: Snapshots kept per policy (older ones are deleted when a new one is saved).
SNAPSHOTS_KEPT = 2


@dataclass(frozen=True, slots=True)
class TenantChange:
    """A tenant as a write that changed who its token is left it: created, revoked, or given
    a new token (``Store.tenant_changes``). ``seq`` orders the changes (store-wide)."""

    seq: int
    tenant: Tenant
    token_hash: str


@dataclass(frozen=True, slots=True)
class Horizon:
    """What of the event log is kept: rows received within ``max_age_s`` seconds, and each
    tenant's newest ``max_rows`` rows (per log: tool calls, program ends). A row outside
    either bound is beyond the horizon (None: no bound of that kind)."""

    max_age_s: float | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_age_s is None and self.max_rows is None:
            raise ValueError("a retention horizon needs an age or a row count")
        if self.max_age_s is not None and not self.max_age_s >= 0:
            raise ValueError(f"retention age must be >= 0 seconds, got {self.max_age_s!r}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"rows kept per tenant must be >= 1, got {self.max_rows!r}")

    def cutoff(self, now: float) -> float | None:
        """Rows received before this time are beyond the horizon's age (None: no age)."""
        return None if self.max_age_s is None else now - self.max_age_s


@dataclass(frozen=True, slots=True)
class Compaction:
    """One compaction of the log: the snapshot positions it covers (rows at or below them
    may be gone), the horizon's ``cutoff`` time and ``keep_rows``, when it started and
    finished (None: not finished, or a dry run), and the rows it deleted (a dry run: would
    delete) and kept."""

    policy: str
    tool_seq: int
    end_seq: int
    cutoff: float | None
    keep_rows: int | None
    started_at: float
    finished_at: float | None = None
    tool_rows_deleted: int = 0
    end_rows_deleted: int = 0
    tool_rows_kept: int = 0
    end_rows_kept: int = 0


class SnapshotSupersededError(RuntimeError):
    """The newest stored snapshot no longer covers the positions to compact (a lagging
    server stored an older one meanwhile): nothing was deleted; the next round retries."""


def new_token() -> str:
    """A fresh bearer token (256 random bits)."""
    return "cttl_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """What is stored of a token: its SHA-256, hex (tokens are random, so no salt)."""
    return hashlib.sha256(token.encode()).hexdigest()


class Store(ABC):
    """Append-only log of tool calls and program ends, tenants, and model snapshots."""

    # -- tenants ----------------------------------------------------------------------

    @abstractmethod
    def create_tenant(self, name: str, share: bool, token_hash: str, now: float) -> Tenant:
        """Add a tenant with its token's hash. Raises ``TenantExistsError``."""

    @abstractmethod
    def list_tenants(self) -> list[Tenant]:
        """Every tenant, revoked ones included, sorted by name."""

    @abstractmethod
    def revoke_tenant(self, name: str, now: float) -> None:
        """Disable the tenant's token (its data stays). Raises ``TenantNotFoundError``."""

    @abstractmethod
    def rotate_token(self, name: str, token_hash: str) -> Tenant:
        """Give the tenant a new token's hash: the old token stops working at once (its
        lookups find nobody), and a revoked tenant is active again with the new token.
        Returns the tenant. Raises ``TenantNotFoundError``."""

    @abstractmethod
    def tenant_by_token_hash(self, token_hash: str) -> Tenant | None:
        """The tenant holding this token (revoked ones too: check ``revoked_at``), or None."""

    @abstractmethod
    def tenant_changes(self, after_seq: int) -> list[TenantChange]:
        """The tenants whose token changed (created, revoked, rotated) in a write after
        position ``after_seq``, each as it is now, in ``seq`` order; ``after_seq=-1``:
        every tenant. Writers commit changes in ``seq`` order, so a reader that saw up to
        ``seq`` never later finds a change below it. What a server's tail reads so that a
        revocation reaches every replica's token cache (:mod:`controlplane.rpc.auth`)."""

    @abstractmethod
    def set_rollout(self, name: str, rollout: Rollout | None, now: float) -> StoredRollout:
        """Set tenant ``name``'s rollout (``None``: none, its engines' own setting
        applies), raising its ``version`` by one whether or not it changed. Returns it as
        stored (``rollout`` ``None`` when cleared). Raises ``TenantNotFoundError``."""

    @abstractmethod
    def rollouts(self) -> list[StoredRollout]:
        """Every tenant's rollout row, cleared ones too (``rollout`` ``None``), sorted by
        tenant name (:mod:`controlplane.storage.rollouts`)."""

    @cached_property
    def outages(self) -> Outages:
        """The database outages of the background loops working on this store
        (:mod:`controlplane.storage.outages`)."""
        return Outages()

    # -- the event log ----------------------------------------------------------------

    def append_tool_calls(self, tenant: Tenant, calls: Sequence[ToolCall]) -> AppendResult:
        """Commit the calls whose ``event_id`` the tenant has not stored yet, atomically.

        Repeats (already stored, or earlier in the same batch) are counted in
        ``duplicates`` and ignored. Returns only after the commit.
        """
        return self.append_batches([(tenant, calls)])[0]

    @abstractmethod
    def append_batches(self, batches: Sequence[Batch]) -> list[AppendResult]:
        """Commit several batches, of one tenant or several, as one (a group commit: all of
        them or, if it raises, none); each batch's result as :meth:`append_tool_calls`
        gives it, in order. A call repeating one of an earlier batch of the group (same
        tenant and ``event_id``) is that batch's duplicate."""

    @abstractmethod
    def append_program_end(self, tenant: Tenant, end: ProgramEnd) -> int | None:
        """Commit a program's end; its ``seq``, or None if that end is stored.

        An end is identified by (tenant, ``program_id``, ``finished_at``): a program id that
        runs again ends at another time and that end is stored too, while resending the
        same end (a retry) is a repeat whatever its ``total_turns``. Another engine's view
        of the same end, stamped by its own clock, is stored as an end of its own (the
        log is only appended to; learning tells the two apart, see
        ``ModelState.apply_program_ends``). Ends without ``finished_at`` stay one per
        program id (None is matched as a value).
        """

    @abstractmethod
    def read_tool_calls(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredToolCall]:
        """Committed tool calls with ``seq > after_seq`` in ``seq`` order (one tenant's)."""

    @abstractmethod
    def read_program_ends(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredProgramEnd]:
        """Committed program ends with ``seq > after_seq`` in ``seq`` order."""

    @abstractmethod
    def count_tool_calls(self, tenant: str | None = None) -> int:
        """Committed tool calls (of one tenant, or all)."""

    @abstractmethod
    def log_rows(self) -> tuple[int, int]:
        """Rows the log holds now: (tool calls, program ends)."""

    # -- retention --------------------------------------------------------------------

    @abstractmethod
    def compact_log(
        self, snapshot: SnapshotRecord, horizon: Horizon, now: float, dry_run: bool = False
    ) -> Compaction:
        """Delete the rows ``snapshot`` (a stored, restorable snapshot) covers that are
        beyond ``horizon`` at time ``now``; returns what was done (``dry_run``: what would
        be deleted, nothing changed).

        The compaction's record (``log_compaction``) is committed before the first row is
        deleted; rows go in short transactions of their own, so writers wait for one batch
        at a time. A row above the snapshot's positions is never deleted, nor the newest
        row of either log (positions are never reused). A compaction interrupted (a crash)
        leaves some of its rows; the next one deletes them.
        """

    @abstractmethod
    def log_compaction(self) -> Compaction | None:
        """The latest compaction (its positions never decrease), or None: the log is
        whole. Rows at or below its positions may be gone."""

    # -- returning turns --------------------------------------------------------------

    @abstractmethod
    def list_misses(self, tenant: str, query: MissQuery) -> list[StoredToolCall]:
        """The tenant's committed tool calls whose returning turn's reason is in
        ``query.reasons``, of ``query.tool`` and ``query.program`` when set, newest
        (highest ``seq``) first, at most ``query.limit``."""

    @abstractmethod
    def miss_counts(
        self, tenant: str, tool: str | None = None, program: str | None = None
    ) -> dict[MissReason, int]:
        """The tenant's returning turns by reason (those reporting one), of one tool and
        one program when given; reasons without turns are absent."""

    @abstractmethod
    def expired_by(
        self, tenant: str, tool: str | None = None, program: str | None = None, limit: int = 10_000
    ) -> list[float]:
        """``expired_by_s`` of the tenant's newest ``limit`` expired returning turns that
        report it (of one tool and program when given), newest first."""

    # -- snapshots --------------------------------------------------------------------

    @abstractmethod
    def save_snapshot(self, snapshot: SnapshotRecord) -> bool:
        """Store a model snapshot (keeps the newest ``SNAPSHOTS_KEPT`` per policy); False,
        nothing stored, if it is below the latest compaction's positions (it could not be
        restored: rows it would need are gone)."""

    @abstractmethod
    def latest_snapshot(self, policy: str) -> SnapshotRecord | None:
        """The newest snapshot of ``policy``'s models, or None."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
