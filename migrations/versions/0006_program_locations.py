"""Where each program's latest turn arrived, shared by the replicas of one database.

Pin coherence (``PinCoherenceService``) tells the engine a program left that its turn
arrived elsewhere. A server on PostgreSQL keeps the programs' locations in this table, so
that replicas sharing the database see moves between engines linked to different replicas
(the move itself travels by ``NOTIFY``). One row per (tenant, program id): the engine its
latest turn arrived at, when (the engine's clock), and when a replica stored it (its own
clock; rows not refreshed for an hour are pruned by that column). A SQLite server keeps
the locations in memory and leaves the table empty.

Downgrade drops the table: the locations are transient (a program whose location is lost
counts as new at its next arrival; no statistics depend on them).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "program_locations",
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("program_id", sa.String(256), nullable=False),
        sa.Column("engine_id", sa.String(64), nullable=False),
        sa.Column("arrived_at", sa.Float, nullable=False),
        sa.Column("seen_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "program_id", name="pk_program_locations"),
    )
    op.create_index("ix_program_locations_seen", "program_locations", ["seen_at"])


def downgrade() -> None:
    op.drop_index("ix_program_locations_seen", "program_locations")
    op.drop_table("program_locations")
