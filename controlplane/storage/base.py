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

__all__ = ["SNAPSHOTS_KEPT", "Batch", "Store", "TenantChange", "hash_token", "new_token"]

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
    def save_snapshot(self, snapshot: SnapshotRecord) -> None:
        """Store a model snapshot (keeps the newest ``SNAPSHOTS_KEPT`` per policy)."""

    @abstractmethod
    def latest_snapshot(self, policy: str) -> SnapshotRecord | None:
        """The newest snapshot of ``policy``'s models, or None."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
