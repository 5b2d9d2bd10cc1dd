"""``Store`` kept in process memory (tests, simulations, throw-away servers)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

from controlplane.errors import TenantExistsError, TenantNotFoundError
from controlplane.records import (
    AppendResult,
    MissQuery,
    MissReason,
    ProgramEnd,
    SnapshotRecord,
    StoredProgramEnd,
    StoredToolCall,
    Tenant,
)
from controlplane.storage.base import SNAPSHOTS_KEPT, Batch, Store, TenantChange

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """A ``Store`` in dictionaries behind one lock; lost when the process ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[str, Tenant] = {}
        self._hashes: dict[str, str] = {}  # token hash -> tenant name
        self._calls: list[StoredToolCall] = []
        self._event_ids: set[tuple[int, str]] = set()
        self._ends: list[StoredProgramEnd] = []
        self._end_ids: set[tuple[int, str, float | None]] = set()
        self._snapshots: dict[str, list[SnapshotRecord]] = {}
        self._auth_seq: dict[str, int] = {}  # tenant name -> position of its token change

    def create_tenant(self, name: str, share: bool, token_hash: str, now: float) -> Tenant:
        with self._lock:
            if name in self._tenants:
                raise TenantExistsError(f"tenant {name!r} already exists")
            tenant = Tenant(len(self._tenants) + 1, name, share, now)
            self._tenants[name] = tenant
            self._hashes[token_hash] = name
            self._changed(name)
            return tenant

    def list_tenants(self) -> list[Tenant]:
        with self._lock:
            return sorted(self._tenants.values(), key=lambda t: t.name)

    def revoke_tenant(self, name: str, now: float) -> None:
        with self._lock:
            tenant = self._tenants.get(name)
            if tenant is None:
                raise TenantNotFoundError(f"no tenant named {name!r}")
            if tenant.revoked_at is None:
                self._tenants[name] = replace(tenant, revoked_at=now)
                self._changed(name)

    def rotate_token(self, name: str, token_hash: str) -> Tenant:
        with self._lock:
            tenant = self._tenants.get(name)
            if tenant is None:
                raise TenantNotFoundError(f"no tenant named {name!r}")
            for old in [h for h, n in self._hashes.items() if n == name]:
                del self._hashes[old]
            self._hashes[token_hash] = name
            tenant = self._tenants[name] = replace(tenant, revoked_at=None)
            self._changed(name)
            return tenant

    def tenant_by_token_hash(self, token_hash: str) -> Tenant | None:
        with self._lock:
            name = self._hashes.get(token_hash)
            return self._tenants.get(name) if name is not None else None

    def _changed(self, name: str) -> None:
        self._auth_seq[name] = max(self._auth_seq.values(), default=0) + 1

    def tenant_changes(self, after_seq: int) -> list[TenantChange]:
        with self._lock:
            hashes = {n: h for h, n in self._hashes.items()}
            changes = [
                TenantChange(seq, self._tenants[name], hashes[name])
                for name, seq in self._auth_seq.items()
                if seq > after_seq
            ]
        return sorted(changes, key=lambda c: c.seq)

    def append_batches(self, batches: Sequence[Batch]) -> list[AppendResult]:
        results = []
        with self._lock:
            for tenant, calls in batches:
                seqs: list[int] = []
                for call in calls:
                    key = (tenant.id, call.event_id)
                    if key in self._event_ids:
                        continue
                    self._event_ids.add(key)
                    seqs.append(len(self._calls) + 1)
                    self._calls.append(StoredToolCall(seqs[-1], tenant.name, tenant.share, call))
                results.append(AppendResult(tuple(seqs), len(calls) - len(seqs)))
        return results

    def append_program_end(self, tenant: Tenant, end: ProgramEnd) -> int | None:
        with self._lock:
            key = (tenant.id, end.program_id, end.finished_at)  # one end per run
            if key in self._end_ids:
                return None
            self._end_ids.add(key)
            seq = len(self._ends) + 1
            self._ends.append(StoredProgramEnd(seq, tenant.name, end))
            return seq

    def read_tool_calls(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredToolCall]:
        with self._lock:
            rows = self._calls[max(after_seq, 0) :]
        return [r for r in rows if tenant is None or r.tenant == tenant][:limit]

    def read_program_ends(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredProgramEnd]:
        with self._lock:
            rows = self._ends[max(after_seq, 0) :]
        return [r for r in rows if tenant is None or r.tenant == tenant][:limit]

    def count_tool_calls(self, tenant: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self._calls if tenant is None or r.tenant == tenant)

    def _turns(self, tenant: str, tool: str | None, program: str | None) -> list[StoredToolCall]:
        """The tenant's calls (of the tool and program when given), newest first."""
        with self._lock:
            rows = list(self._calls)
        return [
            r
            for r in reversed(rows)
            if r.tenant == tenant
            and (tool is None or r.call.tool == tool)
            and (program is None or r.call.program_id == program)
        ]

    def list_misses(self, tenant: str, query: MissQuery) -> list[StoredToolCall]:
        rows = self._turns(tenant, query.tool, query.program)
        return [r for r in rows if r.call.cache.reason in query.reasons][: query.limit]

    def miss_counts(
        self, tenant: str, tool: str | None = None, program: str | None = None
    ) -> dict[MissReason, int]:
        counts: dict[MissReason, int] = {}
        for r in self._turns(tenant, tool, program):
            reason = r.call.cache.reason
            if reason is not MissReason.UNSPECIFIED:
                counts[reason] = counts.get(reason, 0) + 1
        return counts

    def expired_by(
        self, tenant: str, tool: str | None = None, program: str | None = None, limit: int = 10_000
    ) -> list[float]:
        values = [
            r.call.cache.expired_by_s
            for r in self._turns(tenant, tool, program)
            if r.call.cache.reason is MissReason.EXPIRED and r.call.cache.expired_by_s is not None
        ]
        return values[:limit]

    def save_snapshot(self, snapshot: SnapshotRecord) -> None:
        with self._lock:
            kept = self._snapshots.setdefault(snapshot.policy, [])
            kept.append(snapshot)
            del kept[:-SNAPSHOTS_KEPT]

    def latest_snapshot(self, policy: str) -> SnapshotRecord | None:
        with self._lock:
            kept = self._snapshots.get(policy)
            return kept[-1] if kept else None
