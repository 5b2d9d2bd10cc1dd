"""What each returning turn found of its previous turn's cache: the miss reason and its
details, with indexes for listing a tenant's misses by reason and by program.

Existing rows get reason 0 (not reported) and no details, as events of engines that do
not send them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "tool_events",
        sa.Column("miss_reason", sa.SmallInteger, nullable=False, server_default="0"),
    )
    op.add_column(
        "tool_events",
        sa.Column("not_pinned_cause", sa.SmallInteger, nullable=False, server_default="0"),
    )
    op.add_column("tool_events", sa.Column("expired_by_s", sa.Float, nullable=True))
    op.add_column("tool_events", sa.Column("diverged_at", sa.BigInteger, nullable=True))
    op.add_column("tool_events", sa.Column("hit_tokens", sa.BigInteger, nullable=True))
    op.add_column("tool_events", sa.Column("reusable_tokens", sa.BigInteger, nullable=True))
    op.create_index(
        "ix_tool_events_tenant_reason", "tool_events", ["tenant_id", "miss_reason", "seq"]
    )
    op.create_index(
        "ix_tool_events_tenant_program", "tool_events", ["tenant_id", "program_id", "seq"]
    )


def downgrade() -> None:
    op.drop_index("ix_tool_events_tenant_program", "tool_events")
    op.drop_index("ix_tool_events_tenant_reason", "tool_events")
    with op.batch_alter_table("tool_events") as batch:
        batch.drop_column("reusable_tokens")
        batch.drop_column("hit_tokens")
        batch.drop_column("diverged_at")
        batch.drop_column("expired_by_s")
        batch.drop_column("not_pinned_cause")
        batch.drop_column("miss_reason")
