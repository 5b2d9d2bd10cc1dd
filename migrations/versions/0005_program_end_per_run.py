"""A program end is identified by (tenant, program id, finish time), not by the program id.

A program id can run more than once (a session id reused after its program ended, a
benchmark rerunning the same instance id, a program back after the engine hook forgot it
as abandoned); each run ends at its own time, and each end counts in the turn-count
statistics. Resending the same end (same program id and finish time) stays a repeat.

The unique constraint on (tenant_id, program_id) becomes one on (tenant_id, program_id,
finished_at). SQL counts NULLs as distinct there, so a partial unique index keeps the
old rule for ends sent without a finish time: at most one per (tenant_id, program_id).
Existing rows keep their positions (``seq``): they were unique by program id, so they
satisfy both new rules. SQLite rebuilds the table (Alembic batch mode) and copies its
rows; PostgreSQL alters it in place.

Downgrade restores the constraint on (tenant_id, program_id). It refuses, changing
nothing, while any (tenant, program id) holds more than one end: dropping rows would
silently change the statistics learned from them and the log positions snapshots refer
to. Delete the extra rows yourself (the query is in the error) and run it again.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_UNTIMED = sa.text("finished_at IS NULL")
_REPEATED = (
    "SELECT tenant_id, program_id, count(*) FROM program_ends"
    " GROUP BY tenant_id, program_id HAVING count(*) > 1"
)


def upgrade() -> None:
    with op.batch_alter_table("program_ends") as batch:
        batch.drop_constraint("uq_program_ends_tenant_program", type_="unique")
        batch.create_unique_constraint(
            "uq_program_ends_tenant_program_finished", ["tenant_id", "program_id", "finished_at"]
        )
    # Created after the batch so that SQLite's table rebuild never has to copy it.
    op.create_index(
        "uq_program_ends_tenant_program_untimed",
        "program_ends",
        ["tenant_id", "program_id"],
        unique=True,
        sqlite_where=_UNTIMED,
        postgresql_where=_UNTIMED,
    )


def downgrade() -> None:
    repeated = op.get_bind().execute(sa.text(_REPEATED)).fetchall()
    if repeated:
        raise RuntimeError(
            f"cannot downgrade to 0004: {len(repeated)} (tenant, program id) pairs hold more"
            f" than one program end, which 0004 cannot store; nothing was changed. List them"
            f" with: {_REPEATED}"
        )
    op.drop_index("uq_program_ends_tenant_program_untimed", "program_ends")
    with op.batch_alter_table("program_ends") as batch:
        batch.drop_constraint("uq_program_ends_tenant_program_finished", type_="unique")
        batch.create_unique_constraint(
            "uq_program_ends_tenant_program", ["tenant_id", "program_id"]
        )
