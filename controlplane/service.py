"""The control plane's domain service: ingest, decisions, inspection, snapshots.

Transport-free (the gRPC servicer and the CLI call it); thread-safe. Writes go to the
store first; the in-memory models learn only committed rows, in log order, so a server's
models always equal a replay of the log up to its ``version``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise
from typing import Any

from controlplane import inspection
from controlplane.errors import LogCompactedError
from controlplane.learning import (
    LearningCounters,
    NameLimitExceededError,
    NameLimits,
    RetentionCounters,
    check_names,
)
from controlplane.records import (
    AppendResult,
    ProgramEnd,
    SnapshotRecord,
    StoredProgramEnd,
    StoredToolCall,
    Tenant,
    ToolCall,
)
from controlplane.sharing import SharingRules
from controlplane.snapshots import (
    CompactSnapshots,
    RolloutBoard,
    SnapshotPayloads,
    dumps_off_process,
    in_slices,
)
from controlplane.state import ModelState
from controlplane.storage import Store, hash_token, new_token
from controlplane.storage.base import Compaction, Horizon, SnapshotSupersededError
from estimator import DEFAULT_PROFILE, Decision, RequestFacts, get_policy
from estimator.signatures import SignatureRule

__all__ = ["ControlPlane"]

log = logging.getLogger(__name__)

#: Rows read per query while catching up with the log.
READ_BATCH = 5000
#: How long learning, inspection or a snapshot holds the model lock at a time (one row
#: or model more at most); decisions wait at most about this long.
LOCK_SLICE_S = 0.0005
#: Rows learned per call of the state's ``apply`` (the lock's slice is checked between).
LEARN_CHUNK = 8
#: How long ``authenticate`` (in-process callers: the CLI, tests) trusts a lookup. The
#: gRPC server resolves tokens with ``controlplane.rpc.auth.TenantCache`` instead (fresh and
#: stale ages, lookups off the event loop; controlplane/README.md, "Limits").
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
        profile: str = DEFAULT_PROFILE,
        sharing: SharingRules | None = None,
        name_limits: NameLimits | None = None,
        signature_rules: Sequence[SignatureRule] = (),
    ) -> None:
        self.store = store
        #: The operator's signature rules (``--signature-rule``), over the built-in ones.
        self.signature_rules = tuple(signature_rules)
        self.name_limits = name_limits or NameLimits()
        self.learning = LearningCounters()  # rows learning skipped, batches refused
        self.retention = RetentionCounters()  # compactions of the log by this server
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
        # Batches waiting for the write lock: its next holder commits them all together.
        self._queue_lock = threading.Lock()
        self._queued: list[_Pending] = []
        self._auth: dict[str, tuple[Tenant | None, float]] = {}
        self._snapshot_version = -1
        self.sharing = sharing or SharingRules()
        self._payloads = SnapshotPayloads(LOCK_SLICE_S)
        self.compact = CompactSnapshots(LOCK_SLICE_S)
        #: The tenants' rollouts (``cachettl rollout set``), read with each catch-up.
        self.rollouts = RolloutBoard()
        self.state = self._restore()

    # -- start-up and the log ---------------------------------------------------------

    @property
    def model_lock(self) -> threading.RLock:
        """The lock models are learned and read under: hold it to read several of a
        tenant's models as one consistent view."""
        return self._lock

    def _restore(self) -> ModelState:
        self.state = self._restored()
        self.catch_up()
        return self.state

    def _restored(self) -> ModelState:
        """The newest stored snapshot's models if this server can use them, else empty
        ones (the whole log is replayed). Raises ``LogCompactedError`` if the log was
        compacted past what those models cover (rows they would need are gone)."""
        state = self._fresh()
        self.name_limits.apply(state.models.durations)
        record = self.store.latest_snapshot(self.policy_name)
        restored = self._usable(record, state) if record is not None else None
        if restored is not None:
            state = restored
            self._snapshot_version = restored.version
        mark = self.store.log_compaction()
        if mark is not None and (state.tool_seq < mark.tool_seq or state.end_seq < mark.end_seq):
            resigned = self._resigned(record, state, mark) if restored is None else None
            if resigned is not None:
                self._snapshot_version = resigned.version
                return resigned
            raise LogCompactedError(
                f"the event log was compacted through positions {mark.tool_seq}/"
                f"{mark.end_seq} (policy {mark.policy}) and no stored {self.policy_name} "
                "snapshot this server can use covers them: start it with the settings of "
                "the servers that wrote the snapshots (--policy, --profile, --min-samples, "
                "--ttl-cap, the per-tenant name limits), or on a database of its own"
            )
        return state

    def _fresh(self) -> ModelState:
        return ModelState.fresh(
            self.policy, self.min_samples, self.profile, self.sharing, self.signature_rules
        )

    def _usable(self, record: SnapshotRecord, fresh: ModelState) -> ModelState | None:
        """``record``'s models if they were built as ``fresh`` would be, else None."""
        restored = _load_snapshot(record.payload)
        if (
            restored is not None
            and restored.reusable_as(fresh)
            and self.name_limits.holds_for(restored.models.durations)
        ):
            return restored
        return None

    def _resigned(
        self, record: SnapshotRecord | None, fresh: ModelState, mark: Compaction
    ) -> ModelState | None:
        """``record``'s models under this server's signature rules, if only those differ
        and they cover ``mark`` (``ModelState.under_signatures_of``), else None."""
        restored = _load_snapshot(record.payload) if record is not None else None
        resigned = restored.under_signatures_of(fresh, mark) if restored is not None else None
        if resigned is None or not self.name_limits.holds_for(resigned.models.durations):
            return None
        log.warning("stored models keyed by other signature rules: invocations learn again")
        return resigned

    def catch_up(self) -> int:
        """Learn every committed row past the current position, and read the tenants'
        rollouts again; returns how many rows."""
        with self._write_lock:
            applied = self._catch_up()
        self.rollouts.refresh(self.store)
        return applied

    def _catch_up(self) -> int:
        # Under the write lock (positions move only under it): the log is read without the
        # model lock, and learned a slice (LOCK_SLICE_S) per hold of it.
        # A gap before the first row read may be rows a compaction deleted: if the models
        # are below its positions, they start again from the snapshot that covers them.
        applied = 0
        while rows := self.store.read_tool_calls(self.state.tool_seq, READ_BATCH):
            if rows[0].seq > self.state.tool_seq + 1 and self._behind_compaction():
                continue
            applied += self._learn(self.state.apply_tool_calls, rows)
        while ends := self.store.read_program_ends(self.state.end_seq, READ_BATCH):
            if ends[0].seq > self.state.end_seq + 1 and self._behind_compaction():
                continue
            applied += self._learn(self.state.apply_program_ends, ends)
        return applied

    def _behind_compaction(self) -> bool:
        """If the models are below the latest compaction's positions, replace them with
        the snapshot's that covers them (under the write lock); whether they were."""
        mark = self.store.log_compaction()
        state = self.state
        if mark is None or (state.tool_seq >= mark.tool_seq and state.end_seq >= mark.end_seq):
            return False
        restored = self._restored()
        with self._lock:
            self.state = restored
        self.retention.reloads += 1
        log.info(
            "the log was compacted past this server's models (%d/%d < %d/%d): restored "
            "them from the snapshot at %d/%d",
            state.tool_seq,
            state.end_seq,
            mark.tool_seq,
            mark.end_seq,
            restored.tool_seq,
            restored.end_seq,
        )
        return True

    def _learn(self, apply: Callable[[Sequence[Any]], int], rows: Sequence[Any]) -> int:
        """Learn rows in order, :data:`LEARN_CHUNK` at a time, holding the model lock at
        most about ``LOCK_SLICE_S`` at a time and yielding the interpreter between two
        holds, so decisions (answered in the event loop) wait neither for a whole batch
        nor for the interpreter's switch interval."""
        applied, i = 0, 0
        while i < len(rows):
            with self._lock:
                deadline = time.perf_counter() + LOCK_SLICE_S
                while i < len(rows):
                    j = min(len(rows), i + LEARN_CHUNK)
                    before = self._position(rows[i])
                    try:
                        applied += apply(rows[i:j])
                    except Exception as error:  # never fail after a commit: skip the row
                        # rows up to the position were learned; the next one failed
                        learned = self._position(rows[i])
                        k = next((k for k in range(i, j) if rows[k].seq > learned), j - 1)
                        applied += sum(1 for row in rows[i:k] if row.seq > before)
                        self._skip(rows[k], error)
                        j = k + 1
                    i = j
                    if time.perf_counter() >= deadline:
                        break
            if i < len(rows):
                time.sleep(0)  # lets a waiting thread (the event loop) take the GIL now
        return applied

    def _position(self, row: StoredToolCall | StoredProgramEnd) -> int:
        """The log position learned, of ``row``'s log."""
        return self.state.tool_seq if isinstance(row, StoredToolCall) else self.state.end_seq

    def _skip(self, row: StoredToolCall | StoredProgramEnd, error: Exception) -> None:
        """Count a committed row as applied without learning it (counted and logged)."""
        if isinstance(row, StoredToolCall):
            self.state.tool_seq = max(self.state.tool_seq, row.seq)
        else:
            self.state.end_seq = max(self.state.end_seq, row.seq)
        self.learning.skipped(row, error)

    @property
    def version(self) -> int:
        """Log positions learned, all tenants (internal: RPCs report ``tenant_version``)."""
        return self.state.version

    def tenant_version(self, tenant: Tenant) -> int:
        """The model version ``tenant`` is told (its own events, and shared publications
        if it shares, plus its rollout's version): never a function of another tenant's
        volume alone."""
        rollout = self.rollouts.version(tenant.name)
        return self.state.tenant_version(tenant.name, tenant.share) + rollout

    def write_snapshot(self) -> bool:
        """Store a snapshot if the models changed since the last one (write-behind).

        The state is pickled a slice of models at a time (``ModelState.dumps``), so
        decisions and learning wait for one slice at a time, never for the whole state.
        """
        state = self.state
        if state.version == self._snapshot_version:
            return False
        payload, tool_seq, end_seq = dumps_off_process(state, self._lock)
        record = SnapshotRecord(self.policy_name, tool_seq, end_seq, self.clock(), payload)
        stored = self.store.save_snapshot(record)  # False: below a compaction (lagging)
        self._snapshot_version = tool_seq + end_seq
        return stored

    def compact_log(self, horizon: Horizon, dry_run: bool = False) -> Compaction:
        """Delete the log's rows beyond ``horizon`` that a snapshot covers: first a
        snapshot of the models now is stored (durable before any row goes), then the rows
        the newest stored snapshot covers go, if this server can restore from it
        (``Store.compact_log``). Counted in ``self.retention``. Raises
        ``SnapshotSupersededError`` when no such snapshot covers the models' positions
        (nothing deleted; try again)."""
        if not dry_run:
            self.write_snapshot()
        record = self.store.latest_snapshot(self.policy_name)
        fresh = self._fresh()
        self.name_limits.apply(fresh.models.durations)
        if record is None or (not dry_run and self._usable(record, fresh) is None):
            raise SnapshotSupersededError(
                f"no stored {self.policy_name} snapshot this server can restore from"
            )
        done = self.store.compact_log(record, horizon, self.clock(), dry_run)
        if not dry_run:
            self.retention.counted(done)
        return done

    # -- tenants ----------------------------------------------------------------------

    def create_tenant(self, name: str, share: bool = False) -> tuple[Tenant, str]:
        """Add a tenant; returns it and its bearer token (shown once, stored hashed)."""
        from controlplane.validation import check_name

        check_name("name", name, "tenant_name")
        token = new_token()
        return self.store.create_tenant(name, share, hash_token(token), self.clock()), token

    def rotate_token(self, name: str) -> tuple[Tenant, str]:
        """Issue the tenant a new bearer token (shown once); the old one stops working and
        the servers end its streams within their recheck (``TenantNotFoundError`` if no
        such tenant). A revoked tenant is active again."""
        token = new_token()
        return self.store.rotate_token(name, hash_token(token)), token

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
        """Commit a validated batch, then learn it; returns once both are done.

        Raises ``NameLimitExceededError`` (nothing stored) if the batch would give the
        tenant more distinct tool names or signatures than ``name_limits`` allow.

        Batches that arrive while another is being written are committed together, in one
        transaction, by the next writer (a group commit): a store round trip is shared by
        all of them; each batch gets its own result or error. A group holds at most
        ``GROUP_EVENTS`` events (or one batch), smallest batches first and batches already
        passed over before them (:func:`_group`): a small batch waits for at most the one
        large batch being written, not for every large batch queued with it.
        """
        time.sleep(0)  # after the caller's validation: a waiting thread takes the GIL now
        mine = _Pending(tenant, calls)
        with self._queue_lock:
            self._queued.append(mine)
        while not mine.finished:
            with self._write_lock:
                if mine.finished:  # an earlier writer committed it with its group
                    break
                with self._queue_lock:
                    group, self._queued = _group(self._queued)
                self._commit(group)
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result

    def _commit(self, group: list[_Pending]) -> None:
        """Commit and learn ``group`` (under the write lock); every member finishes with
        its result or its error."""
        try:
            admitted = self._append(self._admit_names(group))
        except BaseException as error:  # nothing of the group was committed
            for p in group:
                p.fail(error)
            return
        finally:
            for p in group:
                p.finished = True
        try:
            self._learn_group(admitted)
        except Exception:  # committed and answered: the next write catches the models up
            log.exception("learning %d committed batches failed", len(admitted))

    def _append(self, group: list[_Pending]) -> list[_Pending]:
        """Commit ``group`` as one; if the store refuses it, one batch at a time, so that
        only the batch it refuses fails. The batches committed."""
        if not group:
            return []
        try:
            results = self.store.append_batches([(p.tenant, p.calls) for p in group])
            self.learning.committed(len(group))
        except Exception:
            if len(group) == 1:
                raise
            for p in group:
                try:
                    p.result = self.store.append_tool_calls(p.tenant, p.calls)
                    self.learning.committed(1)
                except Exception as error:
                    p.fail(error)
            return [p for p in group if p.result is not None]
        for p, result in zip(group, results, strict=True):
            p.result = result
        return group

    def _admit_names(self, group: list[_Pending]) -> list[_Pending]:
        """The batches within the name limits, counting the names of those admitted
        before them in the group; the others fail with ``NameLimitExceededError``."""
        admitted: list[_Pending] = []
        earlier: dict[str, list[ToolCall]] = {}
        for p in group:
            before = earlier.setdefault(p.tenant.name, [])
            try:
                check_names(self.state.models.durations, p.tenant.name, p.calls, before)
            except NameLimitExceededError as error:
                self.learning.refused_batch(error)
                p.fail(error)
                continue
            before.extend(p.calls)
            admitted.append(p)
        return admitted

    def _learn_group(self, group: list[_Pending]) -> None:
        """Learn the committed batches: as sent when their rows follow the learned log
        with nothing in between, else by reading the log (another server wrote)."""
        rows: list[StoredToolCall] = []
        for p in group:
            assert p.result is not None
            seqs = p.result.seqs  # positions move only under the write lock, held here
            if p.result.duplicates:
                rows = []
                break
            rows += (
                StoredToolCall(s, p.tenant.name, p.tenant.share, c)
                for s, c in zip(seqs, p.calls, strict=True)
            )
        in_order = (
            bool(rows)
            and rows[0].seq == self.state.tool_seq + 1
            and all(b.seq == a.seq + 1 for a, b in pairwise(rows))
        )
        if in_order:
            self._learn(self.state.apply_tool_calls, rows)
        elif any(p.result is not None and p.result.seqs for p in group):
            self._catch_up()

    def record_program_end(self, tenant: Tenant, end: ProgramEnd) -> int | None:
        """Commit and learn a program's end; its position, or None for a repeat."""
        with self._write_lock:
            seq = self.store.append_program_end(tenant, end)
            if seq is not None:
                if seq == self.state.end_seq + 1:
                    rows = [StoredProgramEnd(seq, tenant.name, end)]
                    self._learn(self.state.apply_program_ends, rows)
                else:
                    self._catch_up()
        return seq

    # -- decisions and inspection -----------------------------------------------------

    def decide(self, tenant: Tenant, facts: RequestFacts) -> tuple[Decision, int]:
        """The policy's decision on the current models, and their version.

        ``facts.tenant`` and ``facts.share`` are replaced by ``tenant``'s (a tenant is the
        caller's token, never a field of the request).
        """
        facts = replace(facts, tenant=tenant.name, share=tenant.share)
        with self._lock:
            decision = self.policy.decide(facts, self.state.models)
            return decision, self.tenant_version(tenant)

    def list_tools(self, tenant: str) -> list[inspection.ToolView]:
        """The tenant's tools, built a slice at a time (never the lock for long)."""
        with self._lock:
            names = self.state.tools_of(tenant)
        views: list[inspection.ToolView] = []

        def add(tool: str) -> None:
            views.extend(inspection.list_tools(self.state, tenant, [tool]))

        in_slices(self._lock, names, add, LOCK_SLICE_S)
        return views

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

    def snapshot_payload(self, tenant: Tenant) -> tuple[int, bytes]:
        """``tenant``'s serialized ``WatchSnapshotsResponse`` and its version, built
        incrementally a slice at a time (``controlplane.snapshots``); call it off the
        event loop."""
        rollout = self.rollouts.get(tenant.name)
        return self._payloads.build(self.state, self._lock, tenant.name, tenant.share, rollout)

    def update_compact(self, tenant: Tenant) -> int:
        """Bring ``tenant``'s compact summaries (``self.compact``) up to its version now,
        a slice at a time; call it off the event loop."""
        rollout = self.rollouts.get(tenant.name)
        return self.compact.update(self.state, self._lock, tenant.name, tenant.share, rollout)

    def forget_snapshots(self, tenant: Tenant) -> int:
        """Drop what ``snapshot_payload`` and ``update_compact`` keep for ``tenant`` (its
        last stream ended); the serialized bytes that freed."""
        return self._payloads.forget(tenant.name) + self.compact.forget(tenant.name)

    def snapshot_bytes(self) -> int:
        """Serialized bytes ``snapshot_payload`` and ``update_compact`` keep, all tenants."""
        return self._payloads.held_bytes() + self.compact.held_bytes()


