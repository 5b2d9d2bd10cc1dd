"""``Store`` kept in process memory (tests, simulations, throw-away servers)."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

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
from controlplane.storage.base import (
    SNAPSHOTS_KEPT,
    Batch,
    Compaction,
    Horizon,
    SnapshotSupersededError,
    Store,
    TenantChange,
)
from controlplane.storage.rollouts import Rollout, StoredRollout

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
        self._received: dict[tuple[str, int], float] = {}  # (log, seq) -> received at
        self._last = {"calls": 0, "ends": 0}  # the highest position drawn, per log
        self._compactions: list[Compaction] = []
        self._rollouts: dict[str, StoredRollout] = {}

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

    def set_rollout(self, name: str, rollout: Rollout | None, now: float) -> StoredRollout:
        with self._lock:
            if name not in self._tenants:
                raise TenantNotFoundError(f"no tenant named {name!r}")
            old = self._rollouts.get(name)
            version = (old.version if old is not None else 0) + 1
            stored = self._rollouts[name] = StoredRollout(name, rollout, version, now)
            return stored

    def rollouts(self) -> list[StoredRollout]:
        with self._lock:
            return [self._rollouts[name] for name in sorted(self._rollouts)]

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
                    seqs.append(self._next("calls"))
                    self._calls.append(StoredToolCall(seqs[-1], tenant.name, tenant.share, call))
                results.append(AppendResult(tuple(seqs), len(calls) - len(seqs)))
        return results

    def append_program_end(self, tenant: Tenant, end: ProgramEnd) -> int | None:
        with self._lock:
            key = (tenant.id, end.program_id, end.finished_at)  # one end per run
            if key in self._end_ids:
                return None
            self._end_ids.add(key)
            seq = self._next("ends")
            self._ends.append(StoredProgramEnd(seq, tenant.name, end))
            return seq

    def _next(self, log: str) -> int:
        """Draw the next position of ``log`` (under the lock)."""
        self._last[log] += 1
        self._received[(log, self._last[log])] = time.time()
        return self._last[log]

    def read_tool_calls(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredToolCall]:
        with self._lock:
            rows = self._calls[bisect.bisect_right(self._calls, after_seq, key=_seq) :]
        return [r for r in rows if tenant is None or r.tenant == tenant][:limit]

    def read_program_ends(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredProgramEnd]:
        with self._lock:
            rows = self._ends[bisect.bisect_right(self._ends, after_seq, key=_seq) :]
        return [r for r in rows if tenant is None or r.tenant == tenant][:limit]

    def log_rows(self) -> tuple[int, int]:
        with self._lock:
            return len(self._calls), len(self._ends)

    def compact_log(
        self, snapshot: SnapshotRecord, horizon: Horizon, now: float, dry_run: bool = False
    ) -> Compaction:
        cutoff = horizon.cutoff(now)
        with self._lock:
            if not dry_run:
                kept = self._snapshots.get(snapshot.policy) or [snapshot]
                newest = kept[-1]
                if newest.tool_seq < snapshot.tool_seq or newest.end_seq < snapshot.end_seq:
                    raise SnapshotSupersededError("the newest snapshot is below the positions")
            logs: dict[str, tuple[list[Any], int]] = {
                "calls": (self._calls, snapshot.tool_seq),
                "ends": (self._ends, snapshot.end_seq),
            }
            deleted = {}
            for log, (rows, position) in logs.items():
                gone = self._beyond(log, rows, min(position, self._last[log] - 1), horizon, cutoff)
                deleted[log] = len(gone)
                if not dry_run:
                    self._forget_ids([r for r in rows if r.seq in gone])
                    rows[:] = [r for r in rows if r.seq not in gone]
                    for seq in gone:
                        del self._received[(log, seq)]
            done = Compaction(
                snapshot.policy,
                snapshot.tool_seq,
                snapshot.end_seq,
                cutoff,
                horizon.max_rows,
                now,
                None if dry_run else time.time(),
                deleted["calls"],
                deleted["ends"],
                len(self._calls) - (deleted["calls"] if dry_run else 0),
                len(self._ends) - (deleted["ends"] if dry_run else 0),
            )
            if not dry_run:
                self._compactions.append(done)
            return done

    def _forget_ids(self, rows: Sequence[StoredToolCall | StoredProgramEnd]) -> None:
        """Deleted rows are no longer repeats of anything, as in SQL (under the lock)."""
        for row in rows:
            tenant_id = self._tenants[row.tenant].id
            if isinstance(row, StoredToolCall):
                self._event_ids.discard((tenant_id, row.call.event_id))
            else:
                self._end_ids.discard((tenant_id, row.end.program_id, row.end.finished_at))

    def _beyond(
        self,
        log: str,
        rows: Sequence[StoredToolCall | StoredProgramEnd],
        bound: int,
        horizon: Horizon,
        cutoff: float | None,
    ) -> set[int]:
        """Positions of ``rows`` at or below ``bound`` beyond the horizon (under the lock)."""
        newest: dict[str, int] = {}  # tenant -> rows seen, newest first
        gone = set()
        for row in reversed(rows):
            n = newest[row.tenant] = newest.get(row.tenant, 0) + 1
            old = cutoff is not None and self._received[(log, row.seq)] < cutoff
            many = horizon.max_rows is not None and n > horizon.max_rows
            if row.seq <= bound and (old or many):
                gone.add(row.seq)
        return gone

    def log_compaction(self) -> Compaction | None:
        with self._lock:
            return self._compactions[-1] if self._compactions else None

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

    def save_snapshot(self, snapshot: SnapshotRecord) -> bool:
        with self._lock:
            mark = self._compactions[-1] if self._compactions else None
            if mark is not None and (
                snapshot.tool_seq < mark.tool_seq or snapshot.end_seq < mark.end_seq
            ):
                return False
            kept = self._snapshots.setdefault(snapshot.policy, [])
            kept.append(snapshot)
            del kept[:-SNAPSHOTS_KEPT]
            return True

    def latest_snapshot(self, policy: str) -> SnapshotRecord | None:
        with self._lock:
            kept = self._snapshots.get(policy)
            return kept[-1] if kept else None


def _seq(row: StoredToolCall | StoredProgramEnd) -> int:
    return row.seq
