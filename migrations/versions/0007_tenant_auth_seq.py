"""Tenants' token changes in order, so that every replica hears of a revocation.

A server answers tokens from a cache that may serve a known tenant for minutes while the
database is down. So that a revocation or a rotation made while the database answers
reaches every replica's cache before an outage can hide it, each write that changes who
holds a tenant's token (creation, revocation, rotation) stamps the tenant with the next
position of ``auth_seq`` (max + 1, under the log's write lock, so positions commit in
order); each replica's tail reads the tenants past the last position it saw and updates
its cache. Existing tenants start at 0, which every replica reads at start.

Downgrade drops the column and its index (the positions are only a change feed).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE on both databases (a batch copy of ``tenants`` would trip SQLite's
    # foreign keys from the tables that reference it).
    op.add_column(
        "tenants", sa.Column("auth_seq", sa.BigInteger, nullable=False, server_default="0")
    )
    op.create_index("ix_tenants_auth_seq", "tenants", ["auth_seq"])


def downgrade() -> None:
    op.drop_index("ix_tenants_auth_seq", "tenants")
    op.drop_column("tenants", "auth_seq")  # SQLite 3.35+ drops an unindexed column
