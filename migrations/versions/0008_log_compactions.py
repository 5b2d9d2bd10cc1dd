"""Compactions of the event log: the positions through which rows may be gone.

A compaction (``cachettl db compact``, or ``cachettl serve --log-retention``) deletes the
rows of ``tool_events`` and ``program_ends`` that a stored model snapshot covers and that lie
beyond the retention horizon. Before it deletes anything it writes its row here: the
snapshot's policy and positions (``tool_seq``, ``end_seq``), the horizon it applies
(``cutoff``: rows received before it; ``keep_rows``: a tenant's newest rows kept), and when it
started; when it is done, how many rows it deleted and when it finished. A server starting on
the database, or tailing it, must restore from a snapshot that covers the latest row's
positions: below them the log is no longer whole.

Downgrade drops the table (the rows it describes are gone either way; a server of an older
revision would replay what is left, so downgrade only a database never compacted).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "log_compactions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("policy", sa.String(32), nullable=False),
        sa.Column("tool_seq", sa.BigInteger, nullable=False),
        sa.Column("end_seq", sa.BigInteger, nullable=False),
        sa.Column("cutoff", sa.Float, nullable=True),
        sa.Column("keep_rows", sa.BigInteger, nullable=True),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("tool_rows_deleted", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("end_rows_deleted", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("log_compactions")
