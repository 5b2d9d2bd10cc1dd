"""Tenants, the tool-call log and program ends.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("share", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float, nullable=True),
    )
    op.create_table(
        "tool_events",
        sa.Column("seq", _SEQ, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("program_id", sa.String(256), nullable=False),
        sa.Column("tool_name", sa.String(128), nullable=False),
        sa.Column("tool_args", sa.Text, nullable=False),
        sa.Column("duration_s", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("turn_index", sa.Integer, nullable=False),
        sa.Column("shared", sa.Boolean, nullable=False),
        sa.Column("received_at", sa.Float, nullable=False),
        sa.UniqueConstraint("tenant_id", "event_id", name="uq_tool_events_tenant_event"),
    )
    op.create_index("ix_tool_events_tenant_tool", "tool_events", ["tenant_id", "tool_name", "seq"])
    op.create_table(
        "program_ends",
        sa.Column("seq", _SEQ, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("program_id", sa.String(256), nullable=False),
        sa.Column("total_turns", sa.Integer, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("received_at", sa.Float, nullable=False),
        sa.UniqueConstraint("tenant_id", "program_id", name="uq_program_ends_tenant_program"),
    )


def downgrade() -> None:
    op.drop_table("program_ends")
    op.drop_index("ix_tool_events_tenant_tool", "tool_events")
    op.drop_table("tool_events")
    op.drop_table("tenants")
