"""``turn_index`` holds the whole wire type (``uint32``): BIGINT.

On PostgreSQL INTEGER stopped at 2^31 - 1 and a larger, valid turn index failed the batch
("integer out of range"). SQLite's INTEGER already holds 64 bits, so nothing changes there.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.alter_column(
        "tool_events",
        "turn_index",
        type_=sa.BigInteger,
        existing_type=sa.Integer,
        existing_nullable=False,
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.alter_column(
        "tool_events",
        "turn_index",
        type_=sa.Integer,
        existing_type=sa.BigInteger,
        existing_nullable=False,
    )
