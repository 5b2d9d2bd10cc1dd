"""Compactions of the event log: the positions through which rows may be gone.

A compaction (``cachettl db compact``, or ``cachettl serve --log-retention``) deletes the
rows of ``tool_events`` and ``program_ends`` that a stored model snapshot covers and that lie
beyond the retention horizon. Before it deletes anything it writes its row here: the
snapshot's policy and positions (``tool_seq``, ``end_seq``), the horizon it applies
(``cutoff``: rows received before it; ``keep_rows``: a tenant's newest rows kept), and when it
started; when it is done, how many rows it deleted and when it finished. A server starting on
the database, or tailing it, must restore from a snapshot that covers the latest row's
positions: below them the log is no longer whole.

Downgrade drops the table, and refuses while it holds a compaction: a server of revision
0007 would take what is left of the log for the whole log and learn it as such (restore a
backup taken before the first compaction instead).

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
    compactions = op.get_bind().execute(sa.text("SELECT count(*) FROM log_compactions")).scalar()
    if compactions:
        raise RuntimeError(
            f"cannot downgrade to 0007: the event log was compacted ({compactions} "
            "compactions), and a server of 0007 would take what is left for the whole log; "
            "nothing was changed. Restore a backup taken before the first compaction instead"
        )
    op.drop_table("log_compactions")
