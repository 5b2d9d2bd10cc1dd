"""Retention of the event log in SQL: delete what a snapshot covers beyond a horizon.

The models are a replay of the log, so a row may go only once a stored snapshot holds what
it taught them. :func:`compact` (``SqlStore.compact_log``) takes the snapshot's positions and
a :class:`~controlplane.storage.base.Horizon`, and in this order:

1. in one write transaction (the log's lock: no snapshot is stored meanwhile), checks that
   the newest stored snapshot of the policy still covers those positions, and records the
   compaction in ``log_compactions`` (revision 0008): from its commit on, a server restores
   only from a snapshot covering them, and a snapshot below them is not stored;
2. per log (``tool_events``, ``program_ends``) and per tenant, deletes the rows at or below
   the snapshot's position (and below the log's newest row) that were received before the
   horizon's cutoff or are older than the tenant's newest ``max_rows``, :data:`BATCH` rows
   per short transaction, so that appends wait for one batch at a time;
3. writes the rows deleted and the finishing time into its record.

A crash anywhere leaves the record and some rows: the rows are covered by the snapshot
(a restore skips them, counting nothing twice) and the next compaction deletes them. The
newest row of each log is never deleted, so SQLite (whose ``INTEGER PRIMARY KEY`` takes the
highest position + 1) never reuses a position.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Connection, Engine, Table, and_, delete, func, insert, or_, select, update

from controlplane.records import SnapshotRecord
from controlplane.storage.base import Compaction, Horizon, SnapshotSupersededError
from controlplane.storage.schema import (
    log_compactions,
    program_ends,
    snapshots,
    tenants,
    tool_events,
)
from controlplane.storage.transactions import transaction

__all__ = ["BATCH", "SnapshotSupersededError", "below_latest", "compact", "latest", "rows"]

#: Rows deleted per transaction.
BATCH = 5000


def latest(c: Connection) -> Compaction | None:
    """The latest compaction's record, or None."""
    row = c.execute(select(log_compactions).order_by(log_compactions.c.id.desc()).limit(1)).first()
    if row is None:
        return None
    return Compaction(
        row.policy,
        int(row.tool_seq),
        int(row.end_seq),
        row.cutoff,
        row.keep_rows,
        row.started_at,
        row.finished_at,
        int(row.tool_rows_deleted),
        int(row.end_rows_deleted),
    )


def rows(c: Connection) -> tuple[int, int]:
    """Rows the two logs hold: (tool calls, program ends)."""
    calls, ends = (
        int(c.execute(select(func.count()).select_from(t)).scalar_one())
        for t in (tool_events, program_ends)
    )
    return calls, ends


def below_latest(c: Connection, tool_seq: int, end_seq: int) -> bool:
    """Whether positions ``(tool_seq, end_seq)`` are below the latest compaction's."""
    mark = latest(c)
    return mark is not None and (tool_seq < mark.tool_seq or end_seq < mark.end_seq)


def compact(
    engine: Engine, snapshot: SnapshotRecord, horizon: Horizon, now: float, dry_run: bool
) -> Compaction:
    """Compact the log (the module docstring); a dry run counts and changes nothing."""
    cutoff = horizon.cutoff(now)
    record = Compaction(
        snapshot.policy, snapshot.tool_seq, snapshot.end_seq, cutoff, horizon.max_rows, now
    )
    mark_id = None if dry_run else _mark(engine, record)
    tool_deleted, tool_kept = _prune(engine, tool_events, snapshot.tool_seq, horizon, now, dry_run)
    end_deleted, end_kept = _prune(engine, program_ends, snapshot.end_seq, horizon, now, dry_run)
    finished = None
    if mark_id is not None:
        finished = time.time()
        counts = {"tool_rows_deleted": tool_deleted, "end_rows_deleted": end_deleted}
        with transaction(engine, write=True) as c:
            c.execute(
                update(log_compactions)
                .where(log_compactions.c.id == mark_id)
                .values(finished_at=finished, **counts)
            )
    return Compaction(
        record.policy,
        record.tool_seq,
        record.end_seq,
        cutoff,
        horizon.max_rows,
        now,
        finished,
        tool_deleted,
        end_deleted,
        tool_kept,
        end_kept,
    )


