"""The control plane's domain service: ingest, decisions, inspection, snapshots.

Transport-free (the gRPC servicer and the CLI call it); thread-safe. Writes go to the
store first; the in-memory models learn only committed rows, in log order, so a server's
models always equal a replay of the log up to its ``version``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise
from typing import Any

from controlplane import inspection
from controlplane.records import (
    AppendResult,
    ProgramEnd,
    SnapshotRecord,
    StoredProgramEnd,
    StoredToolCall,
    Tenant,
    ToolCall,
)
from controlplane.state import ModelState
from controlplane.store import Store, hash_token, new_token
from estimator import Decision, RequestFacts, get_policy

__all__ = ["ControlPlane"]

#: Rows read per query while catching up with the log.
READ_BATCH = 5000
#: How long an authenticated token is trusted before the store is asked again (so a
#: revocation takes effect within this many seconds).
AUTH_CACHE_S = 2.0


class ControlPlane:
    """Learned state of every tenant over one store, under one policy."""

    def __init__(
        self,
        store: Store,
        policy: str = "cachettl",
        policy_params: dict[str, Any] | None = None,
        min_samples: int = 100,
        clock: Callable[[], float] = time.time,
        profile: str = "llama3.1-8b-h100",
    ) -> None:
        self.store = store
        self.policy_name = policy
        self.policy = get_policy(policy, **(policy_params or {}))
        self.min_samples = min_samples
        self.profile = profile
        self.clock = clock
        self._lock = threading.RLock()
        # One writer at a time in this process: the database orders writers anyway (SQLite's
        # write lock, PostgreSQL's advisory lock), and a batch committed and learned under
        # one lock is always learned in log order, never by re-reading the log.
        self._write_lock = threading.Lock()
        self._auth: dict[str, tuple[Tenant | None, float]] = {}
        self._snapshot_version = -1
        self.state = self._restore()

    # -- start-up and the log ---------------------------------------------------------

    def _restore(self) -> ModelState:
        self.state = ModelState.fresh(self.policy, self.min_samples, self.profile)
        record = self.store.latest_snapshot(self.policy_name)
        if record is not None:
            restored = ModelState.loads(record.payload)
            if restored.config == self.state.config:  # else: replay the whole log
                self.state = restored
                self._snapshot_version = restored.version
        self.catch_up()
        return self.state

    def catch_up(self) -> int:
        """Learn every committed row past the current position; returns how many."""
        applied = 0
        with self._lock:
            while rows := self.store.read_tool_calls(self.state.tool_seq, READ_BATCH):
                applied += self.state.apply_tool_calls(rows)
            while ends := self.store.read_program_ends(self.state.end_seq, READ_BATCH):
                applied += self.state.apply_program_ends(ends)
        return applied

    @property
    def version(self) -> int:
        with self._lock:
            return self.state.version

    def write_snapshot(self) -> bool:
        """Store a snapshot if the models changed since the last one (write-behind)."""
        with self._lock:
            if self.state.version == self._snapshot_version:
                return False
            state = self.state
            record = SnapshotRecord(
                self.policy_name, state.tool_seq, state.end_seq, self.clock(), state.dumps()
            )
            version = state.version
        self.store.save_snapshot(record)
        self._snapshot_version = version
        return True

    # -- tenants ----------------------------------------------------------------------

    def create_tenant(self, name: str, share: bool = False) -> tuple[Tenant, str]:
        """Add a tenant; returns it and its bearer token (shown once, stored hashed)."""
        from controlplane.validation import check_name

        check_name("name", name, "tenant_name")
        token = new_token()
        return self.store.create_tenant(name, share, hash_token(token), self.clock()), token

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant holding ``token``, revoked or not (cached for ``AUTH_CACHE_S``)."""
        found, tenant = self.cached_tenant(token)
        if found:
            return tenant
        now = time.monotonic()
        tenant = self.store.tenant_by_token_hash(hash_token(token))
        if len(self._auth) > 10_000:
            self._auth.clear()
        self._auth[token] = (tenant, now)
        return tenant

    def cached_tenant(self, token: str) -> tuple[bool, Tenant | None]:
        """``(True, tenant)`` if the token was looked up recently, else ``(False, None)``."""
        cached = self._auth.get(token)
        if cached is not None and time.monotonic() - cached[1] < AUTH_CACHE_S:
            return True, cached[0]
        return False, None

    # -- ingest -----------------------------------------------------------------------

    def record_tool_calls(self, tenant: Tenant, calls: Sequence[ToolCall]) -> AppendResult:
        """Commit a validated batch, then learn it; returns once both are done."""
        with self._write_lock:
            result = self.store.append_tool_calls(tenant, calls)
            with self._lock:
                seqs = result.seqs
                in_order = (
                    result.duplicates == 0
                    and bool(seqs)
                    and seqs[0] == self.state.tool_seq + 1
                    and all(b == a + 1 for a, b in pairwise(seqs))
                )
                if in_order:  # nobody wrote in between: learn the batch as sent
                    rows = [
                        StoredToolCall(s, tenant.name, tenant.share, c)
                        for s, c in zip(seqs, calls, strict=True)
                    ]
                    self.state.apply_tool_calls(rows)
                elif seqs:
                    self.catch_up()  # another server wrote in between: learn in log order
        return result

    def record_program_end(self, tenant: Tenant, end: ProgramEnd) -> int | None:
        """Commit and learn a program's end; its position, or None for a repeat."""
        with self._write_lock:
            seq = self.store.append_program_end(tenant, end)
            if seq is not None:
                with self._lock:
                    if seq == self.state.end_seq + 1:
                        self.state.apply_program_ends([StoredProgramEnd(seq, tenant.name, end)])
                    else:
                        self.catch_up()
        return seq

    # -- decisions and inspection -----------------------------------------------------

    def decide(self, tenant: Tenant, facts: RequestFacts) -> tuple[Decision, int]:
        """The policy's decision on the current models, and their version.

        ``facts.tenant`` and ``facts.share`` are replaced by ``tenant``'s (a tenant is the
        caller's token, never a field of the request).
        """
        facts = replace(facts, tenant=tenant.name, share=tenant.share)
        with self._lock:
            return self.policy.decide(facts, self.state.models), self.state.version

    def list_tools(self, tenant: str) -> list[inspection.ToolView]:
        with self._lock:
            return inspection.list_tools(self.state, tenant)

    def tool_distribution(
        self, tenant: str, tool: str, args: str = "", points: int = 50
    ) -> inspection.DistributionView | None:
        with self._lock:
            return inspection.distribution(self.state, tenant, tool, args, points)

    def workload_stats(self, tenant: str) -> inspection.WorkloadView:
        with self._lock:
            return inspection.workload(self.state, tenant)

    def snapshot_for(self, tenant: str, share: bool) -> inspection.SnapshotView:
        with self._lock:
            return inspection.snapshot(self.state, tenant, share)