def _load_snapshot(payload: bytes) -> ModelState | None:
    """A stored snapshot, or None (logged) if it cannot be read: the log is replayed."""
    try:
        return ModelState.loads(payload)
    except Exception:
        log.exception("snapshot unreadable; replaying the whole log")
        return None


#: Events a group commit takes at most (a larger batch is committed alone).
GROUP_EVENTS = 1000


class _Pending:
    """A batch waiting for a group commit: its result, or its error, once finished;
    ``passed``: groups committed without it while it waited."""

    __slots__ = ("calls", "error", "finished", "passed", "result", "tenant")

    def __init__(self, tenant: Tenant, calls: Sequence[ToolCall]) -> None:
        self.tenant, self.calls = tenant, calls
        self.result: AppendResult | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.passed = 0

    def fail(self, error: BaseException) -> None:
        if self.error is None and self.result is None:
            self.error = error


def _group(queued: list[_Pending]) -> tuple[list[_Pending], list[_Pending]]:
    """The next group commit out of ``queued`` and what stays queued: batches passed over
    before go first (a large batch waits for at most one group), then the smallest, up to
    ``GROUP_EVENTS`` events (at least one batch). Within a group, batches keep the order
    they came in.

    >>> calls = lambda n: [None] * n
    >>> big, small = _Pending(None, calls(1000)), _Pending(None, calls(10))
    >>> group, rest = _group([big, small])
    >>> [len(p.calls) for p in group], [len(p.calls) for p in rest], big.passed
    ([10], [1000], 1)
    >>> [len(p.calls) for p in _group(rest)[0]]
    [1000]
    """
    order = sorted(range(len(queued)), key=lambda i: (-queued[i].passed, len(queued[i].calls)))
    taken: set[int] = set()
    events = 0
    for i in order:
        n = len(queued[i].calls)
        if taken and events + n > GROUP_EVENTS:
            continue
        taken.add(i)
        events += n
    rest = [p for i, p in enumerate(queued) if i not in taken]
    for p in rest:
        p.passed += 1
    return [p for i, p in enumerate(queued) if i in taken], rest
