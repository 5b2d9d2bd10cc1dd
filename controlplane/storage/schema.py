"""The current database schema as SQLAlchemy Core tables (what the code reads and writes).

Migrations under ``migrations/versions`` never import this module: each revision spells
out its own DDL, frozen. Every index of tenant data leads with the tenant; the exceptions
are the tenants table's unique name and token-hash indexes, the snapshot table's, which
holds cluster-wide state keyed by policy, and the program locations' age index, by which
they are pruned across tenants.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)

__all__ = [
    "HEAD_REVISION",
    "log_compactions",
    "metadata",
    "program_ends",
    "program_locations",
    "snapshots",
    "tenant_rollouts",
    "tenants",
    "tool_events",
]

#: The Alembic revision this code expects.
HEAD_REVISION = "0009"

#: BIGINT on PostgreSQL; INTEGER (an alias of the rowid, so autoincrementing) on SQLite.
_SEQ = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

tenants = Table(
    "tenants",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(64), nullable=False, unique=True),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("share", Boolean, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
    # Position of the write that last changed who holds the tenant's token (created,
    # revoked, rotated): replicas' tails read the changes past the last one they saw
    # (revision 0007; Store.tenant_changes).
    Column("auth_seq", BigInteger, nullable=False, server_default="0"),
    Index("ix_tenants_auth_seq", "auth_seq"),
)

tool_events = Table(
    "tool_events",
    metadata,
    Column("seq", _SEQ, primary_key=True, autoincrement=True),
    Column("tenant_id", Integer, ForeignKey("tenants.id"), nullable=False),
    Column("event_id", String(128), nullable=False),
    Column("program_id", String(256), nullable=False),
    Column("tool_name", String(128), nullable=False),
    Column("tool_args", Text, nullable=False),
    Column("duration_s", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    Column("turn_index", BigInteger, nullable=False),  # the wire's uint32
    Column("shared", Boolean, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("chosen_ttl_s", Float, nullable=True),
    Column("pin_outcome", SmallInteger, nullable=False, server_default="0"),
    Column("admission_delay_s", Float, nullable=True),
    # What the returning turn found of the cache (controlplane.records.TurnCache).
    Column("miss_reason", SmallInteger, nullable=False, server_default="0"),
    Column("not_pinned_cause", SmallInteger, nullable=False, server_default="0"),
    Column("expired_by_s", Float, nullable=True),
    Column("diverged_at", BigInteger, nullable=True),
    Column("hit_tokens", BigInteger, nullable=True),
    Column("reusable_tokens", BigInteger, nullable=True),
    # The engine ran in shadow mode: nothing was pinned (revision 0009).
    Column("shadow", Boolean, nullable=False, server_default=false()),
    UniqueConstraint("tenant_id", "event_id", name="uq_tool_events_tenant_event"),
    Index("ix_tool_events_tenant_tool", "tenant_id", "tool_name", "seq"),
    Index("ix_tool_events_tenant_reason", "tenant_id", "miss_reason", "seq"),
    Index("ix_tool_events_tenant_program", "tenant_id", "program_id", "seq"),
)

program_ends = Table(
    "program_ends",
    metadata,
    Column("seq", _SEQ, primary_key=True, autoincrement=True),
    Column("tenant_id", Integer, ForeignKey("tenants.id"), nullable=False),
    Column("program_id", String(256), nullable=False),
    Column("total_turns", Integer, nullable=False),
    Column("finished_at", Float, nullable=True),
    Column("received_at", Float, nullable=False),
    # One end per run of a program id: a rerun ends at another time (revision 0005).
    UniqueConstraint(
        "tenant_id", "program_id", "finished_at", name="uq_program_ends_tenant_program_finished"
    ),
    # NULLs are distinct above: ends sent without a time stay one per program id.
    Index(
        "uq_program_ends_tenant_program_untimed",
        "tenant_id",
        "program_id",
        unique=True,
        sqlite_where=text("finished_at IS NULL"),
        postgresql_where=text("finished_at IS NULL"),
    ),
)

snapshots = Table(
    "snapshots",
    metadata,
    Column("id", _SEQ, primary_key=True, autoincrement=True),
    Column("policy", String(32), nullable=False),
    Column("tool_seq", BigInteger, nullable=False),
    Column("end_seq", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Index("ix_snapshots_policy", "policy", "id"),
)

#: Where each program's latest turn arrived (PostgreSQL only; revision 0006 and
#: :mod:`controlplane.storage.locations`).
program_locations = Table(
    "program_locations",
    metadata,
    Column("tenant_id", Integer, ForeignKey("tenants.id"), primary_key=True),
    Column("program_id", String(256), primary_key=True),
    Column("engine_id", String(64), nullable=False),
    Column("arrived_at", Float, nullable=False),
    Column("seen_at", Float, nullable=False),
    Index("ix_program_locations_seen", "seen_at"),
)

#: Compactions of the event log (revision 0008; :mod:`controlplane.storage.retention`): the
#: positions through which rows may be gone, written before anything is deleted.
log_compactions = Table(
    "log_compactions",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("policy", String(32), nullable=False),
    Column("tool_seq", BigInteger, nullable=False),
    Column("end_seq", BigInteger, nullable=False),
    Column("cutoff", Float, nullable=True),
    Column("keep_rows", BigInteger, nullable=True),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    Column("tool_rows_deleted", BigInteger, nullable=False, server_default="0"),
    Column("end_rows_deleted", BigInteger, nullable=False, server_default="0"),
)

#: Each tenant's rollout: which tools its engines pin (revision 0009;
#: :mod:`controlplane.storage.rollouts`). ``mode`` is a ``RolloutMode`` (0: none, the
#: engines' own setting), ``tools`` its tool names joined by commas, ``version`` raised by
#: every change.
tenant_rollouts = Table(
    "tenant_rollouts",
    metadata,
    Column("tenant_id", Integer, ForeignKey("tenants.id"), primary_key=True),
    Column("mode", SmallInteger, nullable=False),
    Column("tools", Text, nullable=False, server_default=""),
    Column("version", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
)