def _mark(engine: Engine, record: Compaction) -> int:
    """Record the compaction (step 1); its id."""
    newest = (
        select(snapshots.c.tool_seq, snapshots.c.end_seq)
        .where(snapshots.c.policy == record.policy)
        .order_by(snapshots.c.id.desc())
        .limit(1)
    )
    with transaction(engine, write=True) as c:
        stored = c.execute(newest).first()
        if stored is None or stored.tool_seq < record.tool_seq or stored.end_seq < record.end_seq:
            raise SnapshotSupersededError(
                f"the newest {record.policy} snapshot does not cover positions "
                f"{record.tool_seq}/{record.end_seq}; nothing deleted"
            )
        values = {
            "policy": record.policy,
            "tool_seq": record.tool_seq,
            "end_seq": record.end_seq,
            "cutoff": record.cutoff,
            "keep_rows": record.keep_rows,
            "started_at": record.started_at,
        }
        return int(
            c.execute(
                insert(log_compactions).values(values).returning(log_compactions.c.id)
            ).scalar_one()
        )


def _prune(
    engine: Engine, table: Table, position: int, horizon: Horizon, now: float, dry_run: bool
) -> tuple[int, int]:
    """Delete (count, in a dry run) one log's rows beyond the horizon at or below
    ``position``; returns (rows deleted, rows kept)."""
    with transaction(engine) as c:
        top = c.execute(select(func.max(table.c.seq))).scalar()
        tenant_ids = list(c.execute(select(tenants.c.id).order_by(tenants.c.id)).scalars())
    deleted = 0
    if top is not None:
        bound = min(position, int(top) - 1)  # the newest row stays: positions never reused
        for tenant_id in tenant_ids:
            beyond = _beyond(engine, table, tenant_id, horizon, now)
            if beyond is None:
                continue
            where = and_(table.c.tenant_id == tenant_id, table.c.seq <= bound, beyond)
            deleted += _count(engine, table, where) if dry_run else _delete(engine, table, where)
    with transaction(engine) as c:
        total = int(c.execute(select(func.count()).select_from(table)).scalar_one())
    return deleted, total - deleted if dry_run else total


def _beyond(engine: Engine, table: Table, tenant_id: int, horizon: Horizon, now: float) -> Any:
    """The condition of a tenant's rows beyond the horizon (None: no row can be)."""
    parts = []
    cutoff = horizon.cutoff(now)
    if cutoff is not None:
        parts.append(table.c.received_at < cutoff)
    if horizon.max_rows is not None:
        # The newest row past the tenant's newest max_rows: it and those below are beyond.
        # Appends meanwhile only push the edge up, so rows at or below it stay beyond.
        edge = (
            select(table.c.seq)
            .where(table.c.tenant_id == tenant_id)
            .order_by(table.c.seq.desc())
            .offset(horizon.max_rows)
            .limit(1)
        )
        with transaction(engine) as c:
            seq = c.execute(edge).scalar()
        if seq is not None:
            parts.append(table.c.seq <= int(seq))
    return or_(*parts) if parts else None


def _count(engine: Engine, table: Table, where: Any) -> int:
    with transaction(engine) as c:
        return int(c.execute(select(func.count()).select_from(table).where(where)).scalar_one())


def _delete(engine: Engine, table: Table, where: Any) -> int:
    """Delete the rows matching ``where``, :data:`BATCH` per transaction; how many."""
    # SQLite: a write transaction from its start (BEGIN IMMEDIATE); PostgreSQL: a plain
    # one (deletes draw no position, so the log's advisory lock is not taken).
    write = engine.dialect.name == "sqlite"
    total = 0
    while True:
        chosen = select(table.c.seq).where(where).order_by(table.c.seq).limit(BATCH)
        with transaction(engine, write=write) as c:
            n = c.execute(delete(table).where(table.c.seq.in_(chosen))).rowcount
        total += n
        if n < BATCH:
            return total
