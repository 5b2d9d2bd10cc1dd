"""Schema revisions: read the database's, upgrade it (``cachettl db upgrade``), or go back."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect

from controlplane._resources import data_dir
from controlplane.errors import SchemaOutOfDateError
from controlplane.storage.schema import HEAD_REVISION

__all__ = ["check_schema", "current_revision", "downgrade", "upgrade"]


def _config(connection: object) -> Config:
    config = Config()
    config.set_main_option("script_location", str(data_dir("migrations")))
    config.attributes["connection"] = connection
    return config


def current_revision(engine: Engine) -> str | None:
    """The database's Alembic revision (None: never migrated)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade the schema to ``revision``; returns (revision before, revision after)."""
    before = current_revision(engine)
    with engine.begin() as connection:
        command.upgrade(_config(connection), revision)
    return before, current_revision(engine)


def downgrade(engine: Engine, revision: str) -> tuple[str | None, str | None]:
    """Take the schema back to ``revision``; returns (revision before, revision after)."""
    before = current_revision(engine)
    with engine.begin() as connection:
        command.downgrade(_config(connection), revision)
    return before, current_revision(engine)


def check_schema(engine: Engine, url_for_message: str) -> None:
    """Initialise an empty database; refuse one whose schema is not ``HEAD_REVISION``."""
    revision = current_revision(engine)
    if revision == HEAD_REVISION:
        return
    if revision is None and not inspect(engine).get_table_names():
        upgrade(engine)
        return
    raise SchemaOutOfDateError(
        f"database schema is at revision {revision}, this version needs {HEAD_REVISION}; "
        f"upgrade it with: cachettl db upgrade --db {url_for_message}"
    )
