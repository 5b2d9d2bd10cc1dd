"""``Store`` on SQLAlchemy 2: SQLite (embedded, WAL) or PostgreSQL (psycopg 3).

Writers commit in ``seq`` order: on SQLite every write transaction starts with
``BEGIN IMMEDIATE`` (one writer at a time); on PostgreSQL it takes a transaction-level
advisory lock before drawing positions, so a position is never committed after a higher
one and tailing readers never miss a row.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, func, insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError

from controlplane.errors import (
    TenantExistsError,
    TenantNotFoundError,
)
from controlplane.kvhints import quote
from controlplane.records import (
    AppendResult,
    MissQuery,
    MissReason,
    NotPinnedCause,
    PinOutcome,
    ProgramEnd,
    SnapshotRecord,
    StoredProgramEnd,
    StoredToolCall,
    Tenant,
    ToolCall,
    TurnCache,
)
from controlplane.storage import retention, rollouts
from controlplane.storage.base import (
    SNAPSHOTS_KEPT,
    Batch,
    Compaction,
    Horizon,
    Store,
    TenantChange,
)
from controlplane.storage.migrate import check_schema as _check_schema
from controlplane.storage.rollouts import Rollout, StoredRollout
from controlplane.storage.schema import program_ends, snapshots, tenants, tool_events
from controlplane.storage.transactions import LOG_LOCK, autocommit, transaction, translated

__all__ = ["SqlStore", "autocommit", "make_engine", "transaction"]

#: How long a writer waits for SQLite's write lock before failing.
BUSY_TIMEOUT_S = 10.0
#: A pooled PostgreSQL connection idle this long is checked before use.
PING_IDLE_S = 1.0


def normalize_url(url: str) -> str:
    """Pick psycopg 3 for plain PostgreSQL URLs."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite files get WAL, a busy timeout and full sync."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        pg = create_engine(
            url, pool_size=8, max_overflow=8, connect_args={"prepare_threshold": None}
        )
        _ping_when_idle(pg)
        return pg
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url, connect_args={"timeout": BUSY_TIMEOUT_S, "check_same_thread": False}
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA synchronous=FULL")  # durable before acknowledgement
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        write = connection.get_execution_options().get("cachettl_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _ping_when_idle(engine: Engine) -> None:
    """Check a pooled connection on checkout only if it sat idle ``PING_IDLE_S`` or more
    (one ``SELECT 1``; a dead one is replaced, as with ``pool_pre_ping``), so that a busy
    writer pays no extra round trip per batch. A connection that dies while in use fails
    its call (UNAVAILABLE, nothing committed) and is dropped with the rest of the pool."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["cachettl_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("cachettl_idle_since")
        if idle_since is None or time.monotonic() - idle_since < PING_IDLE_S:
            return
        try:
            dbapi_connection.execute("SELECT 1")
            dbapi_connection.rollback()
        except Exception as error:  # the pool retries with a new connection
            raise DisconnectionError(str(error)) from error


_COLUMNS = (
    "tenant_id",
    "event_id",
    "program_id",
    "tool_name",
    "tool_args",
    "duration_s",
    "finished_at",
    "turn_index",
    "shared",
    "received_at",
    "chosen_ttl_s",
    "pin_outcome",
    "admission_delay_s",
    "miss_reason",
    "not_pinned_cause",
    "expired_by_s",
    "diverged_at",
    "hit_tokens",
    "reusable_tokens",
    "shadow",
)
_SQLITE_INSERT = (
    f"INSERT INTO tool_events ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
)
_SQLITE_STORED_IDS = (
    "SELECT event_id FROM tool_events WHERE tenant_id = ? "
    "AND event_id IN (SELECT value FROM json_each(?))"
)

_ARRAY_COLUMNS = {
    "event_id": "VARCHAR",
    "program_id": "VARCHAR",
    "tool_name": "VARCHAR",
    "tool_args": "TEXT",
    "duration_s": "FLOAT8",
    "finished_at": "FLOAT8",
    "turn_index": "BIGINT",
    "chosen_ttl_s": "FLOAT8",
    "pin_outcome": "SMALLINT",
    "admission_delay_s": "FLOAT8",
    "miss_reason": "SMALLINT",
    "not_pinned_cause": "SMALLINT",
    "expired_by_s": "FLOAT8",
    "diverged_at": "BIGINT",
    "hit_tokens": "BIGINT",
    "reusable_tokens": "BIGINT",
    "shadow": "BOOLEAN",
}
#: The batches of a group in one statement and one round trip, run as its own transaction
#: (autocommit): every row it inserts is joined with the log's advisory lock, so the lock
#: is held before the first row takes its position and until the statement commits; stored
#: ids are skipped by the unique constraint; positions come back in the rows' order.
_PG_ARRAYS = {"tenant_id": "INTEGER", "shared": "BOOLEAN", **_ARRAY_COLUMNS}
_PG_INSERT = (
    f"WITH log_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock({LOG_LOCK})) "
    f"INSERT INTO tool_events (received_at, {', '.join(_PG_ARRAYS)}) "
    "SELECT %(now)s, u.* FROM unnest("
    + ", ".join(f"CAST(%({k})s AS {t}[])" for k, t in _PG_ARRAYS.items())
    + ") AS u CROSS JOIN log_lock ON CONFLICT (tenant_id, event_id) DO NOTHING "
    "RETURNING tenant_id, event_id, seq"
)


def _first_occurrences(batches: Sequence[Batch]) -> list[list[ToolCall]]:
    """Each batch's calls in order, without repeats of a (tenant, ``event_id``) earlier in
    the batch or in an earlier batch of the group."""
    seen: set[tuple[int, str]] = set()
    unique: list[list[ToolCall]] = []
    for tenant, calls in batches:
        kept = []
        for call in calls:
            key = (tenant.id, call.event_id)
            if key not in seen:
                seen.add(key)
                kept.append(call)
        unique.append(kept)
    return unique


def _next_auth_seq(c: Connection) -> int:
    """The position of a token change (inside a write transaction: writers hold the log's
    lock, so positions are drawn and committed in order)."""
    return int(c.execute(select(func.coalesce(func.max(tenants.c.auth_seq), 0))).scalar_one()) + 1


def _tenant(row: Any) -> Tenant:
    return Tenant(row.id, row.name, bool(row.share), row.created_at, row.revoked_at)


def _call_row(tenant: Tenant, call: ToolCall, now: float) -> dict[str, Any]:
    return {
        "tenant_id": tenant.id,
        "event_id": call.event_id,
        "program_id": call.program_id,
        "tool_name": call.tool,
        "tool_args": call.tool_args,
        "duration_s": call.duration_s,
        "finished_at": call.finished_at,
        "turn_index": call.turn_index,
        "shared": tenant.share,
        "received_at": now,
        "chosen_ttl_s": call.chosen_ttl_s,
        "pin_outcome": int(call.pin_outcome),
        "admission_delay_s": call.admission_delay_s,
        "miss_reason": int(call.cache.reason),
        "not_pinned_cause": int(call.cache.not_pinned_cause),
        "expired_by_s": call.cache.expired_by_s,
        "diverged_at": call.cache.diverged_at,
        "hit_tokens": call.cache.hit_tokens,
        "reusable_tokens": call.cache.reusable_tokens,
        "shadow": call.shadow,
    }


def _stored_call(row: Any) -> StoredToolCall:
    call = ToolCall(
        row.event_id,
        row.program_id,
        row.tool_name,
        row.tool_args,
        row.duration_s,
        row.finished_at,
        row.turn_index,
        row.chosen_ttl_s,
        PinOutcome(row.pin_outcome),
        row.admission_delay_s,
        TurnCache(
            MissReason(row.miss_reason),
            NotPinnedCause(row.not_pinned_cause),
            row.expired_by_s,
            row.diverged_at,
            row.hit_tokens,
            row.reusable_tokens,
        ),
        bool(row.shadow),
    )
    return StoredToolCall(row.seq, row.name, bool(row.shared), call)


def _of(query: Any, tenant: str, tool: str | None, program: str | None) -> Any:
    """``query`` over ``tool_events`` restricted to one tenant's, tool's and program's."""
    query = query.join(tenants, tenants.c.id == tool_events.c.tenant_id).where(
        tenants.c.name == tenant
    )
    if tool is not None:
        query = query.where(tool_events.c.tool_name == tool)
    if program is not None:
        query = query.where(tool_events.c.program_id == program)
    return query


class SqlStore(Store):
    """A ``Store`` in a SQL database (see the module docstring for the ordering rules)."""

    def __init__(self, url: str, check_schema: bool = True) -> None:
        self.url = url
        self.engine = make_engine(url)
        if check_schema:
            with translated():  # driver errors as StorageError
                _check_schema(self.engine, url)

    # -- tenants ----------------------------------------------------------------------

    def create_tenant(self, name: str, share: bool, token_hash: str, now: float) -> Tenant:
        with transaction(self.engine, write=True) as c:
            if c.execute(select(tenants.c.id).where(tenants.c.name == name)).first():
                raise TenantExistsError(f"tenant {quote(name)} already exists")
            values = {
                "name": name,
                "token_hash": token_hash,
                "share": share,
                "created_at": now,
                "auth_seq": _next_auth_seq(c),
            }
            new_id = c.execute(insert(tenants).values(values).returning(tenants.c.id)).scalar()
        return Tenant(int(new_id or 0), name, share, now)

    def list_tenants(self) -> list[Tenant]:
        with transaction(self.engine) as c:
            rows = c.execute(select(tenants).order_by(tenants.c.name)).all()
        return [_tenant(r) for r in rows]

    def revoke_tenant(self, name: str, now: float) -> None:
        with transaction(self.engine, write=True) as c:
            found = c.execute(select(tenants.c.id).where(tenants.c.name == name)).first()
            if found is None:
                raise TenantNotFoundError(f"no tenant named {quote(name)}")
            c.execute(
                update(tenants)
                .where(tenants.c.name == name, tenants.c.revoked_at.is_(None))
                .values(revoked_at=now, auth_seq=_next_auth_seq(c))
            )

    def rotate_token(self, name: str, token_hash: str) -> Tenant:
        with transaction(self.engine, write=True) as c:
            found = c.execute(select(tenants.c.id).where(tenants.c.name == name)).first()
            if found is None:
                raise TenantNotFoundError(f"no tenant named {quote(name)}")
            c.execute(
                update(tenants)
                .where(tenants.c.name == name)
                .values(token_hash=token_hash, revoked_at=None, auth_seq=_next_auth_seq(c))
            )
            row = c.execute(select(tenants).where(tenants.c.name == name)).one()
        return _tenant(row)

    def tenant_by_token_hash(self, token_hash: str) -> Tenant | None:
        query = select(tenants).where(tenants.c.token_hash == token_hash)
        with transaction(self.engine) as c:
            row = c.execute(query).first()
        return _tenant(row) if row is not None else None

    def tenant_changes(self, after_seq: int) -> list[TenantChange]:
        query = select(tenants).where(tenants.c.auth_seq > after_seq).order_by(tenants.c.auth_seq)
        with transaction(self.engine) as c:
            return [
                TenantChange(int(r.auth_seq), _tenant(r), r.token_hash) for r in c.execute(query)
            ]

    def set_rollout(self, name: str, rollout: Rollout | None, now: float) -> StoredRollout:
        return rollouts.sql_set(self.engine, name, rollout, now)

    def rollouts(self) -> list[StoredRollout]:
        return rollouts.sql_all(self.engine)

    # -- the event log ----------------------------------------------------------------

    def append_batches(self, batches: Sequence[Batch]) -> list[AppendResult]:
        now = time.time()
        unique = _first_occurrences(batches)
        seqs: list[list[int]] = [[] for _ in batches]
        if any(unique):
            if self.engine.dialect.name == "sqlite":
                with transaction(self.engine, write=True) as c:
                    for i, ((tenant, _), calls) in enumerate(zip(batches, unique, strict=True)):
                        if calls:
                            seqs[i] = self._append_sqlite(c, tenant, calls, now)
            else:
                with autocommit(self.engine) as c:
                    seqs = self._append_postgres(c, batches, unique, now)
        return [
            AppendResult(tuple(s), len(calls) - len(s))
            for (_, calls), s in zip(batches, seqs, strict=True)
        ]

    @staticmethod
    def _append_sqlite(
        c: Connection, tenant: Tenant, calls: list[ToolCall], now: float
    ) -> list[int]:
        ids = json.dumps([call.event_id for call in calls])  # one parameter, not one per id
        seen = {row[0] for row in c.exec_driver_sql(_SQLITE_STORED_IDS, (tenant.id, ids))}
        rows = [_call_row(tenant, call, now) for call in calls if call.event_id not in seen]
        if not rows:
            return []
        # The writer holds SQLite's write lock (BEGIN IMMEDIATE) and an INTEGER PRIMARY KEY
        # takes max + 1, so the new rows' positions are the last len(rows) ones, in order.
        c.exec_driver_sql(_SQLITE_INSERT, [tuple(r[k] for k in _COLUMNS) for r in rows])
        last = int(c.exec_driver_sql("SELECT max(seq) FROM tool_events").scalar_one())
        return list(range(last - len(rows) + 1, last + 1))

    @staticmethod
    def _append_postgres(
        c: Connection, batches: Sequence[Batch], unique: list[list[ToolCall]], now: float
    ) -> list[list[int]]:
        # One statement, one round trip (_PG_INSERT): the group's rows as column arrays.
        rows = [
            _call_row(tenant, call, now)
            for (tenant, _), calls in zip(batches, unique, strict=True)
            for call in calls
        ]
        params: dict[str, Any] = {name: [r[name] for r in rows] for name in _PG_ARRAYS}
        params["now"] = now
        inserted = {(t, e): int(s) for t, e, s in c.exec_driver_sql(_PG_INSERT, params)}
        return [
            [inserted[k] for call in calls if (k := (tenant.id, call.event_id)) in inserted]
            for (tenant, _), calls in zip(batches, unique, strict=True)
        ]

    def append_program_end(self, tenant: Tenant, end: ProgramEnd) -> int | None:
        with transaction(self.engine, write=True) as c:
            # One end per run: a rerun of the program id ends at another time, a resend
            # of this end carries the same one (None matches None: IS NULL). Another
            # engine's view of an end, at its own clock's time, is a row of its own: the
            # models tell it apart when they learn the log (ModelState.apply_program_ends).
            query = select(program_ends.c.seq).where(
                program_ends.c.tenant_id == tenant.id,
                program_ends.c.program_id == end.program_id,
                program_ends.c.finished_at == end.finished_at,
            )
            if c.execute(query).first() is not None:
                return None
            values = {
                "tenant_id": tenant.id,
                "program_id": end.program_id,
                "total_turns": end.total_turns,
                "finished_at": end.finished_at,
                "received_at": time.time(),
            }
            seq = c.execute(insert(program_ends).values(values).returning(program_ends.c.seq))
            return int(seq.scalar_one())

    def read_tool_calls(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredToolCall]:
        query = (
            select(tool_events, tenants.c.name)
            .join(tenants, tenants.c.id == tool_events.c.tenant_id)
            .where(tool_events.c.seq > after_seq)
            .order_by(tool_events.c.seq)
            .limit(limit)
        )
        if tenant is not None:
            query = query.where(tenants.c.name == tenant)
        with transaction(self.engine) as c:
            return [_stored_call(r) for r in c.execute(query)]

    def read_program_ends(
        self, after_seq: int, limit: int, tenant: str | None = None
    ) -> list[StoredProgramEnd]:
        query = (
            select(program_ends, tenants.c.name)
            .join(tenants, tenants.c.id == program_ends.c.tenant_id)
            .where(program_ends.c.seq > after_seq)
            .order_by(program_ends.c.seq)
            .limit(limit)
        )
        if tenant is not None:
            query = query.where(tenants.c.name == tenant)
        with transaction(self.engine) as c:
            return [
                StoredProgramEnd(
                    r.seq, r.name, ProgramEnd(r.program_id, r.total_turns, r.finished_at)
                )
                for r in c.execute(query)
            ]

    def log_rows(self) -> tuple[int, int]:
        with transaction(self.engine) as c:
            return retention.rows(c)

    def compact_log(
        self, snapshot: SnapshotRecord, horizon: Horizon, now: float, dry_run: bool = False
    ) -> Compaction:
        with translated():
            return retention.compact(self.engine, snapshot, horizon, now, dry_run)

    def log_compaction(self) -> Compaction | None:
        with transaction(self.engine) as c:
            return retention.latest(c)

    def count_tool_calls(self, tenant: str | None = None) -> int:
        query = select(func.count()).select_from(tool_events)
        if tenant is not None:
            query = query.join(tenants, tenants.c.id == tool_events.c.tenant_id).where(
                tenants.c.name == tenant
            )
        with transaction(self.engine) as c:
            return int(c.execute(query).scalar_one())

    # -- returning turns --------------------------------------------------------------

    def list_misses(self, tenant: str, query: MissQuery) -> list[StoredToolCall]:
        reasons = sorted(int(r) for r in query.reasons)
        select_rows = select(tool_events, tenants.c.name).select_from(tool_events)
        rows = (
            _of(select_rows, tenant, query.tool, query.program)
            .where(tool_events.c.miss_reason.in_(reasons))
            .order_by(tool_events.c.seq.desc())
            .limit(query.limit)
        )
        with transaction(self.engine) as c:
            return [_stored_call(r) for r in c.execute(rows)]

    def miss_counts(
        self, tenant: str, tool: str | None = None, program: str | None = None
    ) -> dict[MissReason, int]:
        reason = tool_events.c.miss_reason
        counts = select(reason, func.count()).select_from(tool_events)
        query = _of(counts, tenant, tool, program).where(reason != 0).group_by(reason)
        with transaction(self.engine) as c:
            return {MissReason(r): int(n) for r, n in c.execute(query)}

    def expired_by(
        self, tenant: str, tool: str | None = None, program: str | None = None, limit: int = 10_000
    ) -> list[float]:
        column = tool_events.c.expired_by_s
        query = (
            _of(select(column).select_from(tool_events), tenant, tool, program)
            .where(tool_events.c.miss_reason == int(MissReason.EXPIRED), column.is_not(None))
            .order_by(tool_events.c.seq.desc())
            .limit(limit)
        )
        with transaction(self.engine) as c:
            return [float(x) for x in c.execute(query).scalars()]

    # -- snapshots --------------------------------------------------------------------

    def save_snapshot(self, snapshot: SnapshotRecord) -> bool:
        values = {
            "policy": snapshot.policy,
            "tool_seq": snapshot.tool_seq,
            "end_seq": snapshot.end_seq,
            "created_at": snapshot.created_at,
            "payload": snapshot.payload,
        }
        with transaction(self.engine, write=True) as c:
            if retention.below_latest(c, snapshot.tool_seq, snapshot.end_seq):
                return False
            c.execute(insert(snapshots).values(values))
            old = (
                select(snapshots.c.id)
                .where(snapshots.c.policy == snapshot.policy)
                .order_by(snapshots.c.id.desc())
                .offset(SNAPSHOTS_KEPT)
            )
            stale = list(c.execute(old).scalars())
            if stale:
                c.execute(snapshots.delete().where(snapshots.c.id.in_(stale)))
        return True

    def latest_snapshot(self, policy: str) -> SnapshotRecord | None:
        query = (
            select(snapshots)
            .where(snapshots.c.policy == policy)
            .order_by(snapshots.c.id.desc())
            .limit(1)
        )
        with transaction(self.engine) as c:
            row = c.execute(query).first()
        if row is None:
            return None
        return SnapshotRecord(row.policy, row.tool_seq, row.end_seq, row.created_at, row.payload)

    def close(self) -> None:
        self.engine.dispose()
