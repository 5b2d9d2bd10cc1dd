"""Pin outcomes reported by engine hooks, and model snapshots.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("tool_events", sa.Column("chosen_ttl_s", sa.Float, nullable=True))
    op.add_column(
        "tool_events",
        sa.Column("pin_outcome", sa.SmallInteger, nullable=False, server_default="0"),
    )
    op.add_column("tool_events", sa.Column("admission_delay_s", sa.Float, nullable=True))
    op.create_table(
        "snapshots",
        sa.Column("id", _SEQ, primary_key=True, autoincrement=True),
        sa.Column("policy", sa.String(32), nullable=False),
        sa.Column("tool_seq", sa.BigInteger, nullable=False),
        sa.Column("end_seq", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
    )
    op.create_index("ix_snapshots_policy", "snapshots", ["policy", "id"])


def downgrade() -> None:
    op.drop_index("ix_snapshots_policy", "snapshots")
    op.drop_table("snapshots")
    with op.batch_alter_table("tool_events") as batch:
        batch.drop_column("admission_delay_s")
        batch.drop_column("pin_outcome")
        batch.drop_column("chosen_ttl_s")
