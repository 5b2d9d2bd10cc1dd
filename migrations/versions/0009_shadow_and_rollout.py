"""Shadow mode and tool-by-tool rollout.

``tool_events.shadow``: the engine ran in shadow mode for the call (its own setting, or a
tool outside the tenant's rollout): it pinned nothing, ``chosen_ttl_s`` is the TTL it would
have pinned for and ``pin_outcome`` what that pin would have met. Existing rows are real
pins (false). ``tenant_rollouts``: each tenant's rollout (``cachettl rollout set``), one row
per tenant that ever had one: ``mode`` (a ``RolloutMode``; 0: none), ``tools`` (names
joined by commas), ``version`` (raised by every change) and ``updated_at``.

Downgrade drops both: the rollouts are forgotten, and shadow calls stored until then are
counted as real pins by a server of 0008 (their outcomes are what the pins would have met).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "tool_events",
        sa.Column("shadow", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "tenant_rollouts",
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("mode", sa.SmallInteger, nullable=False),
        sa.Column("tools", sa.Text, nullable=False, server_default=""),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tenant_rollouts")
    with op.batch_alter_table("tool_events") as batch:
        batch.drop_column("shadow")
