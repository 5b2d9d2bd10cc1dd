"""Where the control plane keeps its data: the ``Store`` interface, its backends and the
factory that picks one from a URL.

- :mod:`controlplane.storage.base`: the ``Store`` contract every backend meets;
- :mod:`controlplane.storage.memory`: ``MemoryStore`` (tests, ``memory://``);
- :mod:`controlplane.storage.sql`: ``SqlStore`` on SQLite (the embedded default) or PostgreSQL;
  :mod:`controlplane.storage.transactions`, its one transaction helper;
- :mod:`controlplane.storage.retention`: compaction of the SQL event log to a retention
  horizon (what a snapshot covers beyond it is deleted);
- :mod:`controlplane.storage.locations`: on PostgreSQL, the program locations that pin
  coherence shares between replicas, and the moves they publish (``NOTIFY``);
- :mod:`controlplane.storage.schema`, :mod:`controlplane.storage.migrate`: the tables and their
  Alembic migrations.
"""

from __future__ import annotations

from controlplane.storage.base import SNAPSHOTS_KEPT, Store, hash_token, new_token

__all__ = ["SNAPSHOTS_KEPT", "Store", "create_store", "hash_token", "new_token"]


def create_store(url: str, check_schema: bool = True) -> Store:
    """The backend for ``url``: ``memory://``, ``sqlite:///PATH`` or ``postgresql://...``.

    ``check_schema``: refuse (``SchemaOutOfDateError``) a database whose schema is not the
    current revision; an empty database is initialised.
    """
    if url == "memory://":
        from controlplane.storage.memory import MemoryStore

        return MemoryStore()
    if url.startswith(("sqlite:", "postgresql:", "postgresql+psycopg:", "postgres:")):
        from controlplane.storage.sql import SqlStore

        return SqlStore(url, check_schema=check_schema)
    raise ValueError(
        f"--db: unsupported database URL {url!r}; valid: memory://, sqlite:///PATH, "
        "postgresql://USER@HOST:PORT/DB"
    )
